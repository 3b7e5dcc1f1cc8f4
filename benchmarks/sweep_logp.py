"""Row-block sweep for the fused linear-logp forward (bf16, H=4096, V=151936), against the bare
LM-head GEMM measured alongside. BLOCK_T and its warps decide only which program computes a row,
never a row's arithmetic (kernels/_triton/logp.py), so every candidate keeps the bits. Kernel time
on both sides (CUDA-graph replays, bench_logp.fwd_ms).

    python benchmarks/sweep_logp.py
"""
from __future__ import annotations

import torch

from bench_logp import fwd_ms
import lockstep.kernels as K
from lockstep.kernels._triton import logp as triton_logp

CANDIDATES = [{128: 8, 64: 4}, {64: 4}, {128: 8}]  # the first: the table (its choice per T is _block_t's)
H, V = 4096, 151936


def main() -> None:
    K.set_backend("triton")
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    for t in (128, 256, 4096):
        h = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
        tgt = torch.randint(0, V, (t,), device="cuda")
        gemm = fwd_ms(lambda: h @ w.t())
        for cand in CANDIDATES:
            triton_logp.BLOCK_T_WARPS = cand
            ms = fwd_ms(lambda: K.linear_logp(h, w, tgt))
            print(f"T={t} BLOCK_T_WARPS={cand}: {ms:.3f} ms = {ms / gemm:.3f}x bare GEMM ({gemm:.3f} ms)", flush=True)
        triton_logp.BLOCK_T_WARPS = CANDIDATES[0]


if __name__ == "__main__":
    main()
