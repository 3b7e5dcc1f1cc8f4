"""Host time per call of lockstep's Triton attention ops and their pieces (no device syncs inside
the timing loops), on one CUDA device, Qwen3-8B heads, one 4,096-token sequence:

    python benchmarks/host_attention.py

An op whose host time exceeds its kernels' GPU time is host-bound wherever nothing else hides it
(eager training with a sync per layer, vLLM's eager attention): these are the numbers that say where
that time goes. The host's speed moves them a lot between machines; compare rows of one run.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _harness import host_us  # noqa: E402
import lockstep.kernels as K  # noqa: E402
from lockstep.kernels._triton import attention as A  # noqa: E402
from bench_attention import HEAD_DIM, HEADS, KV_HEADS, SCALE, paged_cache, _randn  # noqa: E402

TOKENS = 4096


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("host_attention needs a CUDA device")
    K.set_backend("triton")
    n = TOKENS
    q, k, v = _randn(n, HEADS, HEAD_DIM), _randn(n, KV_HEADS, HEAD_DIM), _randn(n, KV_HEADS, HEAD_DIM)
    cu = torch.tensor([0, n], device="cuda", dtype=torch.int32)
    grad = _randn(n, HEADS, HEAD_DIM)
    out, lse = A._varlen(q, k, v, cu, SCALE, n)
    queries, keys = A._varlen_layout(q, k, v, cu, n)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    k_cache, v_cache, table = paged_cache(1, n)
    seq_lens = torch.tensor([n], device="cuda", dtype=torch.int32)
    qsl = torch.tensor([0, n], device="cuda", dtype=torch.int32)
    qb, kb = q.view(1, n, HEADS, HEAD_DIM).transpose(1, 2), k.view(1, n, KV_HEADS, HEAD_DIM).transpose(1, 2)
    rows = [
        ("varlen layout (max_seqlen given)", lambda: A._varlen_layout(q, k, v, cu, n)),
        ("varlen forward: launch (Gluon)", lambda: A._forward(queries, keys, SCALE, False)),
        ("varlen backward: launches (delta, dK/dV, dQ)", lambda: A._backward(grad, queries, keys, out, lse, SCALE)),
        ("custom op lockstep::varlen_attention", lambda: torch.ops.lockstep.varlen_attention(q, k, v, cu, SCALE, n)),
        ("custom op lockstep::varlen_attention_backward",
         lambda: torch.ops.lockstep.varlen_attention_backward(grad, q, k, v, cu, out, lse, SCALE, n)),
        ("K.varlen_attention forward (eager path)", lambda: K.varlen_attention(q, k, v, cu, SCALE, n)),
        ("K.varlen_attention forward + backward", lambda: torch.autograd.grad(
            K.varlen_attention(*inputs, cu, SCALE, n), inputs, grad)),
        ("K.paged_attention, a 4,096-token prefill", lambda: K.paged_attention(q, k_cache, v_cache, table, seq_lens,
                                                                              qsl, SCALE, n, n)),
        ("torch SDPA forward (for scale)", lambda: torch.nn.functional.scaled_dot_product_attention(
            qb, kb, kb, is_causal=True, enable_gqa=True)),
    ]
    print(f"| host time a call, {torch.cuda.get_device_name()} | us |\n|---|---|")
    for label, fn in rows:
        print(f"| {label} | {host_us(fn, 50 if 'backward' in label else 200):.0f} |", flush=True)


if __name__ == "__main__":
    main()
