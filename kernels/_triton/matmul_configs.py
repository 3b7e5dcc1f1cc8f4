"""Tile configurations of the lockstep GEMM: the table to edit when tuning on a GPU.

What an edit must keep (batch invariance): an output element is always the sum of
ceil(K / BLOCK_K) `tl.dot` steps of BLOCK_K products each, taken in ascending k and accumulated
in fp32. BLOCK_K is therefore fixed per dtype (below) and never chosen from M. Everything else in
a bucket (BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages) only decides which program computes an
element and how the loads are pipelined, not the arithmetic, so it may differ between M buckets.

One more rule for 16-bit dtypes on Hopper: BLOCK_M stays a multiple of 64 and num_warps a
multiple of 4. Triton then lowers every bucket's tl.dot to wgmma; below that it falls back to
mma.sync (MMAv2), a different instruction. On an H200 its sums of a bf16 dot chain equal wgmma's
(benchmarks/probe_limits.py mma, twelve shapes and data, 0 elements differing; the decode kernel's
16-row tiles too), but no GEMM test checks it, so the rule stands.

Shared memory per program (bf16) = num_stages * (BLOCK_M + BLOCK_N) * BLOCK_K * 2 bytes of
operand buffers + BLOCK_M * BLOCK_N * 2 bytes of epilogue staging; keep it under 227 KiB (H100/H200).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    group_m: int  # row tiles that sweep the N tiles together (L2 reuse of weight tiles)
    num_warps: int
    num_stages: int
    programs_per_sm: int = 1  # persistent programs per SM (>1 overlaps one program's epilogue/loads with another's MMA)
    # x @ weight^T computed as (weight @ x^T)^T (matmul._gemm_swap_kernel): block_n weight rows are the
    # MMA's M side, up to block_m rows of x its N side (16-256 wide): decode-sized x is not padded to
    # 64 rows. Same sums: for bf16 on sm_90 both orders are one wgmma per BLOCK_K step.
    swap_ab: bool = False
    # Triton's Hopper warp specialisation (tl.range(warp_specialize=True)): num_warps=4 becomes a
    # producer warpgroup issuing the TMA loads and two consumer warpgroups, each with 64 of the
    # tile's MMA rows, issuing the MMAs; the loads keep flowing across tile ends.
    # The same dots in the same order: it moves only which warps do what. Needs num_warps 4 (the
    # consumers' warps) and 128 MMA rows a tile to split (block_m, or with swap_ab the block_n
    # weight rows).
    warp_specialize: bool = False
    # The warp-specialised schedule written out in Gluon (splitk_ws.py) instead of left to Triton's
    # pass: a producer warp and two independent consumer warpgroups of 64 rows, one persistent
    # program a tile, any stage count whose buffers fit. Needs warp_specialize, block_m=128 and no
    # swap. `linear`'s forward (x @ weight^T) runs it on the GPU; its backward's operand layouts and
    # Triton's interpreter run the tl kernel with the same tile (the same sums). The row-parallel
    # tree's warp-specialised form exists only in Gluon. There the ring takes any stage count whose
    # buffers fit, and block_n may be a power of two plus a smaller one (96 = 64 + 32: two wgmmas a
    # step); the tl kernel runs the tile as tl_tile() gives it.
    gluon: bool = False
    # A Gluon consumer's wgmma groups left in flight while it frees the previous step's slot and
    # awaits the next (0: each step's MMA waited for before its slot is freed). Only the schedule:
    # the MMAs of one accumulator run in issue order either way.
    wgmma_in_flight: int = 1
    # A swapped Gluon config (gluon and swap_ab: swap_ws.py, `linear`'s decode-sized forward): the
    # BLOCK_K steps each slot of its ring holds, one barrier wait a slot. Only the schedule: the
    # steps run in ascending k either way.
    steps_per_stage: int = 1
    # The row-parallel tree's unswapped Gluon consumer (splitk_ws.py): accumulators it alternates
    # between K chunks. 2: chunk j + 1's first wgmma is issued before chunk j's product is waited for
    # and joined, so the tensor cores never drain at a chunk's end (1: each chunk drained, then
    # joined). Only the schedule: each chunk's product is the same sum from zero, the tree the same.
    # Two more accumulators a consumer: block_n a power of two up to 128 (at 128 and 8 chunks ptxas
    # spills 256 bytes a thread).
    # (The swapped Gluon kernel, swap_ws.py, always alternates: its accumulators are small.)
    accumulators: int = 1
    # The row-parallel tree's unswapped Gluon consumer (splitk_ws.py): sibling chunks 2i and 2i + 1
    # multiplied step by step, alternately, into two accumulators and joined once both finish, so
    # that a consumer drains its wgmmas every two chunks instead of every chunk, holding no more than
    # one accumulator and its two pending subtrees would (the pair's left holder is the first
    # sibling's accumulator). Only the schedule: each chunk's product is the same sum from zero over
    # its steps in ascending k, the tree the same. Needs wgmma_in_flight=1, one accumulator and a
    # block_n that is a power of two; a one-chunk product (`linear`'s) ignores it. ROW_CONFIGS_16BIT
    # takes it above 256 rows (1.02-1.10x there, H100).
    siblings: bool = False
    # The unswapped Gluon consumer (splitk_ws.py) writes each finished tile to shared memory and leaves
    # it to a TMA store it does not wait for, so the next tile's wgmmas overlap the write (False: a
    # store from registers, which the consumer issues before its next tile). Only where the two
    # consumers' tiles fit beside the ring (and a tree's quads) and the output is a TMA operand; a TP
    # rank's fp32 subtree roots, twice the bytes, may not, and leave from registers: the same values.
    tma_store: bool = False

    def __post_init__(self):
        if self.gluon and self.swap_ab:  # swap_ws.py: one consumer warpgroup of 64 weight rows, a producer warp
            shape_ok = self.block_n in (64, 128) and self.num_warps == 4 and self.block_m in (16, 32, 64, 128)
            if not (self.warp_specialize and shape_ok):
                raise ValueError(f"{self}: a swapped Gluon tile (swap_ws.py) needs warp_specialize=True, block_n 64 or "
                                 "128 (one consumer warpgroup's one or two wgmma M sides), num_warps=4 and block_m 16, "
                                 "32, 64 or 128")
        elif self.warp_specialize and (self.num_warps != 4 or (self.block_n if self.swap_ab else self.block_m) % 128):
            raise ValueError(f"{self}: warp_specialize needs num_warps=4 and a multiple of 128 MMA rows "
                             "(block_m, or block_n with swap_ab)")
        if self.gluon and not self.swap_ab and (not self.warp_specialize or self.block_m != 128):
            raise ValueError(f"{self}: gluon is the warp-specialised schedule of 128-row unswapped tiles (or of "
                             "swapped 64-row ones): it needs warp_specialize=True and block_m=128")
        if self.steps_per_stage != 1 and not (self.gluon and self.swap_ab):
            raise ValueError(f"{self}: steps_per_stage is the swapped Gluon kernel's (gluon=True, swap_ab=True)")
        if self.block_n & (self.block_n - 1) and not self.gluon:
            raise ValueError(f"{self}: a block_n that is no power of two (two products a tile) needs gluon=True")
        if self.accumulators not in (1, 2) or (self.accumulators == 2 and not (
                self.gluon and not self.swap_ab and self.wgmma_in_flight == 1 and self.block_n in (16, 32, 64, 128))):
            raise ValueError(f"{self}: accumulators is 1, or 2 for an unswapped Gluon tile (gluon=True) of block_n "
                             "16-128 (two more accumulators a consumer) with its wgmmas in flight (wgmma_in_flight=1)")
        if self.siblings and not (self.gluon and not self.swap_ab and self.wgmma_in_flight == 1
                                  and self.accumulators == 1 and self.block_n & (self.block_n - 1) == 0):
            raise ValueError(f"{self}: siblings is the unswapped Gluon tree's schedule (gluon=True, swap_ab=False) with "
                             "its wgmmas in flight (wgmma_in_flight=1), one accumulator and a power-of-two block_n")
        if self.tma_store and not (self.gluon and not self.swap_ab):
            raise ValueError(f"{self}: tma_store is the unswapped Gluon consumer's epilogue (gluon=True, swap_ab=False)")
        if self.wgmma_in_flight not in (0, 1):
            raise ValueError(f"{self}: wgmma_in_flight is 0 or 1 (wgmma groups a Gluon consumer leaves in flight)")


# Every warp-specialised `linear` config with 5 or more stages that benchmarks/sweep_gemm.py ran (5, 6, 8
# and 12; plain and swapped) gave other bits than the table's kernel on an H200 with Triton 3.6, every
# one with 3 or 4 stages the same bits: a limit of Triton's Hopper pass, not of the arithmetic, so
# matmul.py refuses more. The row-parallel tree's Gluon kernel sets its own schedule and takes any
# count whose buffers fit (splitk_ws.py).
MAX_WARP_SPECIALIZED_STAGES = 4


BLOCK_K = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 32}

# 128 rows of x (a decode batch of 65-128) on the N side of 64 weight rows, in Gluon (swap_ws.py), 8
# slots of one K step: the 65-128-row bucket of `linear`, the 97-128-row one of the row-parallel tree
# (readings there)
SWAPPED_128_ROWS = GemmConfig(block_m=128, block_n=64, group_m=1, num_warps=4, num_stages=8, swap_ab=True,
                              warp_specialize=True, gluon=True)

# (largest M of the bucket, config), ascending; the last bucket (None) takes every larger M.
CONFIGS_16BIT: list[tuple[int | None, GemmConfig]] = [
    # Decode and small batches: the weight read dominates and there is no split-K to add
    # parallelism. Swapped operands (weight rows as the wgmma's 64-row M side, x's rows as its
    # 16-64-wide N side, no 64-row zero padding of x): 64 weight rows per program (96 programs at
    # qkv's N = 6144). The fifth session's tl kernel (8 stages) ran 0.90-1.01x cuBLAS on qkv and
    # gate_up at M = 1 and 8 against 0.53-0.81x for unswapped 64x128 tiles, then 0.81-0.93x on qkv in
    # every later call, whatever its stages (8 / 10 / 12 / 14 read alike within the calls' spread). It
    # waits on a barrier and a wgmma for every 64 x 16 x 64 product; a schedule that waits less often
    # is what moved it:
    # Gluon (swap_ws.py: a producer warp, one consumer warpgroup, 2 K steps a slot, 6 slots):
    # eighteenth session, sweep_gemm.py --column --block-m 64, one call, bits checked against the
    # table's kernel first: qkv 1.028 / 1.030 / 0.986x cuBLAS at M = 1 / 8 / 64 against 0.860 /
    # 0.890 / 0.875 for the tl kernel at 8 stages; gate_up 0.977 / 1.058 / 0.950 against 0.899 /
    # 1.003 / 0.919 (64 x 128 tl tiles at M = 64). 1 step a slot at 10 / 12 slots 0.948-0.965
    # (geometric mean), 4 steps at 3 slots 0.975, 2 at 5 0.997, 2 at 6 1.004.
    # 6 * 2 * (64 + 64) * 64 * 2 B = 192 KiB at M = 64.
    (64, GemmConfig(block_m=64, block_n=64, group_m=1, num_warps=4, num_stages=6, swap_ab=True, warp_specialize=True,
                    gluon=True, steps_per_stage=2)),
    # 65-128 rows (the 8B rollout's decode batch) at N < 16,384 (qkv): SWAPPED_128_ROWS (24 KiB a K
    # step). On qkv at M = 128: 0.867 / 0.868x cuBLAS against 0.808 / 0.810 for the same tile in the
    # tl kernel, 6 stages (H200, eighteenth session, two calls); 0.918 against 0.873 (H100,
    # thirty-third session; 4 slots of 2 steps 0.922, 3 of 3 0.587); sweep_gemm.py --column
    # --block-m 128, bits checked against the table's kernel first; at M = 80 0.762 against 0.648
    # (H100, sweep_gemm.py --m 80).
    (128, SWAPPED_128_ROWS),
    # 129-256 rows (other widths: WIDTH_CONFIGS_16BIT): swapped, all 256 rows of x as one wgmma's N
    # side (n256): 0.767x cuBLAS on qkv at M = 256 against 0.530x for unswapped 64x128 tiles and
    # 0.668x for warp-specialised 128x128 ones (H200, sweep_gemm.py --column and --large, bits
    # checked at M = 200 and 256).
    (256, GemmConfig(block_m=256, block_n=64, group_m=1, num_warps=4, num_stages=4, swap_ab=True)),
    # 257-1024 rows: warp-specialised 128x128 tiles, persistent (a producer warpgroup, two consumers
    # of 64 rows): 0.988x / 0.913x cuBLAS on qkv / gate_up at M = 1024 and 0.715x / 0.870x at 512,
    # against 0.908x / 0.920x and 0.697x / 0.832x for unswapped 64x256 tiles (H200, sweep_gemm.py --large).
    (1024, GemmConfig(block_m=128, block_n=128, group_m=8, num_warps=4, num_stages=4, warp_specialize=True)),
    # Large M: the classic Hopper 128x256x64 tile, two warpgroups, 3 stages
    # (144 KiB operands + 64 KiB epilogue staging), grouped by 8 for L2 reuse.
    (None, GemmConfig(block_m=128, block_n=256, group_m=8, num_warps=8, num_stages=3)),
]

# (smallest M, largest M, smallest N, N a multiple of, config): a product in that row range whose
# output width is at least that and a multiple of that takes the first matching config instead of its
# M bucket's (the bucket tables are keyed by M alone).
WIDTH_CONFIGS_16BIT: list[tuple[int, int, int, int, GemmConfig]] = [
    # A decode batch of 113-128 rows (the 8B rollout's steady batch: 128) against gate/up: the swapped
    # tl tile of 128 rows of x on 64 weight rows at 3 stages (matmul._gemm_swap_kernel). It is what the
    # sweeps' "Gluon 3 x 3" candidate (swap_ws.py, 3 slots of 3 K steps) ran at K = 4,096: 64 K steps
    # are no whole slots of 3, so `linear` took that config's tile in the tl kernel (matmul._gemm). At
    # M = 128: 1.004x cuBLAS against 0.921x for the 128x256 tl tile below (H100, thirty-third session,
    # sweep_gemm.py --m 128; its column sweep 0.987x), 0.934 / 0.945x in two calls against 0.864x
    # (H200, eighteenth session). The fifty-second session (H100, sweep_gemm.py --m 80,96,112,120,128
    # --shapes gate_up,lm_head --rows128, one call): gate/up 0.720 / 0.821 / 0.958 / 0.974 / 0.977x
    # against the 128x256 tile's 0.924 / 0.914 / 0.913 at 80 / 96 / 112 (120, 128: this entry); the LM
    # head's width (N = 151,936) takes this entry too: 0.864x against 0.977 at 112, 0.979 / 0.977 at
    # 120 / 128 (0.975 for the 128x256 tile at 128, thirty-third session), hence from 113 rows. The 8B
    # rollout (batch 128) with it: 12.72 s against 12.77 without, one A/B pair (RESULTS.md).
    (113, 128, 16384, 1, GemmConfig(block_m=128, block_n=64, group_m=1, num_warps=4, num_stages=3, swap_ab=True)),
    # A decode batch of 65-128 rows against gate/up (N = 24576): one 128x256 tile holds every row, so
    # each weight tile streams once; 0.864x cuBLAS against 0.795x for the bucket's 64x128 tiles (H200,
    # M = 128, benchmarks/sweep_gemm.py --m 128). At qkv's N = 6144 it would leave most SMs idle.
    (65, 128, 16384, 1, GemmConfig(block_m=128, block_n=256, group_m=8, num_warps=8, num_stages=3)),
    # 129-1,024 rows against gate/up: warp-specialised tiles in Gluon (splitk_ws.py with one K chunk:
    # the same sums as _gemm_kernel, checked bitwise), each consumer's wgmma left in flight. 128x128
    # with 6 stages to 256 rows: 0.936 / 1.001x cuBLAS at M = 256 in two calls, against 0.815x for
    # the table before (128x128, 4 stages, each wgmma waited) in the first; 128x256 (each consumer a
    # 64x256 wgmma) with 3 stages above: 0.973 / 0.971x at M = 1,024 against 0.890x (H200,
    # sweep_rowtree.py --gluon-only --shapes column --chunks 1).
    # Nineteenth session: each tile leaves by a TMA store the consumer does not wait for (tma_store),
    # so the next tile's wgmmas overlap it: 0.935 / 0.897x cuBLAS at M = 256 / 1,024 against 0.899 /
    # 0.848x for these tiles stored from registers, in one call (sweep_rowtree.py --gluon-only
    # --tma-only --shapes column --chunks 1, bits checked against `linear` and the tree first).
    (129, 256, 16384, 1, GemmConfig(block_m=128, block_n=128, group_m=8, num_warps=4, num_stages=6,
                                 warp_specialize=True, gluon=True, tma_store=True)),
    (257, 1024, 16384, 1, GemmConfig(block_m=128, block_n=256, group_m=8, num_warps=4, num_stages=3,
                                     warp_specialize=True, gluon=True, tma_store=True)),
    # qkv's width (N = 6,144 = 64 x 96) at 129-256 rows: warp-specialised Gluon tiles of 128 x 96 (each
    # consumer a 64-wide and a 32-wide wgmma a step), 8 stages, the wgmmas left in flight: 128 tiles
    # fill the 132 SMs where 128x128 leaves 36 idle. 0.865x cuBLAS at M = 256 against 0.775x for
    # 128x128 (6 stages) and 0.698x for the swapped 256x64 bucket in an earlier call (H200,
    # sweep_rowtree.py --gluon-only --shapes column --chunks 1, bits checked against the table's kernel);
    # benchmarks/kernels.py's alternating turns read 0.930-0.934x in two calls. Nineteenth session:
    # stored by TMA (tma_store; 7 stages beside the tile's buffers), 0.942x against 0.863x for 8
    # stages stored from registers, in one call (as for gate/up above).
    (129, 256, 96, 96, GemmConfig(block_m=128, block_n=96, group_m=8, num_warps=4, num_stages=7,
                                 warp_specialize=True, gluon=True, tma_store=True)),
    # ... and at 257-1,024 rows, tiles of 128 x 192 (a 128- and a 64-wide wgmma a consumer), 4 stages:
    # 0.881 / 0.903x cuBLAS at M = 512 / 1,024 against 0.676 / 0.846x for the bucket's Triton pass on
    # 128x128 tiles, in the same call (as above); kernels.py read 0.853-0.864x at 1,024 in two calls.
    # At o_proj's N = 4,096 these widths leave a partial column of tiles: 0.678 / 0.618x at M = 256 /
    # 1,024 in kernels.py, hence "a multiple of".
    # Nineteenth session, stored by TMA: 0.992x at M = 1,024 against 0.903x from registers (one call).
    (257, 1024, 192, 192, GemmConfig(block_m=128, block_n=192, group_m=8, num_warps=4, num_stages=4,
                                   warp_specialize=True, gluon=True, tma_store=True)),
]

# fp32 runs `tl.dot(..., input_precision="ieee")` on FMA units (no tensor cores): exact fp32
# products, used for tests and small models rather than for speed. Tiles stay small because the
# operands sit in registers: 3 * (64 + 64) * 32 * 4 B = 48 KiB + 16 KiB staging.
CONFIGS_FP32: list[tuple[int | None, GemmConfig]] = [
    (64, GemmConfig(block_m=64, block_n=32, group_m=1, num_warps=4, num_stages=3)),
    (None, GemmConfig(block_m=64, block_n=64, group_m=8, num_warps=4, num_stages=3)),
]


# The row-parallel GEMM (splitk.py). Decode-sized x (M <= 64): swapped operands, 64 weight rows per
# tile (as in the decode bucket above): 0.68-1.02x cuBLAS at M = 1, 8, 64 on o_proj and down against
# 0.51-0.91x unswapped (H200, benchmarks/sweep_rowtree.py, RESULTS.md). 65-128 rows: one 64x128 tile
# on one warpgroup, subtrees split over programs (0.76 / 0.85x on o_proj / down at M = 128 against
# 0.78 / 0.74x for the warp-specialised tree's best, 128x64). Above: the warp-specialised Gluon tree
# (splitk_ws.py: a producer warp, two consumer warpgroups of 64 rows, one persistent program per SM),
# 128x64 tiles with 6 stages at 129-256 rows (0.84 / 0.87x at M = 256 against 0.65 / 0.84x for the
# 64x128 tile; 128x128 tiles leave half the SMs idle there: 0.58 / 0.62x), 128x128 with 4 stages
# beyond (0.80-0.85 / 0.83-0.91x at M = 512-4,096 against 0.41-0.53x for the 64x128 tile). Every
# candidate's bits checked against the table's kernel before timing. programs_per_sm is the program
# count the subtree split aims for at small M (programs = tiles x split); like every field here it
# never changes the bits. The Gluon buckets leave each consumer's wgmma in flight (wgmma_in_flight=1),
# which made room for more stages: 128x64 with 8 at 129-256 rows (0.953 geometric mean of o_proj and
# down at M = 256 against 0.892 for 6 stages waited), 128x128 with 5 beyond (0.852 / 0.839 at
# M = 512 / 1,024 against 0.827 / 0.816 for 4 stages waited; 0.819 vs 0.821 at 4,096; H200,
# sweep_rowtree.py --gluon-only).
#
# Nineteenth session (sweep_rowtree.py --swapped-only / --gluon-only, two calls, bits checked against the
# table's kernel first): at M <= 64 the swapped subtrees in Gluon (swap_ws.py, `linear`'s decode
# schedule: 6 slots of 2 K steps, two accumulators alternating over the chunks, split to fill one
# wave: 2 programs a tile at o_proj's and down's 64 tiles), the two calls' readings: o_proj 1.036 /
# 1.000, 1.023 / 1.040, 0.833 / 0.768x cuBLAS at M = 1, 8, 64 and down 1.131 / 1.128, 1.108 / 1.111,
# 1.035 / 1.042, against o_proj 1.016 / 1.016, 1.018 / 1.032, 0.747 / 0.726 and down 1.049 / 1.061,
# 1.038 / 1.049, 0.950 / 0.950 for the tl tile (4 programs a tile). 4 programs a tile (two waves:
# one program an SM) lost (0.55-0.57 on o_proj at M = 64), and so did 128 weight rows a program (two
# wgmmas a step on the same x): 0.53-0.63. At 129-256 rows the Gluon tree with two
# accumulators a consumer (GemmConfig.accumulators): 1.044 / 0.971 on o_proj / down at M = 256 against
# 0.949 / 0.940 for one, each chunk drained. At 1,024 rows two accumulators (8 chunks: 256 bytes
# spilled) read 0.828 / 0.781 against 0.769 / 0.805: not taken.
#
# Twentieth session: the swapped subtrees' programs fill half the SMs, not a wave (the readings are
# splitk.half_wave_split's): one program a tile at o_proj's and down's 64 tiles. With one program a
# tile, 4 slots of 2 steps read 0.940 / 0.847 at M = 64, 8 slots of 1 step 0.886 / 0.914.
ROW_CONFIGS_16BIT: list[tuple[int | None, GemmConfig]] = [
    (64, GemmConfig(block_m=64, block_n=64, group_m=1, num_warps=4, num_stages=6, swap_ab=True, warp_specialize=True,
                    gluon=True, steps_per_stage=2)),
    # 65-96 rows: the tl kernel's 64x128 tiles (two of x's row blocks), one program an SM. The
    # swapped Gluon tile below slows as its 128 rows of x go part full: o_proj / down 22.6 / 59.3 us
    # at M = 80 and 18.6 / 52.9 at 96 against 21.3 / 48.2 and 20.0 / 48.8 for these tiles, then
    # 15.4 / 46.7 at 112 and 14.3 / 47.0 at 128 against 21.7 / 49.5 and 23.6 / 50.4 (H100,
    # thirty-third session, one call: sweep_rowtree.py --ms 80,96,112,128).
    (96, GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4, programs_per_sm=1)),
    # 97-128 rows (the 8B rollout's decode batch): SWAPPED_128_ROWS, swap_ws.py's subtrees, one
    # program a tile (64 at o_proj's and down's N: splitk.half_wave_split). Thirty-third session
    # (H100, sweep_rowtree.py --swapped-only --ms 128, bits checked against the table's kernel
    # first): o_proj / down at M = 128 0.978 / 0.863x cuBLAS against 0.682 / 0.801 for the tl
    # kernel's 64x128 tiles that held the bucket; 4 slots of 2 steps 0.879 / 0.799, 6 of 1
    # 0.892 / 0.748; two programs a tile 0.886 / 0.851. The whole tree spills 136 bytes a thread
    # (compiled for sm_90a), two programs a tile none (row_tree splits it into at most two).
    (128, SWAPPED_128_ROWS),
    (256, GemmConfig(block_m=128, block_n=64, group_m=8, num_warps=4, num_stages=8, warp_specialize=True, gluon=True,
                     accumulators=2)),
    # Nineteenth session: above 256 rows the tiles leave by TMA store (4 stages beside the tile
    # buffers and the quads): 0.786 / 0.832x on o_proj / down at M = 1,024 against 0.761 / 0.794x
    # for 5 stages stored from registers (one call, sweep_rowtree.py --gluon-only --tma-only); with
    # two accumulators as well 0.811 / 0.821 (256 bytes spilled): not taken. At 129-256 rows the
    # TMA store (7 stages) read 0.832 / 0.943 against the table's 0.821 / 0.986: not taken.
    # Thirty-seventh session (H100, sweep_rowtree.py --gluon-only --match sib, bits checked against the
    # table's kernel first): sibling chunks step by step (GemmConfig.siblings) took o_proj at M = 512 /
    # 1,024 / 4,096 from 31.2 / 57.7 / 238.9 us to 29.7 / 56.4 / 222.8, down from 83.2 / 176.0 / 648.3
    # to 79.8 / 160.5 / 636.9 (1.02-1.10x); on 5 stages without the TMA store down read 78.5 / 155.2 /
    # 746.5, o_proj less. At 129-256 rows (128 x 64 tiles) the siblings read 0.97-0.99x the two
    # alternating accumulators: not taken there.
    (None, GemmConfig(block_m=128, block_n=128, group_m=8, num_warps=4, num_stages=4, warp_specialize=True,
                      gluon=True, tma_store=True, siblings=True)),
]
ROW_CONFIGS_FP32: list[tuple[int | None, GemmConfig]] = [
    (None, GemmConfig(block_m=64, block_n=32, group_m=8, num_warps=4, num_stages=2, programs_per_sm=2)),
]


def tl_tile(config: GemmConfig) -> GemmConfig:
    """A Gluon config as the tl kernel runs its tile (the backward's operand layouts, Triton's
    interpreter): at most MAX_WARP_SPECIALIZED_STAGES stages and block_n rounded down to a power of
    two (its first product's width), without the Gluon consumer's schedule (one accumulator, stores
    from registers); a swapped one unspecialised, one K step a stage. None of it changes an
    element's sum."""
    if not config.gluon:
        return config
    if config.swap_ab:
        return replace(config, gluon=False, warp_specialize=False, steps_per_stage=1)
    return replace(config, gluon=False, num_stages=min(config.num_stages, MAX_WARP_SPECIALIZED_STAGES),
                   block_n=1 << (config.block_n.bit_length() - 1), accumulators=1, siblings=False, tma_store=False)


def tile_rows(m: int, config: GemmConfig) -> int:
    """Rows of x per tile of an [m, K] product: block_m, or for a swap_ab config (x's rows as the
    MMA's N side) the power of two from 16 (tl.dot's smallest N side) to block_m that holds m."""
    if not config.swap_ab:
        return config.block_m
    return min(config.block_m, max(16, 1 << max(0, m - 1).bit_length()))


def block_k(dtype: torch.dtype) -> int:
    if dtype not in BLOCK_K:
        raise ValueError(f"lockstep GEMM supports {', '.join(map(str, BLOCK_K))}, got {dtype}")
    return BLOCK_K[dtype]


def config_for(m: int, dtype: torch.dtype, n: int = 0) -> GemmConfig:
    """The tile configuration of an [m, K] @ [K, n] product in `dtype`."""
    if dtype == torch.float32:
        return _lookup(CONFIGS_FP32, m)
    for lo, hi, min_n, multiple, config in WIDTH_CONFIGS_16BIT:
        if lo <= m <= hi and n >= min_n and n % multiple == 0:
            return config
    return _lookup(CONFIGS_16BIT, m)


def row_config_for(m: int, dtype: torch.dtype) -> GemmConfig:
    """The tile configuration of the row-parallel GEMM (kernels/_triton/splitk.py)."""
    return _lookup(ROW_CONFIGS_FP32 if dtype == torch.float32 else ROW_CONFIGS_16BIT, m)


def _lookup(table: list[tuple[int | None, GemmConfig]], m: int) -> GemmConfig:
    for largest_m, config in table:
        if largest_m is None or m <= largest_m:
            return config
    raise AssertionError("the last bucket of a config table must have no bound (None)")
