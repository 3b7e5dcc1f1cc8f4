"""lockstep's Triton attention against the fastest stock attention, bf16, Qwen3-8B heads (32 query
heads, 8 kv heads, head_dim 128), on one CUDA device. The baseline of every row is the fastest of
torch SDPA's own choice and each backend forced (flash, cuDNN, memory-efficient) that accepts the
inputs, with `enable_gqa=True` as a user would call it, and, for prefill and decode where vLLM is
importable, vLLM's FlashAttention-3 (`vllm.vllm_flash_attn`, what its FLASH_ATTN backend runs on
Hopper) on a paged cache in vLLM's layout; the row names the backend that won, and a table says
under it when vLLM's FA3 was absent or failed (never silently left out).

- training: `varlen_attention` forward + backward on packed 4k-token sequences (4k and 16k tokens
  in all) vs SDPA causal on the same sequences as a [B, 4k] batch; target >= 0.8x SDPA throughput.
- prefill: `paged_attention` over one 4k / 16k-token prompt in a 16-token-page cache vs SDPA
  causal; target >= 0.85x.
- training and prefill are timed as the issue timed them (and as decode is): both sides replay CUDA
  graphs of 10 calls, so the ratio compares kernels. Each table also times both sides eagerly,
  call by call (`measure`: host time before and between the launches included), in its last columns,
  where lockstep's Python and launches (several per call, against one library call) show.
- decode: `paged_attention`, one new token per request against a 16-token-page cache (pages in
  random order) vs SDPA against a contiguous [B, 8, context, 128] cache and vLLM's FA3 against a
  16-token-page cache (pages in random order), at batch {1, 16, 64, 256}
  x context {1k, 4k, 16k, 32k}; target >= 0.9x. Both sides replay CUDA graphs of 10
  calls, so a decode step times the kernels, not Python; a cell whose two caches do not fit in
  free memory is skipped and says so.
- lockstep's paged caches (prefill and decode) are the one its vLLM backend allocates, the layout a
  rollout runs: a page holds each kv head's slots together and a slot its key beside its value
  (framework/rollout/vllm_plugin/kv_layout.py); vLLM's FA3 gets vLLM's own layout.

Ratios are baseline time / lockstep time (throughput ratios).

    python benchmarks/bench_attention.py [--tables training,prefill,decode]
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if __package__:  # imported as benchmarks.bench_attention
    from ._harness import graph_ms_per_call, markdown_table, measure
else:  # run as a script, or imported with benchmarks/ on sys.path
    from _harness import graph_ms_per_call, markdown_table, measure

import lockstep.kernels as K
from lockstep.framework.rollout.vllm_plugin.kv_layout import kv_cache_shape, split_kv_cache

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
SEQ = 4096  # packed training sequence length
TRAIN_TOKENS = [4096, 16384]
PREFILL_TOKENS = [4096, 16384]
DECODE_BATCH = [1, 16, 64, 256]
DECODE_CONTEXT = [1024, 4096, 16384, 32768]
PAGE = 16
TARGETS = {"training": 0.8, "prefill": 0.85, "decode": 0.9}  # issue 15's bars
SCALE = 1.0 / math.sqrt(HEAD_DIM)


def _randn(*shape):
    return torch.randn(*shape, device="cuda", dtype=DTYPE)


SDPA_BACKENDS = {"torch default": None, "flash": SDPBackend.FLASH_ATTENTION, "cuDNN": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}


def sdpa(backend, q, k, v, causal):
    """torch SDPA on [B, H, T, D] queries and [B, Hkv, S, D] keys/values; backend None: torch's choice."""
    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=SCALE, enable_gqa=True)


def fastest_sdpa(timer, call) -> tuple[float, str]:
    """(ms, name) of the fastest SDPA backend for call(backend), timed by timer(fn) -> ms; a backend
    that refuses the inputs (head dim, GQA, dtype) or the timer's CUDA-graph capture is left out."""
    times = {}
    for name, backend in SDPA_BACKENDS.items():
        def fn(backend=backend):
            return call(backend)
        try:
            fn()
            torch.cuda.synchronize()
            times[name] = timer(fn)
        except RuntimeError:  # refused eagerly, or not capturable in a CUDA graph
            continue
    if not times:
        raise RuntimeError("no torch SDPA backend accepts these inputs")
    best = min(times, key=times.get)
    return times[best], best


def _ms(fn) -> float:
    return measure(fn).ms


def vllm_fa3():
    """(vLLM's flash_attn_varlen_func, None) where vLLM and its FA3 build are on this host, else
    (None, why not)."""
    try:
        from vllm.vllm_flash_attn import fa_version_unsupported_reason, flash_attn_varlen_func
    except ImportError as e:
        return None, f"vLLM's FA3 is not importable here ({e})"
    reason = fa_version_unsupported_reason(3)
    return (None, reason) if reason else (flash_attn_varlen_func, None)


def with_fa3(best: tuple[float, str], timer, q, batch: int, context: int, causal: bool, notes: list[str]):
    """The faster of `best` (ms, name) and vLLM's FA3 on a fresh paged cache in vLLM's layout
    [pages, PAGE, kv heads, D] (pages in random order), q [batch * n, heads, D] with n queries per
    request (the last n positions of each: causal aligns them to the bottom right), timed by timer.
    FA3 absent or failing: `best`, and a line in notes saying so."""
    fa3, why = vllm_fa3()
    if fa3 is None:
        if why not in notes:
            notes.append(why)
        return best
    per = q.shape[0] // batch
    k_cache, v_cache, table = paged_cache(batch, context, vllm_layout=True)
    seqused = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    cu_q = torch.arange(0, q.shape[0] + 1, per, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)

    def call():
        fa3(q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu_q, max_seqlen_q=per, seqused_k=seqused,
            max_seqlen_k=context, softmax_scale=SCALE, causal=causal, block_table=table, fa_version=3)
    try:
        call()
        torch.cuda.synchronize()
        ms = timer(call)
    except RuntimeError as e:
        notes.append(f"vLLM FA3 failed at batch {batch}, context {context}: {str(e)[:160]}")
        return best
    finally:
        del k_cache, v_cache
    return min(best, (ms, "vLLM FA3"))


def _row(label, baseline: tuple[float, str], ours_ms, kind):
    base_ms, backend = baseline
    ratio = base_ms / ours_ms
    target = TARGETS[kind]
    return [*label, backend, base_ms, ours_ms, ratio, f">={target:.2f}", "pass" if ratio >= target else "miss"]


def _table(title: str, columns: list[str], rows: list, notes: list[str]) -> str:
    return markdown_table(title, columns, rows) + "".join(f"\n{n}\n" for n in notes)


def training_table() -> str:
    rows = []
    for tokens in TRAIN_TOKENS:
        b = tokens // SEQ
        q, k, v = _randn(tokens, HEADS, HEAD_DIM), _randn(tokens, KV_HEADS, HEAD_DIM), _randn(tokens, KV_HEADS, HEAD_DIM)
        grad = _randn(tokens, HEADS, HEAD_DIM)
        cu = torch.arange(0, tokens + 1, SEQ, device="cuda", dtype=torch.int32)
        ours_in = [t.requires_grad_() for t in (q, k, v)]

        def ours():
            # max_seqlen, as the trainers pass it (Packed.width): no device-to-host read
            torch.autograd.grad(K.varlen_attention(*ours_in, cu, SCALE, SEQ), ours_in, grad)

        def batch(t):  # [B*SEQ, heads, D] -> [B, heads, SEQ, D]
            return t.detach().view(b, SEQ, t.shape[1], HEAD_DIM).transpose(1, 2).contiguous()

        qb, kb, vb = (batch(t).requires_grad_() for t in (q, k, v))
        grad_b = batch(grad)

        def baseline(backend):
            torch.autograd.grad(sdpa(backend, qb, kb, vb, True), (qb, kb, vb), grad_b)

        best = fastest_sdpa(graph_ms_per_call, baseline)
        row = _row([tokens, f"{b} x {SEQ}"], best, graph_ms_per_call(ours), "training")
        eager_base, eager_ours = _ms(lambda: baseline(SDPA_BACKENDS[best[1]])), _ms(ours)
        rows.append(row + [eager_base, eager_ours, eager_base / eager_ours])
    columns = ["tokens", "sequences", "fastest SDPA", "SDPA ms", "lockstep ms", "ratio", "target", "pass/miss",
               "eager: SDPA ms", "eager: lockstep ms", "eager ratio"]
    return markdown_table("Training: varlen_attention forward+backward vs the fastest torch SDPA (causal), CUDA graphs",
                          columns, rows)


def paged_cache(batch: int, context: int, vllm_layout: bool = False, generator=None, page: int = PAGE,
                kv_heads: int = KV_HEADS):
    """K/V caches of `batch` requests of `context` keys, each request's pages in random order, and
    their table. Lockstep's: the cache its vLLM backend allocates (kv_layout.py: [pages, 8, page,
    2 x 128], a slot's key beside its value) as its key and value views, the layout a rollout runs;
    vllm_layout: vLLM's FA3 layout, two [pages, page, 8, 128] caches. kv_heads: 8, or a TP rank's
    share of them."""
    pages = batch * -(-context // page)
    r = lambda *shape: torch.randn(*shape, device="cuda", dtype=DTYPE, generator=generator)  # noqa: E731
    if vllm_layout:
        k_cache, v_cache = r(pages, page, kv_heads, HEAD_DIM), r(pages, page, kv_heads, HEAD_DIM)
    else:
        k_cache, v_cache = split_kv_cache(r(*kv_cache_shape(pages, kv_heads, page, HEAD_DIM)))
    table = torch.randperm(pages, device="cuda", dtype=torch.int32, generator=generator).view(batch, -1)
    return k_cache, v_cache, table


def prefill_table() -> str:
    rows, notes = [], []
    for tokens in PREFILL_TOKENS:
        q = _randn(tokens, HEADS, HEAD_DIM)
        k_cache, v_cache, table = paged_cache(1, tokens)
        seq_lens = torch.tensor([tokens], device="cuda", dtype=torch.int32)
        qsl = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)

        def ours():
            K.paged_attention(q, k_cache, v_cache, table, seq_lens, qsl, SCALE, tokens, tokens)

        ours_ms, eager_ours = graph_ms_per_call(ours), _ms(ours)
        qb = q.view(1, tokens, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        del k_cache, v_cache
        kb, vb = (_randn(1, KV_HEADS, tokens, HEAD_DIM) for _ in range(2))
        best = fastest_sdpa(graph_ms_per_call, lambda backend: sdpa(backend, qb, kb, vb, True))
        eager_base = _ms(lambda: sdpa(SDPA_BACKENDS[best[1]], qb, kb, vb, True))
        del kb, vb
        best_all = with_fa3(best, graph_ms_per_call, q, 1, tokens, True, notes)
        eager_cols = [best[1], eager_base, eager_ours, eager_base / eager_ours]
        rows.append(_row([tokens], best_all, ours_ms, "prefill") + eager_cols)
    columns = ["prompt tokens", "fastest stock", "stock ms", "lockstep ms", "ratio", "target", "pass/miss",
               "eager: fastest SDPA", "eager: SDPA ms", "eager: lockstep ms", "eager ratio"]
    return _table(f"Prefill: paged_attention (page {PAGE}) vs the fastest torch SDPA or vLLM FA3 (causal), CUDA graphs",
                  columns, rows, notes)


def _decode_fits(batch: int, context: int) -> bool:
    one_cache = 2 * batch * context * KV_HEADS * HEAD_DIM * DTYPE.itemsize  # K and V
    return 2 * one_cache < 0.9 * torch.cuda.mem_get_info()[0]  # the paged one and SDPA's contiguous one


def decode_table() -> str:
    rows, notes = [], []
    for batch in DECODE_BATCH:
        for context in DECODE_CONTEXT:
            if not _decode_fits(batch, context):
                rows.append([batch, context, "-", "-", "-", "-", f">={TARGETS['decode']:.2f}", "skipped (memory)"])
                continue
            q = _randn(batch, HEADS, HEAD_DIM)
            k_cache, v_cache, table = paged_cache(batch, context)
            seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
            qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
            ours_ms = graph_ms_per_call(lambda: K.paged_attention(q, k_cache, v_cache, table, seq_lens, qsl, SCALE, 1, context))
            del k_cache, v_cache
            qb = q.view(batch, HEADS, 1, HEAD_DIM)
            kb, vb = (_randn(batch, KV_HEADS, context, HEAD_DIM) for _ in range(2))
            best = fastest_sdpa(graph_ms_per_call, lambda backend: sdpa(backend, qb, kb, vb, False))
            del kb, vb
            torch.cuda.empty_cache()
            best = with_fa3(best, graph_ms_per_call, q, batch, context, False, notes)
            rows.append(_row([batch, context], best, ours_ms, "decode"))
            torch.cuda.empty_cache()
    columns = ["batch", "context", "fastest stock", "stock ms", "lockstep ms", "ratio", "target", "pass/miss"]
    return _table(f"Decode: paged_attention (page {PAGE}, random page order, the backend's layout) vs the fastest "
                  "torch SDPA (contiguous cache) or vLLM FA3 (paged, random page order), CUDA graphs", columns, rows,
                  notes)


TABLES = {"training": training_table, "prefill": prefill_table, "decode": decode_table}


def run(out_md_lines: list[str], tables=tuple(TABLES)) -> None:
    """Append the chosen tables (markdown; all: training, prefill and decode) to out_md_lines. CUDA only."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_attention needs a CUDA device")
    unknown = set(tables) - set(TABLES)
    if unknown:
        raise ValueError(f"unknown attention tables {sorted(unknown)}; valid: {', '.join(TABLES)}")
    with K.using_backend("triton"):
        for name in tables:
            out_md_lines.append(TABLES[name]())


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--tables", default=",".join(TABLES), help=f"comma-separated, of {', '.join(TABLES)}")
    lines: list[str] = []
    run(lines, p.parse_args().tables.split(","))
    print("\n".join(lines))
