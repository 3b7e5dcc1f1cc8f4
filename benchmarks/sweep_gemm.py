"""Tile-config sweep for the lockstep GEMM on the GPU at hand (bf16, Qwen3-8B projections).

    python benchmarks/sweep_gemm.py            # every M bucket
    python benchmarks/sweep_gemm.py --m 128    # one M, each shape (and the LM head) on its own
    python benchmarks/sweep_gemm.py --m 96,112,120,128 --shapes gate_up,lm_head --rows128
                                               # several Ms, some shapes, the swapped tiles of 128 x
                                               # rows alone (against the table's config)
    python benchmarks/sweep_gemm.py --large    # warp-specialised tiles against the table at M = 256 ..
                                               # 4096 on qkv and gate_up, bits checked first
    python benchmarks/sweep_gemm.py --column [--block-m 64]
                                               # the buckets up to 256 rows (or those of 64-row x tiles,
                                               # at M <= 64) judged on qkv and gate_up
                                               # alone (what the model runs through `linear`; o and
                                               # down run the row-parallel tree), swapped tiles too,
                                               # each candidate's bits checked against the table's

For each M bucket of kernels/_triton/matmul_configs.py, every candidate is timed on the four
projection shapes at the bucket's representative Ms, as a ratio to cuBLAS measured alongside;
the best candidate per bucket is printed as a config-table line. Candidates differ only in what
the table's rules allow (never BLOCK_K), so any of them keeps the bits; the GPU tests check it.
"""
from __future__ import annotations

import statistics
import sys

import torch

from _harness import graph_ms_per_call
from bench_matmul import QWEN3_8B_PROJECTIONS
from lockstep.kernels._triton import matmul_configs as mc
import lockstep.kernels as K

G = mc.GemmConfig
BUCKETS = {  # bucket bound -> (Ms it is judged on, candidates)
    64: ([1, 8, 64], [G(64, 32, 1, 4, 8), G(64, 32, 1, 4, 8, 2), G(64, 64, 1, 4, 6), G(64, 64, 1, 4, 6, 2),
                      G(64, 128, 1, 4, 4), G(64, 128, 1, 4, 4, 2), G(64, 32, 1, 4, 12)]),
    256: ([256], [G(64, 128, 8, 4, 5), G(64, 128, 8, 4, 5, 2), G(128, 128, 8, 8, 4), G(64, 256, 8, 4, 4),
                  G(128, 64, 8, 4, 5), G(128, 256, 8, 8, 3)]),
    1024: ([1024], [G(128, 128, 8, 8, 4), G(128, 256, 8, 8, 3), G(64, 256, 8, 4, 4), G(128, 128, 8, 8, 4, 2)]),
}


# Decode-bucket candidates for the column-parallel shapes, all with swapped operands (weight rows as
# the MMA's M side, block_n of them per program; the rows of x, up to block_m, its N side): no 64-row
# padding of x in every stage (unswapped, narrower and multi-step tiles lost on an H200, RESULTS.md).
COLUMN_DECODE = [G(64, 64, 1, 4, 8, swap_ab=True), G(64, 128, 1, 4, 8, swap_ab=True),  # the table's (M <= 64)
                 G(128, 64, 1, 4, 6, swap_ab=True),  # the table's 65-128 rows at qkv's N
                 G(256, 64, 1, 4, 4, swap_ab=True),  # the table's 129-256 rows at qkv's N (one wgmma n256)
                 G(256, 64, 1, 4, 3, swap_ab=True),
                 # warp-specialised (at most 4 stages: `linear` refuses more, matmul.py): a producer warpgroup
                 # streams the weight, two consumers take 64 of a program's 128 weight rows each
                 G(64, 128, 1, 4, 4, swap_ab=True, warp_specialize=True),
                 G(128, 128, 1, 4, 4, swap_ab=True, warp_specialize=True),
                 G(256, 128, 1, 4, 3, swap_ab=True, warp_specialize=True),
                 # the M <= 64 bucket's swapped tiles with more weight in flight (96 programs at qkv's N)
                 *(G(64, 64, 1, 4, s, swap_ab=True) for s in (10, 12, 14)),  # (128 weight rows at 10+ stages: no room)
                 # ... in Gluon (swap_ws.py): a producer warp, one consumer warpgroup, `steps` K steps a barrier
                 *(G(64, 64, 1, 4, s, swap_ab=True, warp_specialize=True, gluon=True, steps_per_stage=steps)
                   for s, steps in ((10, 1), (12, 1), (5, 2), (6, 2), (3, 4))),
                 # ... and up to 128 rows of x (the 8B rollout's decode batch): 24 KiB a step. (3 slots of 3
                 # steps, swept until the fifty-second session, never ran Gluon here: qkv's and gate/up's
                 # K = 4,096 is 64 steps, no whole slots of 3, so `linear` ran its tile in the tl kernel,
                 # the 3-stage tile below)
                 *(G(128, 64, 1, 4, s, swap_ab=True, warp_specialize=True, gluon=True, steps_per_stage=steps)
                   for s, steps in ((8, 1), (4, 2))),
                 G(128, 64, 1, 4, 3, swap_ab=True)]  # the table's 113-128 rows at gate/up's width

# Warp-specialised candidates (a producer warpgroup and two 64-row consumer warpgroups per
# 128-row tile, persistent) for the buckets from 129 rows on, against the table's configs.
LARGE_MS = [256, 512, 1024, 4096]
LARGE = [G(128, 256, 8, 4, 3, warp_specialize=True), G(128, 128, 8, 4, 4, warp_specialize=True),
         G(128, 128, 8, 4, 3, warp_specialize=True), G(256, 128, 8, 4, 3, warp_specialize=True),
         G(128, 64, 8, 4, 4, warp_specialize=True), G(128, 256, 4, 4, 3, warp_specialize=True),
         G(64, 128, 8, 4, 5), G(64, 256, 8, 4, 4), G(128, 256, 8, 8, 3)]  # the tables' earlier configs


def _diverging(cfg: mc.GemmConfig, x: torch.Tensor, w: torch.Tensor, ref: dict) -> str:
    """'' when cfg's `linear` gives ref's bits at each M of ref, else how far off it is (the largest
    |difference| against the largest |value|) and whether a second run repeats its own bits."""
    for m, want in ref.items():
        got = with_config(cfg, lambda: K.linear(x[:m], w))
        if not torch.equal(got, want):
            again = with_config(cfg, lambda: K.linear(x[:m], w))
            return (f"M={m}: max |diff| {(got.float() - want.float()).abs().max().item():.3g} of max |value| "
                    f"{want.float().abs().max().item():.3g}; a second run {'repeats' if torch.equal(got, again) else 'differs from'} it")
    return ""


def with_config(cfg: mc.GemmConfig, fn):
    """fn() with cfg as the 16-bit table's only config."""
    original, wide = list(mc.CONFIGS_16BIT), list(mc.WIDTH_CONFIGS_16BIT)
    mc.CONFIGS_16BIT[:], mc.WIDTH_CONFIGS_16BIT[:] = [(None, cfg)], []
    try:
        return fn()
    finally:
        mc.CONFIGS_16BIT[:], mc.WIDTH_CONFIGS_16BIT[:] = original, wide


def ratio(cfg: mc.GemmConfig, ms: list[int], shapes=QWEN3_8B_PROJECTIONS) -> float:
    def run():
        ratios = []
        for _, k, n in shapes:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ratios.append(graph_ms_per_call(lambda: x @ w.t()) / graph_ms_per_call(lambda: K.linear(x, w)))
        return statistics.geometric_mean(ratios)
    return with_config(cfg, run)


def _same_bits(candidates: list[mc.GemmConfig], check_ms: tuple[int, ...]) -> list[mc.GemmConfig]:
    """The candidates whose `linear` gives the table's bits at each of check_ms (qkv's shape); the
    others are reported with how far off they are."""
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) / 64
    x = torch.randn(max(check_ms), 4096, device="cuda", dtype=torch.bfloat16)
    ref = {m: K.linear(x[:m], w) for m in check_ms}  # the table's kernel
    same = []
    for cfg in candidates:
        try:
            off = _diverging(cfg, x, w, ref)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is just not a winner
            print(f"  {cfg}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
            continue
        if off:
            print(f"  {cfg}: BITS DIFFER from the table's kernel, {off}", flush=True)
        else:
            same.append(cfg)
    return same


COLUMN_SHAPES = [s for s in QWEN3_8B_PROJECTIONS if s[0] in ("qkv", "gate_up")]


def column(block_m: int | None = None) -> None:
    """COLUMN_DECODE (those of `block_m` x rows a tile, if given: at M <= block_m only) at M = 1 .. 256
    on qkv and gate_up, bits checked first at Ms that take one, two or several x tiles."""
    ms = [m for m in (1, 8, 64, 128, 256) if block_m is None or m <= block_m]
    cands = [c for c in COLUMN_DECODE if block_m is None or c.block_m == block_m]
    for cfg in _same_bits(cands, (1, 8, 17, 64, 100, 128, 200, 256)):
        per_m = [ratio(cfg, [m], [shape]) for shape in COLUMN_SHAPES for m in ms]
        small = [r for i, r in enumerate(per_m) if ms[i % len(ms)] <= 64]
        print(f"column M<=64 geomean {statistics.geometric_mean(small):.3f}  qkv M={','.join(map(str, ms))} "
              f"{' '.join(f'{r:.3f}' for r in per_m[:len(ms)])}  "
              f"gate_up {' '.join(f'{r:.3f}' for r in per_m[len(ms):])}"
              f"  {cfg}", flush=True)


def large() -> None:
    """LARGE and the table's own config at each of LARGE_MS on qkv and gate_up, every candidate
    checked bitwise against the table's kernel at three Ms (one of them a partial tile) first."""
    same = _same_bits(LARGE, (200, 256, 1100))
    for m in LARGE_MS:
        table = mc.config_for(m, torch.bfloat16, 6144)
        per = {cfg: [ratio(cfg, [m], [shape]) for shape in COLUMN_SHAPES] for cfg in dict.fromkeys([table, *same])}
        for cfg, r in sorted(per.items(), key=lambda t: -statistics.geometric_mean(t[1])):
            print(f"M={m} qkv {r[0]:.3f} gate_up {r[1]:.3f}  {'TABLE ' if cfg == table else ''}{cfg}", flush=True)


PER_SHAPE = [*QWEN3_8B_PROJECTIONS, ("lm_head", 4096, 151936)]


def per_shape(m: int, shapes: list[str] | None = None, rows128: bool = False) -> None:
    """Every bucket's candidates at one M (and the swapped column tiles that hold its rows in one x
    tile), shape by shape (a table keyed by M alone takes one config for all of them: this says
    what that costs each shape). shapes: those of PER_SHAPE alone; rows128: only COLUMN_DECODE's
    swapped tiles of 128 rows of x on 64 weight rows (tl and Gluon) against the table's config."""
    if rows128:
        candidates = [c for c in COLUMN_DECODE if c.swap_ab and c.block_m == 128 and c.block_n == 64]
    else:
        candidates = list(dict.fromkeys([*(c for _, cands in BUCKETS.values() for c in cands),
                                         *(c for c in COLUMN_DECODE if c.block_m >= m)]))
    for shape in [s for s in PER_SHAPE if shapes is None or s[0] in shapes]:
        current = mc.config_for(m, torch.bfloat16, shape[2])
        scored = [(ratio(cfg, [m], [shape]), cfg) for cfg in candidates]
        for r, cfg in scored:  # every reading in the log; the summary lines below are the tail
            print(f"  M={m} {shape[0]} {r:.3f}x {cfg}", flush=True)
        now = next(r for r, cfg in scored if cfg == current) if current in candidates else ratio(current, [m], [shape])
        top = sorted(scored, key=lambda t: -t[0])[:3]
        print(f"M={m} {shape[0]}: current {now:.3f}x cuBLAS {current}; best "
              + "; ".join(f"{r:.3f}x {cfg}" for r, cfg in top), flush=True)


def main() -> None:
    # --shapes' names checked before the backend is set up (on a host without a GPU that fails first)
    shapes = sys.argv[sys.argv.index("--shapes") + 1].split(",") if "--shapes" in sys.argv else None
    unknown = sorted(set(shapes or ()) - {s[0] for s in PER_SHAPE})
    if ("--shapes" in sys.argv or "--rows128" in sys.argv) and "--m" not in sys.argv:
        raise SystemExit("sweep_gemm.py: --shapes and --rows128 go with --m (the per-shape sweep); the other "
                         "modes run their own shapes")
    if unknown:
        raise SystemExit(f"sweep_gemm.py --shapes: {unknown} unknown; valid: {', '.join(s[0] for s in PER_SHAPE)}")
    K.set_backend("triton")
    if "--column" in sys.argv:  # --column [--block-m 64]: only the tiles of that many x rows, at M <= it
        column(int(sys.argv[sys.argv.index("--block-m") + 1]) if "--block-m" in sys.argv else None)
        return
    if "--large" in sys.argv:
        large()
        return
    if "--m" in sys.argv:  # --m M[,M...] [--shapes NAME,...] [--rows128]
        for m in sys.argv[sys.argv.index("--m") + 1].split(","):
            per_shape(int(m), shapes, "--rows128" in sys.argv)
        return
    for bound, (ms, candidates) in BUCKETS.items():
        scored = []
        for cfg in candidates:
            try:
                scored.append((ratio(cfg, ms), cfg))
            except Exception as e:  # noqa: BLE001 - a config that does not compile is just not a winner
                print(f"  M<={bound} {cfg}: failed ({type(e).__name__}: {str(e)[:80]})")
        for r, cfg in sorted(scored, key=lambda t: -t[0]):
            print(f"  M<={bound} ratio {r:.3f}  {cfg}")
        best = max(scored, key=lambda t: t[0])
        print(f"BEST M<={bound}: ({bound}, {best[1]!r}),  # geomean {best[0]:.3f}x cuBLAS on M={ms}", flush=True)


if __name__ == "__main__":
    main()
