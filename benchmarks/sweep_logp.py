"""Row-block and pipeline sweep for the fused linear-logp forward (bf16, H=4096, V=151936), against
the bare LM-head GEMM measured alongside. BLOCK_T and its warps decide only which program computes a
row, and the stages only how deep the loads run ahead, never a row's arithmetic
(kernels/_triton/logp.py): every candidate's output is checked bitwise against the table's before
it is timed. Kernel time on both sides (CUDA-graph replays in alternating turns with the GEMM,
bench_logp.fwd_pair_ms).

    python benchmarks/sweep_logp.py
"""
from __future__ import annotations

from dataclasses import replace

import torch

from bench_logp import fwd_pair_ms
import lockstep.kernels as K
from lockstep.kernels._triton import logp as triton_logp

TABLE = triton_logp.TILE_CONFIGS[torch.bfloat16]
# (row blocks -> warps, tile config); the first: the table (its choice per T is _block_t's)
CANDIDATES = [({128: 8, 64: 4}, TABLE), ({128: 8}, TABLE), ({64: 4}, TABLE),
              ({128: 8, 64: 4}, replace(TABLE, num_stages=4)), ({128: 8, 64: 4}, replace(TABLE, num_stages=6))]
H, V = 4096, 151936


def main() -> None:
    K.set_backend("triton")
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    for t in (128, 256, 4096):
        h = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
        tgt = torch.randint(0, V, (t,), device="cuda")
        ref = K.linear_logp(h, w, tgt, with_entropy=True)
        for warps, cfg in CANDIDATES:
            triton_logp.BLOCK_T_WARPS, triton_logp.TILE_CONFIGS[torch.bfloat16] = warps, cfg
            got = K.linear_logp(h, w, tgt, with_entropy=True)
            if not all(torch.equal(a, b) for a, b in zip(got, ref)):
                print(f"T={t} {warps} {cfg}: BITS DIFFER from the table's", flush=True)
                continue
            gemm, ms = fwd_pair_ms(lambda: h @ w.t(), lambda: K.linear_logp(h, w, tgt))
            print(f"T={t} BLOCK_T_WARPS={warps} {cfg}: {ms:.3f} ms = {ms / gemm:.3f}x bare GEMM ({gemm:.3f} ms)",
                  flush=True)
        triton_logp.BLOCK_T_WARPS, triton_logp.TILE_CONFIGS[torch.bfloat16] = CANDIDATES[0]


if __name__ == "__main__":
    main()
