"""lockstep's Triton attention against torch SDPA (flash backend), bf16, Qwen3-8B heads (32 query
heads, 8 kv heads, head_dim 128), on one CUDA device.

- training: `varlen_attention` forward + backward on packed 4k-token sequences (4k and 16k tokens
  in all) vs SDPA causal on the same sequences as a [B, 4k] batch; target >= 0.75x SDPA throughput.
- prefill: `paged_attention` over one 4k / 16k-token prompt in a 16-token-page cache vs SDPA
  causal; target >= 0.8x.
- decode: `paged_attention`, one new token per request against a 16-token-page cache (pages in
  random order) vs SDPA against a contiguous [B, 8, context, 128] cache, at batch {1, 16, 64, 256}
  x context {1k, 4k, 16k, 32k}; target >= 0.7x. Both sides replay CUDA graphs of 10
  calls, so a decode step times the kernels, not Python; a cell whose two caches do not fit in
  free memory is skipped and says so.

Ratios are SDPA time / lockstep time (throughput ratios). GQA on the SDPA side: `enable_gqa=True`
when the flash backend accepts it, else K/V expanded to 32 heads before timing (the title says which).

    python benchmarks/bench_attention.py
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if __package__:  # imported as benchmarks.bench_attention
    from ._harness import graph_ms_per_call, markdown_table, measure
else:  # run as a script, or imported with benchmarks/ on sys.path
    from _harness import graph_ms_per_call, markdown_table, measure

import lockstep.kernels as K

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
SEQ = 4096  # packed training sequence length
TRAIN_TOKENS = [4096, 16384]
PREFILL_TOKENS = [4096, 16384]
DECODE_BATCH = [1, 16, 64, 256]
DECODE_CONTEXT = [1024, 4096, 16384, 32768]
PAGE = 16
TARGETS = {"training": 0.75, "prefill": 0.8, "decode": 0.7}
SCALE = 1.0 / math.sqrt(HEAD_DIM)


def _randn(*shape):
    return torch.randn(*shape, device="cuda", dtype=DTYPE)


def _sdpa_gqa_native() -> bool:
    """Whether the flash backend takes enable_gqa (else the baseline expands K/V)."""
    q, kv = _randn(1, HEADS, 16, HEAD_DIM), _randn(1, KV_HEADS, 16, HEAD_DIM)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    except RuntimeError:
        return False
    return True


def _sdpa(gqa_native: bool):
    """SDPA-flash on [B, H, T, D] queries and [B, Hkv, S, D] keys/values."""
    def call(q, k, v, causal):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=SCALE, enable_gqa=True)

    def call_expanded(q, k, v, causal):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=SCALE)

    return call if gqa_native else call_expanded


def _kv_for_sdpa(t: torch.Tensor, gqa_native: bool) -> torch.Tensor:
    return t if gqa_native else t.repeat_interleave(HEADS // KV_HEADS, dim=1)


def _row(label, sdpa_ms, ours_ms, kind):
    ratio = sdpa_ms / ours_ms
    target = TARGETS[kind]
    return [*label, sdpa_ms, ours_ms, ratio, f">={target:.2f}", "pass" if ratio >= target else "miss"]


def training_table(sdpa, gqa_native) -> str:
    rows = []
    for tokens in TRAIN_TOKENS:
        b = tokens // SEQ
        q, k, v = _randn(tokens, HEADS, HEAD_DIM), _randn(tokens, KV_HEADS, HEAD_DIM), _randn(tokens, KV_HEADS, HEAD_DIM)
        grad = _randn(tokens, HEADS, HEAD_DIM)
        cu = torch.arange(0, tokens + 1, SEQ, device="cuda", dtype=torch.int32)
        ours_in = [t.requires_grad_() for t in (q, k, v)]

        def ours():
            torch.autograd.grad(K.varlen_attention(*ours_in, cu, SCALE), ours_in, grad)

        def batch(t):  # [B*SEQ, heads, D] -> [B, heads, SEQ, D]
            return t.detach().view(b, SEQ, t.shape[1], HEAD_DIM).transpose(1, 2).contiguous()

        qb = batch(q).requires_grad_()
        kb, vb = (_kv_for_sdpa(batch(t), gqa_native).requires_grad_() for t in (k, v))
        grad_b = batch(grad)

        def baseline():
            torch.autograd.grad(sdpa(qb, kb, vb, True), (qb, kb, vb), grad_b)

        rows.append(_row([tokens, f"{b} x {SEQ}"], measure(baseline).ms, measure(ours).ms, "training"))
    columns = ["tokens", "sequences", "SDPA ms", "lockstep ms", "ratio", "target", "pass/miss"]
    return markdown_table("Training: varlen_attention forward+backward vs SDPA-flash (causal)", columns, rows)


def _paged_cache(batch: int, context: int):
    """K/V caches [pages, 8, PAGE, 128] with each request's pages in random order, and its table."""
    pages = batch * (context // PAGE)
    k_cache, v_cache = _randn(pages, KV_HEADS, PAGE, HEAD_DIM), _randn(pages, KV_HEADS, PAGE, HEAD_DIM)
    table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, context // PAGE)
    return k_cache, v_cache, table


def prefill_table(sdpa, gqa_native) -> str:
    rows = []
    for tokens in PREFILL_TOKENS:
        q = _randn(tokens, HEADS, HEAD_DIM)
        k_cache, v_cache, table = _paged_cache(1, tokens)
        seq_lens = torch.tensor([tokens], device="cuda", dtype=torch.int32)
        qsl = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
        ours_ms = measure(lambda: K.paged_attention(q, k_cache, v_cache, table, seq_lens, qsl, SCALE, tokens, tokens)).ms
        qb = q.view(1, tokens, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        kb, vb = (_kv_for_sdpa(_randn(1, KV_HEADS, tokens, HEAD_DIM), gqa_native) for _ in range(2))
        rows.append(_row([tokens], measure(lambda: sdpa(qb, kb, vb, True)).ms, ours_ms, "prefill"))
        del k_cache, v_cache
    columns = ["prompt tokens", "SDPA ms", "lockstep ms", "ratio", "target", "pass/miss"]
    return markdown_table(f"Prefill: paged_attention (page {PAGE}) vs SDPA-flash (causal)", columns, rows)


def _decode_fits(batch: int, context: int, gqa_native: bool) -> bool:
    one_cache = 2 * batch * context * KV_HEADS * HEAD_DIM * DTYPE.itemsize  # K and V
    sdpa_cache = one_cache * (1 if gqa_native else HEADS // KV_HEADS)
    return one_cache + sdpa_cache < 0.9 * torch.cuda.mem_get_info()[0]


def decode_table(sdpa, gqa_native) -> str:
    rows = []
    for batch in DECODE_BATCH:
        for context in DECODE_CONTEXT:
            if not _decode_fits(batch, context, gqa_native):
                rows.append([batch, context, "-", "-", "-", f">={TARGETS['decode']:.2f}", "skipped (memory)"])
                continue
            q = _randn(batch, HEADS, HEAD_DIM)
            k_cache, v_cache, table = _paged_cache(batch, context)
            seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
            qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
            ours_ms = graph_ms_per_call(lambda: K.paged_attention(q, k_cache, v_cache, table, seq_lens, qsl, SCALE, 1, context))
            del k_cache, v_cache
            qb = q.view(batch, HEADS, 1, HEAD_DIM)
            kb, vb = (_kv_for_sdpa(_randn(batch, KV_HEADS, context, HEAD_DIM), gqa_native) for _ in range(2))
            rows.append(_row([batch, context], graph_ms_per_call(lambda: sdpa(qb, kb, vb, False)), ours_ms, "decode"))
            del kb, vb
            torch.cuda.empty_cache()
    columns = ["batch", "context", "SDPA ms", "lockstep ms", "ratio", "target", "pass/miss"]
    return markdown_table(f"Decode: paged_attention (page {PAGE}, random page order) vs SDPA-flash "
                          "(contiguous cache), CUDA graphs", columns, rows)


def run(out_md_lines: list[str]) -> None:
    """Append the training, prefill and decode tables (markdown) to out_md_lines. CUDA only."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_attention needs a CUDA device")
    with K.using_backend("triton"):
        gqa_native = _sdpa_gqa_native()
        sdpa = _sdpa(gqa_native)
        out_md_lines.append(f"SDPA GQA: {'enable_gqa=True' if gqa_native else 'K/V expanded to 32 heads'}\n")
        out_md_lines.append(training_table(sdpa, gqa_native))
        out_md_lines.append(prefill_table(sdpa, gqa_native))
        out_md_lines.append(decode_table(sdpa, gqa_native))


if __name__ == "__main__":
    lines: list[str] = []
    run(lines)
    print("\n".join(lines))
