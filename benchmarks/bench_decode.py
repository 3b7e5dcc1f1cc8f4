"""Where a strict decode step spends its time, and the row-parallel GEMM against cuBLAS (one GPU).

    python benchmarks/bench_decode.py OUT.md [--batch 128] [--context 600]

One Qwen3-8B decoder layer's ops at a decode step (batch B, every request at --context keys),
   lockstep (Triton) next to the stock op a user would otherwise run (cuBLAS through F.linear, torch's
   default SDPA choice on a contiguous cache with enable_gqa, torch RMSNorm/SiLU), each timed
   with CUDA-graph replay (_harness.graph_ms_per_call); the layer total x 36 layers plus
   the LM head's logprob estimates the step.
(The row-parallel GEMM against cuBLAS at every M is a table of bench_matmul, in kernels.py.)
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import lockstep.kernels as K
from _harness import emit, graph_ms_per_call

H, NH, NKV, D, I, V, LAYERS = 4096, 32, 8, 128, 12288, 151936, 36


def bench(fn) -> float:
    return graph_ms_per_call(fn) * 1e3  # us


def decode_layer(b: int, ctx: int) -> list[tuple[str, float, float]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: (torch.randn(*s, device="cuda", generator=g) * 0.02).bfloat16()  # noqa: E731
    x = r(b, H)
    wq, wk, wv, wo = r(NH * D, H), r(NKV * D, H), r(NKV * D, H), r(H, NH * D)
    wg, wu, wd = r(I, H), r(I, H), r(H, I)
    wqkv, wgu = torch.cat([wq, wk, wv]), torch.cat([wg, wu])
    norm_w = torch.ones(H, device="cuda", dtype=torch.bfloat16)
    qn = torch.ones(D, device="cuda", dtype=torch.bfloat16)
    pos = torch.full((b,), ctx - 1, device="cuda")
    # paged cache for lockstep (pages of 16), contiguous for SDPA
    page = 16
    pages = ctx // page + 1
    k_cache = r(b * pages, NKV, page, D)
    v_cache = r(b * pages, NKV, page, D)
    table = torch.arange(b * pages, device="cuda", dtype=torch.int32).view(b, pages)
    seq_lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
    qsl = torch.arange(b + 1, device="cuda", dtype=torch.int32)
    kc, vc = r(b, NKV, ctx, D), r(b, NKV, ctx, D)
    kn, vn = r(b, NKV, D), r(b, NKV, D)  # this step's new keys/values, one slot per request
    slots = (table[:, ctx // page].long() * page + ctx % page)
    blk, off = slots // page, slots % page

    def kv_index_put():  # what torch indexing does (vLLM's own CUDA op is not importable here)
        k_cache[blk, :, off] = kn
        v_cache[blk, :, off] = vn
    q = r(b, NH, D)
    h_logp = r(b, H)
    w_lm = r(V, H)
    targets = torch.randint(0, V, (b,), device="cuda", generator=g)
    cos, sin = K.rope_cos_sin(pos, D, 1e6)
    cos_t, sin_t = K.rope_cos_sin(torch.arange(4096, device="cuda"), D, 1e6)
    k_new = r(b, NKV, D)
    gate, up, act = r(b, I), r(b, I), r(b, I)
    rows = []
    with K.using_backend("triton"):
        def sdpa():
            return F.scaled_dot_product_attention(q[:, :, None], kc, vc, enable_gqa=True)
        ops = [
            ("input/post norm x2", lambda: K.rms_norm(x, norm_w, 1e-6), lambda: F.rms_norm(x, (H,), norm_w, 1e-6), 2),
            ("q/k/v projections (one launch)", lambda: K.linear_rows(x, wqkv, (NH * D, NKV * D, NKV * D)),
             lambda: F.linear(x, wqkv), 1),
            ("q/k norms", lambda: K.rms_norm(q, qn, 1e-6), lambda: F.rms_norm(q, (D,), qn, 1e-6), 2),
            # the vLLM model gathers cos/sin from a table built once (rollout/vllm_plugin/model.py: RopeTable)
            ("rope cos/sin gather + q/k rotation", lambda: (cos_t[pos], sin_t[pos], K.apply_rope(q[:, None], cos[:, None], sin[:, None]),
                                                    K.apply_rope(k_new[:, None], cos[:, None], sin[:, None])),
             lambda: (q * cos[:, None] + q * sin[:, None], k_new * cos[:, None] + k_new * sin[:, None]), 1),
            ("KV cache write", lambda: K.write_paged_kv(kn, vn, k_cache, v_cache, slots), kv_index_put, 1),
            ("attention (decode)", lambda: K.paged_attention(q, k_cache, v_cache, table, seq_lens, qsl, None, 1, ctx), sdpa, 1),
            ("o projection", lambda: K.row_parallel_linear(x, wo), lambda: F.linear(x, wo), 1),
            ("gate/up projections (one launch)", lambda: K.linear_rows(x, wgu, (I, I)), lambda: F.linear(x, wgu), 1),
            ("SwiGLU", lambda: K.silu_mul(gate, up), lambda: F.silu(gate) * up, 1),
            ("down projection", lambda: K.row_parallel_linear(act, wd), lambda: F.linear(act, wd), 1),
        ]
        for name, ours, theirs, times in ops:
            rows.append((name, times * bench(ours), times * bench(theirs)))
        # strict vLLM: the sampling logits, the copy vLLM's sampler gets, and the sampled token's
        # logprob folded from the same logits (no second pass over the LM head)
        def lockstep_head():
            z = K.lm_head_logits(h_logp, w_lm)
            return z.clone(), K.linear_logp(h_logp, w_lm, targets, logits=z)

        lm = ("LM head logits + logprob (once per step)", bench(lockstep_head),
              bench(lambda: torch.log_softmax(F.linear(h_logp, w_lm).float(), -1).gather(1, targets[:, None])))
    return rows, lm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", nargs="?")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--context", type=int, default=600)
    args = p.parse_args()
    rows, lm = decode_layer(args.batch, args.context)
    lines = [f"Qwen3-8B decode step, batch {args.batch}, {args.context} keys per request, bf16, CUDA-graph replay (us)", "",
             "| op (per layer) | lockstep | stock | lockstep / stock |", "|---|---|---|---|"]
    tot_ours = tot_stock = 0.0
    for name, ours, stock in rows:
        lines.append(f"| {name} | {ours:.1f} | {stock:.1f} | {ours / stock:.2f} |")
        tot_ours += ours
        tot_stock += stock
    lines.append(f"| **layer total** | {tot_ours:.1f} | {tot_stock:.1f} | {tot_ours / tot_stock:.2f} |")
    lines.append(f"| {lm[0]} | {lm[1]:.1f} | {lm[2]:.1f} | {lm[1] / lm[2]:.2f} |")
    step_ours, step_stock = tot_ours * LAYERS + lm[1], tot_stock * LAYERS + lm[2]
    lines.append(f"| **step estimate ({LAYERS} layers + head), ms** | {step_ours / 1e3:.2f} | {step_stock / 1e3:.2f} | "
                 f"{step_ours / step_stock:.2f} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
