"""Sweep of the K-chunk tree GEMM (kernels/_triton/splitk.py) on the GPU at hand: tile config x
programs per tile (split 1: one program holds a tile's whole tree in registers, one loop over every
chunk's steps; split > 1: subtrees, one loop per chunk; gluon: the warp-specialised tree of
splitk_ws.py, split 1, its consumers' wgmmas waited step by step or left in flight, one or two
accumulators a consumer, the tile stored from registers or by TMA; gluon-swap: swap_ws.py's
subtrees at a split),
bf16, vs cuBLAS and vs the plain `linear` kernel.

    python benchmarks/sweep_rowtree.py [OUT.md]                      # the row-parallel GEMM as it runs:
                                                                     # o_proj / down_proj, 8 chunks
    python benchmarks/sweep_rowtree.py OUT.md --shapes column --chunks 2
        # what a K-chunk tree would give the column-parallel projections (qkv, gate_up), whose
        # `linear` has no split at small M (issue 15)

Every candidate computes the same bits (tile and split decide only which program computes an
element and where a sum is done): each is checked bitwise against the default before it is
timed. Split candidates run where tiles are few (M <= 256), split 1 where they are many (M >= 128).
Prints, per (shape, M), cuBLAS, `linear` and the default's time and the best candidate; then each
candidate's geometric-mean ratio over the Ms of a bucket.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from _harness import emit, graph_ms_per_call
import lockstep.kernels as K
from lockstep.kernels._triton.matmul_configs import GemmConfig as G
from lockstep.kernels._triton.splitk import row_tree

SHAPES = {"row": [("o_proj", 4096, 4096), ("down", 12288, 4096)],
          "column": [("qkv", 4096, 6144), ("gate_up", 4096, 24576)]}  # (name, K, N) of Qwen3-8B
MS = [1, 8, 64, 128, 256, 512, 1024, 4096]
SPLIT_CONFIGS = [G(64, 128, 8, 4, 4), G(64, 64, 1, 4, 4, 2), G(64, 128, 1, 8, 4),
                 # swapped operands (weight rows as the MMA's M side; see matmul_configs.py)
                 G(64, 64, 1, 4, 4, swap_ab=True), G(64, 64, 1, 4, 6, swap_ab=True), G(64, 128, 1, 4, 4, swap_ab=True),
                 G(64, 64, 1, 4, 4, 2, swap_ab=True), G(64, 64, 1, 4, 8, swap_ab=True),
                 G(64, 128, 1, 4, 6, swap_ab=True),
                 # 128 or 256 rows of x on the N side: M = 128 and 256 (still unswapped, 0.68-0.86x); at 3
                 # stages (72 KiB of ring) the 128-row tile is `linear`'s gate/up entry at 113-128 rows
                 G(128, 64, 1, 4, 4, swap_ab=True), G(128, 64, 1, 4, 3, swap_ab=True),
                 G(256, 64, 1, 4, 3, swap_ab=True)]
SPLITS = [None, 1, 2, 4, 8]  # None: the launcher's choice; splits above the chunk count are skipped


# the swapped Gluon subtrees (swap_ws.py): a producer warp, one consumer warpgroup of 64 weight rows
# alternating two accumulators over the chunks, (slots, K steps a slot)
# alternating two accumulators over the chunks, (weight rows, slots, K steps a slot); 128 weight rows:
# two wgmmas a step on the same rows of x
SWAPPED_GLUON_CONFIGS = [G(64, rows, 1, 4, stages, swap_ab=True, warp_specialize=True, gluon=True,
                           steps_per_stage=steps)
                         for rows, stages, steps in ((64, 6, 2), (64, 4, 2), (64, 8, 1), (128, 4, 2), (128, 3, 2),
                                                     (128, 6, 1), (128, 8, 1))] + [
    # 128 rows of x (the 8B rollout's decode batch) on the N side of 64 weight rows; 144-192 KiB of
    # ring. The first (8 slots of 1 step) is the table's 97-128-row bucket (matmul_configs.py)
    G(128, 64, 1, 4, stages, swap_ab=True, warp_specialize=True, gluon=True, steps_per_stage=steps)
    for stages, steps in ((8, 1), (4, 2), (6, 1))]


def _gluon(block_n: int, stages: int, in_flight: int = 1, group_m: int = 8, accumulators: int = 1,
           tma_store: bool = False, siblings: bool = False) -> G:
    """The warp-specialised Gluon tree (splitk_ws.py): 128-row tiles, two consumers of 64 rows."""
    return G(128, block_n, group_m, 4, stages, warp_specialize=True, gluon=True, wgmma_in_flight=in_flight,
             accumulators=accumulators, tma_store=tma_store, siblings=siblings)


# 128 x 256 tiles and 6 stages of 128 x 128 fit beside a tree's pending quads only for <= 4 chunks
# (a candidate that does not fit fails and is skipped); 96 and 192 columns: two wgmmas a step
# (64 + 32, 128 + 64)
GLUON_CONFIGS = [_gluon(128, 4, 0), _gluon(128, 4), _gluon(128, 5), _gluon(128, 6), _gluon(128, 4, group_m=4),
                 _gluon(64, 6, 0), _gluon(64, 6), _gluon(64, 8), _gluon(256, 3), _gluon(256, 4),
                 _gluon(96, 6), _gluon(96, 8), _gluon(192, 4), _gluon(96, 6, group_m=1),
                 # two accumulators a consumer, alternating chunks (no drain at a chunk's end)
                 _gluon(64, 6, accumulators=2), _gluon(64, 8, accumulators=2), _gluon(128, 4, accumulators=2),
                 _gluon(128, 5, accumulators=2),
                 # the tile written through shared memory by a TMA store left in flight (as many stages as fit)
                 _gluon(128, 6, tma_store=True), _gluon(256, 3, tma_store=True), _gluon(96, 7, tma_store=True),
                 _gluon(192, 4, tma_store=True), _gluon(64, 7, accumulators=2, tma_store=True),
                 _gluon(128, 4, tma_store=True), _gluon(128, 4, accumulators=2, tma_store=True),
                 # sibling chunks step by step (a drain every two chunks, one accumulator's registers)
                 _gluon(128, 4, tma_store=True, siblings=True), _gluon(128, 5, siblings=True),
                 _gluon(64, 8, siblings=True), _gluon(64, 7, tma_store=True, siblings=True)]
WHOLE_TREE_CONFIGS = [G(128, 128, 8, 8, 4), G(128, 128, 8, 8, 3), G(64, 256, 8, 8, 4), G(64, 128, 8, 4, 4),
                      G(128, 64, 8, 4, 4), *GLUON_CONFIGS]


def candidates(m: int, chunks: int, whole_only: bool = False, gluon_only: bool = False, swapped_only: bool = False,
               tma_only: bool = False, splits: list[int | None] | None = None, swapped: list[int] | None = None):
    if swapped_only:  # (swapped: indices into this list; splits: a subset of SPLITS)
        configs = [SPLIT_CONFIGS[3], *SWAPPED_GLUON_CONFIGS]  # the tl kernel's best, the Gluon ones
        yield from ((cfg, split) for cfg in (configs if swapped is None else [configs[i] for i in swapped])
                    for split in (SPLITS if splits is None else splits) if not split or split <= chunks)
        return
    if gluon_only:
        yield from ((cfg, 1) for cfg in GLUON_CONFIGS if cfg.tma_store or not tma_only)
        return
    if m <= 256 and not whole_only:
        yield from ((cfg, split) for cfg in SPLIT_CONFIGS for split in SPLITS if not split or split <= chunks)
    if m >= 128 or whole_only:
        yield from ((cfg, 1) for cfg in WHOLE_TREE_CONFIGS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?")
    p.add_argument("--shapes", choices=sorted(SHAPES), default="row")
    p.add_argument("--chunks", type=int, choices=(1, 2, 4, 8), default=8,
                   help="K chunks of the tree (1: a plain GEMM, the same sums as `linear`)")
    p.add_argument("--ms", default=",".join(map(str, MS)), help="comma-separated row counts (default: %(default)s)")
    p.add_argument("--whole-only", action="store_true", help="only whole-tree (split 1) candidates, at every M")
    p.add_argument("--gluon-only", action="store_true", help="only the Gluon tree's candidates, at every M")
    p.add_argument("--tma-only", action="store_true", help="with --gluon-only: only the TMA-store candidates")
    p.add_argument("--match", help="only the candidates whose key (as printed) contains one of these comma-separated "
                                   "strings")
    p.add_argument("--swapped-only", action="store_true",
                   help="only the swapped split candidates (the M <= 64 bucket's kind: the tl kernel's best "
                        "64-row tile and the Gluon ones), at every M")
    p.add_argument("--splits", help="with --swapped-only: only these splits, comma-separated (auto: the launcher's)")
    p.add_argument("--swapped", help="with --swapped-only: only these candidates, comma-separated indices (0: the tl "
                                     "tile, 1..: SWAPPED_GLUON_CONFIGS)")
    args = p.parse_args()
    splits = None if args.splits is None else [None if v == "auto" else int(v) for v in args.splits.split(",")]
    swapped = None if args.swapped is None else [int(v) for v in args.swapped.split(",")]
    K.set_backend("triton")
    lines = [f"Device: {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.shapes} shapes, "
             f"{args.chunks} K chunks\n",
             "| shape | M | cuBLAS us | linear ratio | default us | default ratio | best candidate | best us | best ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    scores: dict[tuple, list[float]] = {}
    for name, k, n in SHAPES[args.shapes]:
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        chunk = k // args.chunks
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref = row_tree(x, w, chunk, x.dtype)
            if args.chunks == 1 and not torch.equal(ref, K.linear(x, w)):  # one chunk: `linear`'s own sums
                print(f"  {name} M={m}: the one-chunk tree's BITS DIFFER from linear", flush=True)
            cublas = graph_ms_per_call(lambda: x @ w.t()) * 1e3
            linear = graph_ms_per_call(lambda: K.linear(x, w)) * 1e3
            default = graph_ms_per_call(lambda: row_tree(x, w, chunk, x.dtype)) * 1e3
            best = (default, "default")
            for cfg, split in candidates(m, args.chunks, args.whole_only, args.gluon_only, args.swapped_only,
                                         args.tma_only, splits, swapped):
                kind = ("gluon-swap" if cfg.swap_ab else f"gluon{cfg.wgmma_in_flight}") if cfg.gluon else (
                    "swap" if cfg.swap_ab else "-")
                key = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.programs_per_sm, kind, cfg.group_m,
                       split or "auto", *((f"{cfg.steps_per_stage}steps",) if cfg.steps_per_stage > 1 else ()),
                       *((f"{cfg.accumulators}acc",) if cfg.accumulators > 1 else ()),
                       *(("sib",) if cfg.siblings else ()),
                       *(("tma",) if cfg.tma_store else ()))
                if args.match and not any(part in str(key) for part in args.match.split(",")):
                    continue
                fn = lambda: row_tree(x, w, chunk, x.dtype, split=split, config=cfg)  # noqa: E731
                try:
                    got = fn()
                except Exception as e:  # noqa: BLE001 - a candidate that does not compile is no winner
                    print(f"  {name} M={m} {key}: failed {type(e).__name__}: {str(e)[:100]}", flush=True)
                    continue
                if not torch.equal(got, ref):
                    print(f"  {name} M={m} {key}: BITS DIFFER from the default, max |diff| "
                          f"{(got.float() - ref.float()).abs().max().item():.3g}", flush=True)
                    continue
                us = graph_ms_per_call(fn) * 1e3
                print(f"  {name} M={m} {key}: {us:.1f} us, {cublas / us:.3f}x cuBLAS", flush=True)
                scores.setdefault(key, []).append((m, cublas / us))
                if us < best[0]:
                    best = (us, str(key))
            lines.append(f"| {name} | {m} | {cublas:.1f} | {cublas / linear:.3f} | {default:.1f} | {cublas / default:.3f} "
                         f"| {best[1]} | {best[0]:.1f} | {cublas / best[0]:.3f} |")
            print(lines[-1], flush=True)
    lines += ["", "Geometric-mean ratio to cuBLAS per candidate (tile, warps, stages, programs/SM, swap, split):", ""]
    for bucket in ([1, 8, 64], [128], [256], [512], [1024], [4096]):
        ranked = sorted(((statistics.geometric_mean([r for m, r in v if m in bucket]), key)
                         for key, v in scores.items() if any(m in bucket for m, _ in v)), reverse=True)
        lines.append(f"M in {bucket}: " + "; ".join(f"{key} {r:.3f}" for r, key in ranked[:6]))
    emit(lines, args.out)


if __name__ == "__main__":
    main()
