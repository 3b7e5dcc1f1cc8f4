"""Kernel and pipeline sweep for the fused linear-logp forward (bf16, H=4096, V=151936), against
the bare LM-head GEMM measured alongside. The row block and its warps decide only which program
computes a row, the stages and the warp-specialised kernel's issue-ahead depth only when loads and
MMAs run, and the warp-specialised kernel folds with the `tl` kernel's operations
(kernels/_triton/logp.py, logp_ws.py): every candidate's output is checked bitwise against the
table's before it is timed. Kernel time on both sides (CUDA-graph replays in alternating turns with
the GEMM, bench_logp.fwd_pair_ms).

    python benchmarks/sweep_logp.py
"""
from __future__ import annotations

from dataclasses import replace

import torch

from bench_logp import fwd_pair_ms
import lockstep.kernels as K
from lockstep.kernels._triton import logp as triton_logp
from lockstep.kernels._triton import logp_ws

TABLE = triton_logp.TILE_CONFIGS[torch.bfloat16]
WARPS = dict(triton_logp.BLOCK_T_WARPS)
WS = (logp_ws.STAGES, logp_ws.AHEAD)
TL = replace(TABLE, warp_specialize=False)
# (label, row blocks -> warps, tile config, (warp-specialised stages, issue-ahead)); the first: the table
CANDIDATES = [
    ("table", WARPS, TABLE, WS),
    ("tl kernel", WARPS, TL, WS),
    ("ws, 2 ahead", WARPS, TABLE, (WS[0], 2)),
    ("ws, 4 ahead", WARPS, TABLE, (WS[0], 4)),
]
H, V = 4096, 151936


def _use(warps, cfg, ws) -> None:
    triton_logp.BLOCK_T_WARPS, triton_logp.TILE_CONFIGS[torch.bfloat16] = warps, cfg
    logp_ws.STAGES, logp_ws.AHEAD = ws


def main() -> None:
    K.set_backend("triton")
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    for t in (256, 4096):  # (at 128 rows the table takes 64-row blocks: the tl kernel, not a candidate here)
        h = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
        tgt = torch.randint(0, V, (t,), device="cuda")
        _use(*CANDIDATES[0][1:])
        ref = K.linear_logp(h, w, tgt, with_entropy=True, temperature=0.7)
        for label, *setting in CANDIDATES:
            _use(*setting)
            got = K.linear_logp(h, w, tgt, with_entropy=True, temperature=0.7)
            if not all(torch.equal(a, b) for a, b in zip(got, ref)):
                print(f"T={t} {label}: BITS DIFFER from the table's", flush=True)
                continue
            gemm, ms = fwd_pair_ms(lambda: h @ w.t(), lambda: K.linear_logp(h, w, tgt))
            print(f"T={t} {label}: {ms:.3f} ms = {ms / gemm:.3f}x bare GEMM ({gemm:.3f} ms)", flush=True)
        _use(*CANDIDATES[0][1:])


if __name__ == "__main__":
    main()
