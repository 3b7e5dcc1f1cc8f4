"""The fused linear-logp forward's kernels (bf16, H=4096, V=151936): the tl kernel against the
warp-specialised Gluon one at each stage count, against the bare LM-head GEMM measured alongside.
The kernel and its stages decide only how the same dots and folds are scheduled, never a row's
arithmetic (kernels/_triton/logp.py): every candidate's output is checked bitwise against the tl
kernel's (the first candidate) before it is timed. Kernel time on both sides (CUDA-graph replays
in alternating turns with the GEMM, bench_logp.fwd_pair_ms). Earlier sweeps of row blocks, GROUP_T
and the tl kernel's stages are in benchmarks/RESULTS.md.

    python benchmarks/sweep_logp.py     # SWEEP_T=256,4096: other token counts (default 256,4096)
    SWEEP_CANDIDATES=0,2 SWEEP_ENTROPY=0 python benchmarks/sweep_logp.py   # two candidates, bits without entropy
    SWEEP_TIME_ENTROPY=1 python benchmarks/sweep_logp.py                   # time the forwards with entropy
    python benchmarks/sweep_logp.py support    # the top-p support kernel's warps x slots against the
                                               # torch reference's expression (T = 128, k = 64, 1,024)
"""
from __future__ import annotations

import os

import torch

from bench_logp import SUPPORT_TOKENS, SUPPORT_WIDTHS, fwd_pair_ms
import lockstep.kernels as K
from lockstep.kernels._triton import logp as triton_logp

# (label, the Gluon forward's stages or 0 for the tl kernel); the first: the tl kernel (its row block
# per T _block_t's). The schedules measured on the way to the Gluon kernel's (one tile a step; each
# step's wgmmas waited for) are in benchmarks/RESULTS.md, eleventh session.
CANDIDATES = [
    ("tl kernel", 0),
    ("Gluon, 4 stages", 4),
    ("Gluon, 3 stages", 3),
]
H, V = 4096, 151936


def _use(ws_stages) -> None:
    triton_logp.WS_FORWARD, triton_logp.WS_STAGES = ws_stages > 0, ws_stages or triton_logp.WS_STAGES
    triton_logp.WS_MIN_ITEMS_PER_PROGRAM = 0  # a Gluon candidate runs at every T


def main() -> None:
    K.set_backend("triton")
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    # SWEEP_CANDIDATES=0,2: only those (indices into CANDIDATES); SWEEP_ENTROPY=0: check the bits without entropy
    every = ",".join(map(str, range(len(CANDIDATES))))
    picked = [CANDIDATES[int(i)] for i in os.environ.get("SWEEP_CANDIDATES", every).split(",")]
    entropy = os.environ.get("SWEEP_ENTROPY", "1") == "1"
    timed_entropy = os.environ.get("SWEEP_TIME_ENTROPY", "0") == "1"  # time the forward with entropy (training's)
    for t in [int(t) for t in os.environ.get("SWEEP_T", "256,4096").split(",")]:
        h = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
        tgt = torch.randint(0, V, (t,), device="cuda")
        _use(*CANDIDATES[0][1:])
        ref = K.linear_logp(h, w, tgt, with_entropy=entropy, temperature=0.7)
        for label, *setting in picked:
            _use(*setting)
            got = K.linear_logp(h, w, tgt, with_entropy=entropy, temperature=0.7)
            if not all(a is b or torch.equal(a, b) for a, b in zip(got, ref)):
                print(f"T={t} {label}: BITS DIFFER from the tl kernel's", flush=True)
                continue
            gemm, ms = fwd_pair_ms(lambda: h @ w.t(), lambda: K.linear_logp(h, w, tgt, with_entropy=timed_entropy))
            print(f"T={t} {label}{' (with entropy)' if timed_entropy else ''}: {ms:.3f} ms = {ms / gemm:.3f}x bare "
                  f"GEMM ({gemm:.3f} ms)", flush=True)
        _use(*CANDIDATES[0][1:])


# the support kernel's weight-row bytes a warp (SUPPORT_WARP_BYTES: at H = 4,096 bf16, 8 KiB is one
# warp of 1 slot, 16 KiB one of 2, 32 KiB two warps of 4)
SUPPORT_CANDIDATES = [8192, 16384, 32768, 65536]


def support() -> None:
    """Each candidate's support logits checked bitwise against the reference's, then timed with the
    reference's expression in alternating turns."""
    from lockstep.kernels.logp import torch_support_logits

    K.set_backend("triton")
    w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    saved = triton_logp.SUPPORT_WARP_BYTES
    try:
        for k in SUPPORT_WIDTHS:
            h = torch.randn(SUPPORT_TOKENS, H, device="cuda", dtype=torch.bfloat16)
            ids = torch.randint(0, V, (SUPPORT_TOKENS, k), device="cuda")
            ref = torch_support_logits(h, w, ids)
            for warp_bytes in SUPPORT_CANDIDATES:
                triton_logp.SUPPORT_WARP_BYTES = warp_bytes
                if not torch.equal(triton_logp.support_logits(h, w, ids), ref):
                    print(f"k={k} {warp_bytes} bytes a warp: BITS DIFFER", flush=True)
                    continue
                base, ms = fwd_pair_ms(lambda: torch_support_logits(h, w, ids),
                                       lambda: triton_logp.support_logits(h, w, ids))
                print(f"k={k} {warp_bytes} bytes a warp: {ms:.3f} ms = {ms / base:.3f}x the reference's expression "
                      f"({base:.3f} ms)", flush=True)
    finally:
        triton_logp.SUPPORT_WARP_BYTES = saved


if __name__ == "__main__":
    import sys

    support() if sys.argv[1:] == ["support"] else main()
