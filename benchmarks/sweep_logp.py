"""Row-block sweep for the fused linear-logp forward (bf16, H=4096, V=151936), against the bare
LM-head GEMM measured alongside. BLOCK_T and its warps decide only which program computes a row,
never a row's arithmetic (kernels/_triton/logp.py), so every candidate keeps the bits.

    python benchmarks/sweep_logp.py
"""
from __future__ import annotations

import torch

from _harness import measure
import lockstep.kernels as K
from lockstep.kernels._triton import logp as triton_logp

CANDIDATES = [{128: 8, 64: 4}, {64: 4}, {128: 8}]
H, V = 4096, 151936


def main() -> None:
    K.set_backend("triton")
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    for t in (4096, 16384):
        h = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
        tgt = torch.randint(0, V, (t,), device="cuda")
        gemm = measure(lambda: h @ w.t()).ms
        for cand in CANDIDATES:
            triton_logp.BLOCK_T_WARPS = cand
            ms = measure(lambda: K.linear_logp(h, w, tgt)).ms
            print(f"T={t} BLOCK_T_WARPS={cand}: {ms:.2f} ms = {ms / gemm:.3f}x bare GEMM ({gemm:.2f} ms)", flush=True)


if __name__ == "__main__":
    main()
