"""Triton attention: one numerics for training (packed or padded), prefill, chunked prefill and
decode, on packed, padded or paged K/V.

Numerics (the bitwise contract):
  A query at position p attends to keys 0..p of its sequence. Key positions are cut into chunks
  of KV_CHUNK and chunks into blocks of KV_BLOCK, both counted from position 0: a page of a paged
  cache only says where a key lives, never how it is grouped. Inside a chunk, blocks fold into an
  online-softmax state that starts empty, in increasing order; chunk states then merge into the
  row's running state in increasing chunk order. Every reduction has a length and an order that
  do not depend on the query tiling: q.k is a tl.dot over D, P@V and the row sum of P are tl.dots
  over KV_BLOCK (the row sum multiplies P by a ones matrix: a tl.sum would reduce in the order of
  the register layout, which follows the tile shape), the row max is exact in any order. A
  block's probabilities are exp2(fma(s, scale, -m)) with m the row's running max of s * scale (the
  block's part: its max of s, times scale), one rounding a key in every kernel. Blocks
  past p inside p's last chunk are exact no-ops (scale by exp2(0) = 1, add exact zeros) and chunks
  past p merge as exact no-ops (their state is empty), so a tile of many queries and a lone
  decode query compute the same bits for a row.
  The chunk level is what lets decode split one row's keys across programs: each program folds
  one chunk, and the last of a row's chunk programs to finish (a ticket counter per sequence and kv
  head) merges the chunk states in the order a prefill tile merges them in registers; or, where every
  chunk of a small batch has its own program, a row's programs are one thread-block cluster whose
  CTAs keep their states in shared memory and each merge a share of the columns in that order.

Rows: a program handles the query heads that share one kv head as rows of its tile, in
(query, head) order, so each K/V block is loaded once per group (GQA packing, decode included).
Rows past the end of a sequence repeat its last query: their loads stay in bounds and they are
never stored. A decode tile (one query, the group's few heads) runs its dots with the operands
swapped, the key block and head dim as the MMA's M side and the heads as its N side (16 wide),
instead of padding the heads to the 64 rows a wgmma needs as M: on sm_90 both are wgmma, whose
elements are the same sums either way (checked on the GPU), at half the registers.

Loads change no value: over a linear K/V (training's packed or padded one; 16-bit, Hopper) the tl
forward and dQ read every block before a tile's last through TMA descriptors, whose keys all lie
inside the tile's range, and the last block by masked loads, as paged K/V read every block; the
Gluon forward reads every block through descriptors made for the tile, which end at its last key
(TMA reads the keys past it as zeros, the masked loads' values).

Warp-specialised forms (Gluon, 16-bit on Hopper, over a linear K/V; TUNING's GLUON): the training
forward and dK/dV run the same tiles, the same wgmma chains and the same tl functions for the
softmax, merge and gradient terms, with the schedule written out: a producer warp issues every
load through TMA into a ring and two consumer warpgroups, each with half of the tile, multiply and
fold. The GPU tests check their bits against the tl kernels'.

Backward (FA2 style, no atomics): dK/dV programs own a key block and walk the query tiles, dQ
programs own a query tile and walk the key blocks, both in increasing order; each masks only the
tiles some row of which must not see some key. The tiles (TUNING) fix the order of the gradient
sums, which depends on no other sequence of the batch.

Inside a torch.compile trace the entry points are torch custom ops (lockstep::causal_attention,
lockstep::varlen_attention, lockstep::paged_attention, and the two backward ops) with fake
implementations and, for the first two, registered autograd; eager calls run the same forward and
backward functions through one autograd.Function (_Eager), without the custom ops' dispatch.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.tools.tensor_descriptor import TensorDescriptor

from lockstep.kernels._triton import _cluster
from lockstep.kernels._triton._alignment import ALIGN_BYTES, is_aligned
from lockstep.kernels._triton._device import INTERPRETING, resident_programs
from lockstep.kernels._triton._tickets import zeroed_tickets
from lockstep.kernels._triton._tma import install_descriptor_allocator
from lockstep.kernels._triton.splitk_ws import gluon_descriptor, invalidate_ring, ring_barriers

# ==== configuration ================================================================================
# Numerics: part of the contract between trainer and rollout. Launchers read these at call time, so
# tests may shrink them to exercise many blocks and chunks on short sequences.
# KV_BLOCK = 128 measured against 64 (the forty-ninth session, H100, CUDA graphs; probe_prefill.py
# --blocks, and the decode table on rings picked to fit, one program an SM, not swept): training's forward
# on 4 x 4,096 tokens 1,755 us (2 ring stages: what fits; 252 bytes spilled) against 1,398, and the
# decode table lower in every cell, 5 of its 12 done-means cells below 0.9 (1 x 16k 0.79, 16 x 1k 0.84):
# 64 stays.
KV_BLOCK = 64  # keys per online-softmax block: the P@V and row-sum dots reduce over exactly this many
# keys per chunk (a multiple of KV_BLOCK): the unit decode splits on. 256: a lone request with 1k
# keys gives 4 programs per kv head (1024 gave one, 0.28x torch's SDPA at batch 1); prefill and
# training merge a chunk state every 4 blocks inside one pipelined loop, which costs them little.
KV_CHUNK = 256

# Tuning: changes no forward bit as long as every forward tile runs the same MMA instructions, whose
# per-element sums then do not depend on the tile's row count. On sm_90 a tile of >= 64 rows runs
# wgmma (m64nNk16) and a 16-row tile runs mma.sync, a different instruction: hence decode rows are
# padded to 64, not to the tl.dot minimum of 16 (tests/test_attention.py compiles both kernels for
# sm_90 and compares their MMA shapes). (On an H200 mma.sync's sums equal wgmma's: probe_limits.py
# mma and sweep_attention.py's MIN_ROWS=16 candidates, the twenty-ninth session; those were slower.)
# Backward tiles set the order of the gradient sums, which is fixed for a given table. Register
# counts below: ptxas for sm_90a, bf16, head_dim 128, group 4.
TUNING = {
    # forward over sequences with more than one query: FA2-style 128-row tiles; K/V loaded one block
    # ahead into registers (PREFETCH; 255 registers, 8 B spilled): 1.16x the pipeliner's 3 stages on a
    # 4k prompt (H200, benchmarks/sweep_attention.py, RESULTS.md)
    # GLUON (16-bit, Hopper): _prefill_ws_kernel as for "prefill_linear" below, each 64-key block as
    # TMA boxes of one page (four at vLLM's 16-key pages), a ring of GLUON_STAGES blocks. With q in
    # registers (GLUON_Q_REGS, below) at 4 stages: 404 us on a 4k prompt against the former table's
    # 433 (3 stages, q in shared memory; 1.071x; 3 stages with q in registers 411 us), bits equal
    # (the twenty-ninth session, H200, CUDA graphs)
    "prefill": dict(BLOCK_Q=128, num_warps=8, num_stages=1, PREFETCH=True, GLUON=True, GLUON_STAGES=4,
                    GLUON_Q_REGS=True),
    # the same over a linear K/V (training's packed or padded one): TMA (on GPUs that have it) brings
    # every block but a tile's last through a descriptor, pipelined by Triton over num_stages (242
    # registers, no spill). sweep_attention.py, H200, 4 x 4,096 packed tokens, two calls: 2.09-2.18 ms
    # against 2.39-2.43 ms for the registers-ahead schedule (1.14x); 2 / 4 stages 2.52-2.59 / 2.26-2.44;
    # 64-row tiles at 4 warps (two programs an SM) 2.59-3.11
    # GLUON (16-bit, Hopper): the same tiles and folds as the warp-specialised _prefill_ws_kernel (a
    # producer warp, two consumer warpgroups of 64 rows, a ring of GLUON_STAGES blocks, each consumer's
    # next q.k beside its P@V). The same sweep, two calls: 1.60 / 1.85 ms at 3 stages, against 2.07 /
    # 2.36 for the tl kernel's 3 stages; 2 / 4 stages 1.92 / 1.87 (first call). Without the overlap
    # inside a consumer 1.66 / 1.68, and bench_attention.py's training table, the two alternating on one
    # H200 (A/B/A/B): 4 x 4,096 fwd+bwd 6.73 / 6.69 ms with it, 7.04 / 7.09 without (1 x 4,096 2.93 /
    # 2.73 and 2.82 / 3.03): the sweeps alone do not separate the two, the A/B does. The consumers
    # taking turns to issue their MMAs (FA3's ping-pong): 1.65, not kept. Timed by CUDA graphs (the
    # fifteenth session's sweeps, two calls, bits checked): 4 stages 1,410 / 1,409 us, 3 stages 1,474 /
    # 1,467; with every block masked (before _ws_softmax skipped the mask of blocks a consumer's rows
    # see whole) 1,506 / 1,486 and 1,493 / 1,480
    # GLUON_Q_REGS (both entries): each consumer holds its 64 rows of q in registers (32 a thread) as
    # the q.k wgmma's A operand, so that the wgmma reads only K from shared memory. A model, not a
    # measurement: at 64-key blocks a q.k step (m64n64k16, both operands in shared memory) reads 4 KB
    # for 32 cycles of the SM's bf16 wgmma rate, what 128 B a cycle of shared memory delivers in that
    # time; a block of both consumers reads and writes ~132 KB (q.k, P@V's V, the ones, TMA's copies)
    # against ~1,090 cycles of wgmma, ~100 KB with q in registers. ptxas (sm_90a): RS wgmmas, 16-24
    # bytes spilled, all outside the block loop. Measured (the twenty-ninth session, H200, CUDA
    # graphs, bits equal): training's forward on 4 x 4,096 packed tokens 1,367 us against 1,393 with q
    # in shared memory at 4 stages (1.019x; 3 stages 1,411), the paged prefill above 1.071x.
    # benchmarks/probe_prefill.py (the same session, q in shared memory): without its softmax the
    # forward takes 0.85x the time, without the rescale 0.93x, the row-sum dots 0.96x, the chunk
    # merges 0.96x, and with none of them ("MMAs only") 0.73x: 538 TFLOP/s against the whole's 395
    # and torch's fastest SDPA forward's 533. Tried, not kept (the thirty-first session, H100, bits
    # equal): the worker consumer's chunk-state rescale pinned after its q.k issue (LLVM hoists it
    # above the K wait) and the block's row max as a tree (6 dependent maxima, not 17): 0.98-1.01x
    # either entry, each alone and both, the table itself 0.995-0.998x of itself in the same sweep
    "prefill_linear": dict(BLOCK_Q=128, num_warps=8, num_stages=3, PREFETCH=False, TMA=True, GLUON=True,
                           GLUON_STAGES=4, GLUON_Q_REGS=True),
    # single-query sequences: P programs per (sequence, kv head) walk its chunks; rows are the
    # group's query heads; the last of them to finish merges the chunk states, or with P = 1 the one
    # program merges in registers. SWAP: the dots run with their operands swapped, the heads as the
    # MMA's N side padded to 16 (where head_dim and KV_BLOCK keep every dot on wgmma); else the heads
    # are the M side, padded to MIN_ROWS (232 registers at P = 1: two programs per SM, each block's
    # q.k -> softmax -> P@V chain latency-bound). PROGRAMS_PER_SM: the programs an SM holds at once
    # (swapped, split: 71.7 KB of shared memory each at 2 or 3 stages, so 3 on an H200); at small
    # batch a sequence's chunks split across as many programs as make one wave of them, never more
    # (a second, part-full wave of a program's whole walk costs more than the split saves).
    # Within a program a block's K/V loads are issued after the previous block's P@V (Triton's
    # pipeliner, one block ahead behind the page-table load), so the programs an SM holds are what
    # overlaps loads with compute. The seventeenth session (H200, CUDA graphs, A/B against the
    # sixteenth's table in one call): 2 stages and one wave of 3 an SM took batch 16 x 16k keys
    # from 342 to 304 us and 16 x 4k from 99 to 89 us; 3 stages and 4 an SM (rounded up: 1.3-1.6
    # waves) as before.
    # WALK_STAGES: the one-program walk (P = 1) takes this deeper ring where its programs, WALK_PER_SM
    # an SM (105 KB of shared memory each against 71.7 KB at 2-4 stages: ptxas, sm_90a), need no more
    # waves than PROGRAMS_PER_SM an SM would: batches of 25-33 and 50-66 requests at Qwen3-8B's 8 kv
    # heads on an H200. There the table's last wave was part full (512 programs: 1.29 waves of 396)
    # and the deeper one's are whole (1.94 of 264). The twenty-third session (H200, CUDA graphs, bits
    # equal): batch 64 at 1k / 4k / 16k / 32k keys 1.15 / 1.24 / 1.21 / 1.12x the table, batch 32 at
    # 1k / 4k 1.07 / 1.13x; where it would take more waves it lost (batch 48 0.75x, 96 0.94x, 128 at
    # 600 keys 0.91x), and at batch 256 it was even (0.97-0.99x)
    # SPLIT_TAIL: where the walks take more than one wave and do not take the deeper ring, the pairs
    # of the last, part-full wave split across as many programs as fill it (_decode_grid), in the
    # same launch. The twenty-fourth session (H200, CUDA graphs, bits equal; the walks alone against
    # it): batch 256 at 1k / 4k / 16k keys 0.954 / 0.957 / 0.956x (68 pairs split 4 / 5 / 5 ways),
    # batch 72 / 100 / 200 at 4k 0.914 / 0.815 / 0.922x; at batch 64 (the deeper ring's batch) the
    # split tail on the table's ring was even with the deeper walks (1k 0.97x, 4k 1.00x, 32k 1.01x)
    # SPLIT_STAGES: a grid of splits alone (no walk) takes this deeper ring, SPLIT_PER_SM programs an SM
    # (104 KB each at 3 stages), where its pairs still split at least 2 ways under it: batches of 1-11 at
    # Qwen3-8B's 8 kv heads on an H200 (12-16 walk: WALK_FILL below; a chunk's page entries are loaded
    # before its blocks, _chunk_pages, so the deeper ring takes each block's K/V loads a block further
    # ahead). The twenty-fifth session (H200, CUDA graphs, bits equal, against the table's 2 stages and 3
    # an SM): batch 1 at 1k / 4k / 16k keys 1.06 / 1.10 / 1.00x, batch 16 1.10 / 1.05 / 1.02x; 4 stages
    # (one program an SM) read 1.04 / 1.13 / 0.88x and 1.18 / 1.01 / 0.95x
    # FLAT_STAGES: on that ring a program of several chunks folds them in one loop over their blocks
    # on a ring this deep (a block's page entries loaded in the loop), instead of a loop a chunk,
    # whose pipeline restarts at every chunk; 0: a loop a chunk (as a program of one chunk always
    # runs: its page entries in one load, 1.17 / 1.10x the one loop at 1 x 1k / 4k). The twenty-sixth
    # session (H200, CUDA graphs, bits equal, A/B against a loop a chunk): batch 1 x 16k 1.08x, 4 / 8
    # x 4k 1.05 / 1.07x, 16 x 1k / 4k / 16k 1.05 / 1.03 / 1.01x; 4 stages (the page load takes one:
    # a ring of 2 K/V blocks) 0.94-1.00x, 6 as 5 (111 KB a program either way: 2 an SM)
    # WALK_FILL: where one walk a pair, at most WALK_PER_SM an SM, fills at least this share of its
    # waves of one walk an SM (waves * SMs; batches of 12-16 and 24-33 at 8 kv heads on 132 SMs), the
    # walks on the WALK_STAGES ring instead of splits (0: never): no chunk state goes through memory,
    # and no program waits on a ticket or a merge. The thirty-sixth session (H100, ab_decode.py, CUDA
    # graphs, bits equal, against the split grids): batch 16 at 1k / 2k / 4k / 8k / 16k / 32k keys
    # 0.903 / 0.913 / 0.917-0.929 / 0.925 / 0.937 / 0.938x the time, 13 x 1k / 4k 0.904 / 0.942, 15 x
    # 1k / 16k 0.893 / 0.941, 24 x 1k / 4k / 16k / 32k 0.969-0.979 / 0.960-0.961 / 0.949-0.953 / 0.951,
    # 12 x 1k / 4k / 16k 0.955 / 0.983-0.991 / 1.019 (both 72.7% full); where the walks fill less it
    # lost or tied: batch 10 at 1k / 4k 1.036 / 1.115x (61%), 6-8 1.4-2.0x, 17-18 1.02-1.05x (52-55%),
    # 20 0.996-1.007 (61%), 22-23 0.976-1.001 (67-70%)
    # Measured, not kept (H100, ab_decode.py, bits equal): a one-chunk split program asking L2 for its
    # whole chunk before its ring's loads (the forty-fourth session: 1.06-1.25x the time at batch 1-8 x
    # 1k-4k), and idle SMs' helper programs asking L2 for a chunk's last blocks (the forty-sixth:
    # 1.002-1.012x at batch 1-2 x 512-1k). Nor (the forty-eighth, b44ec1a, other / this, the ticketed
    # split the other): where a pair's chunks take several rounds of its programs, the last part full,
    # its last program (idle a round early) merging the earlier rounds' states while the others fold
    # their last chunks, once each program's warps had counted their early states (a release a warp,
    # MEMBAR.GPU, inside _split_states' pipelined loop: a CTA barrier there leaves that loop
    # unpipelined), the last merge going on from its running state: batch 1 x 16k / 10k 1.015-1.023 /
    # 1.023x (the table 0.873x cuDNN), 1 x 32k 0.939x, and where no pair merged early that kernel's
    # code cost 2 x 16k / 4 x 8k 0.977 / 0.985x. The early states wait for the round's slowest program
    # (probe_decode.py: block periods 2.5 us median, 9.5 max, at 1 x 16k)
    # CLUSTER_MAX: a grid of splits alone whose programs each fold one chunk (ONE_CHUNK) runs each pair's
    # programs as one thread-block cluster (sm_90+, _cluster.py) of the power of two of CTAs that holds
    # its chunks, if that is at most CLUSTER_MAX (0: never): each CTA keeps its chunk's state in its
    # shared memory, the cluster meets at its barrier and each CTA merges a share of the columns from
    # every CTA's state, where the ticketed split stores the states to memory, fences them, takes a
    # ticket and loads them back (the ticket alone ~1.5 us of batch 1 x 1k's 8.4 us: the forty-sixth
    # session), and where its CTAs (pairs x cluster) are at most CLUSTER_FILL of the SMs; else, and where
    # the grid's clusters cannot all be resident at once (occupancy), the ticketed split runs. The
    # forty-seventh session (H100, ab_decode.py, CUDA graphs, bits equal, against the ticketed split):
    # batch 1 at 512 / 700 / 1k / 2k keys (16-64 CTAs) 1.056 / 1.083 / 1.071-1.078 / 1.048x, 2 x 1k
    # 1.067x, 3 x 1k / 5 x 512 / 6 x 512 (96 / 80 / 96 CTAs) 1.057 / 1.022 / 1.035x; at 128 CTAs slower
    # (4 x 1k 0.837 / 0.824x, 2 x 2k 0.820x), 3 x 2k (192) 0.990-1.000x; CTAs given an SM each (more than
    # half its shared memory) 0.996-1.013x at batch 1-2. Multi-chunk CTAs in clusters (8 or 16 a pair,
    # so fewer programs than the split's) lost: 1 x 4k 0.62 / 0.83x, 1 x 16k 0.73 / 0.89x (8 / 16 a
    # cluster)
    "decode": dict(SWAP=True, MIN_ROWS=64, PROGRAMS_PER_SM=3, num_warps=4, num_stages=2, PREFETCH=False,
                   WALK_STAGES=5, WALK_PER_SM=2, SPLIT_TAIL=True, SPLIT_STAGES=3, SPLIT_PER_SM=2, FLAT_STAGES=5,
                   WALK_FILL=0.72, CLUSTER_MAX=8, CLUSTER_FILL=0.75),
    # one program per (sequence, kv head, BLOCK_KV keys), looping over BLOCK_Q-row query tiles.
    # sweep_attention.py, H200, 4 x 4,096 packed tokens, the whole backward: 128 keys x 64 rows at 8
    # warps 1.29x faster than the former 64 x 64 (8.30 -> 6.44 ms, old dQ tiles); with the dQ row
    # below, 4.99-5.20 ms against 5.34-5.49 at 64 x 32 (4 warps) and 7.2 at 64 x 64. Query tiles of
    # one head through TMA (head-major sums) measured 5.12-5.77 ms: not kept
    # GLUON (16-bit, Hopper, BLOCK_Q 64): the same sums as the warp-specialised _bwd_dkdv_ws_kernel (128
    # keys, two consumer warpgroups of 64, a producer warp bringing the query tiles through TMA into a
    # ring of GLUON_STAGES): whole backward 4.30-4.40 ms at 2 stages, 4.48-4.60 at 3, against 4.60-4.61
    # for the tl kernel (two calls); 1.64 vs 1.67 ms at 1 x 4,096. dP's MMA issued beside P's
    # exponentials read 4.71: not kept; dV's product and dP's issued together (the fifteenth session,
    # whole backward by CUDA graphs, one call): 3,648 / 3,638 us at 2 / 3 stages against 3,716 /
    # 3,658, within the call's spread: not kept
    "bwd_dkdv": dict(BLOCK_Q=64, BLOCK_KV=128, num_warps=8, num_stages=3, GLUON=True, GLUON_STAGES=2),
    # one program per (sequence, kv head, BLOCK_Q rows), looping over BLOCK_KV-key blocks; TMA: over
    # a linear K/V (training's is), the blocks before the tile's last through descriptors (170
    # registers). The same sweep: 5.05 ms with TMA against 5.69 without, 5.86 at the former 128 x 64
    # GLUON (16-bit, Hopper, BLOCK_Q 64, a linear K/V): the same sums as the warp-specialised
    # _bwd_dq_ws_kernel (two consumer warpgroups of 64 rows sharing each K/V block, a producer warp
    # bringing the blocks through TMA into a ring of GLUON_STAGES). The whole backward, CUDA graphs,
    # 4 x 4,096 (sweep_attention.py, two calls): 3,745 / 3,690 us at 64-key blocks and 4 stages
    # (3 stages 3,768 / 3,686), against 3,957 / 3,834 at 32 keys and 4,108 for the tl kernel's
    # 64 x 32 at 4 stages; the tl kernel at 64 x 64 took 4,244
    # GLUON_Q_REGS: each consumer holds its q and dO rows in registers (64 a thread; ptxas: no spill), the A
    # operands of its q.k and dO.v wgmmas, which then read only K and V from shared memory: by the
    # model above, ~128 KB a block of both consumers (with TMA's copies) instead of ~192 KB, against
    # ~1,540 cycles of wgmma. Measured (the twenty-ninth session, H200, CUDA graphs): the whole
    # backward on 4 x 4,096 packed tokens 3,619 us against 3,670 (1.014x; 3 stages 3,652), gradients
    # within the sweep's tolerance and deterministic; the GPU tests check its bits against the tl
    # kernel's
    "bwd_dq": dict(BLOCK_Q=64, BLOCK_KV=64, num_warps=4, num_stages=4, TMA=True, GLUON=True, GLUON_STAGES=4,
                   GLUON_Q_REGS=True),
    # rows per program of the backward's delta (row sums of out * grad): a streaming read
    "bwd_delta": dict(BLOCK_R=32, num_warps=4),
}
# ===================================================================================================

_LINEAR_PAGE = 1 << 30  # page size that makes a packed or padded K/V one page per sequence
_SUM_COLS = tl.constexpr(16)  # width of the ones matrix that computes row sums (the tl.dot minimum)
# sm_90 multiplies a tile with wgmma when its M side is at least this (one warpgroup's 64 rows), with
# mma.sync below it: a different instruction (tests/test_attention.py compares what each kernel runs)
_WGMMA_M = 64
_SUM_ROWS = tl.constexpr(_WGMMA_M)  # swapped tiles: height of the ones matrix (the row-sum dot's M side)
_MERGE_AHEAD = tl.constexpr(8)  # chunk states a ticketed split's merge loads before merging the first
_LOG2E = 1.4426950408889634


# ---- building blocks (inlined into every kernel, so every path runs the same instructions) --------

@triton.jit
def _rows(rows, q_begin, n_queries, kv_head, GROUP: tl.constexpr):
    """Token and head of each tile row: row i is query i // GROUP, head kv_head * GROUP + i % GROUP.
    Rows past the sequence repeat its last query (in-bounds loads; never stored)."""
    tok = q_begin + tl.minimum(rows // GROUP, n_queries - 1)
    return tok.to(tl.int64), kv_head * GROUP + rows % GROUP


@triton.jit
def _sequence(q_begin, q_count, seq, FROM_LENS: tl.constexpr):
    """(first query row, query count) of sequence seq; FROM_LENS: both from query_start_loc."""
    begin = tl.load(q_begin + seq)
    if FROM_LENS:
        return begin, tl.load(q_begin + seq + 1) - begin
    return begin, tl.load(q_count + seq)


@triton.jit
def _ranked_program(pid, n_kv_heads, n_seqs):
    """(rank, kv head, sequence) of program pid of a rank-major 1-D grid: every (kv head, sequence)'s
    rank-0 program, then every rank-1 one, and so on. A kernel gives rank 0 its longest work (the
    latest query tile, the first key block) and the scheduler starts programs in id order, so the
    longest programs of every head and sequence start first and the last wave holds the shortest
    (longest-processing-time first; with the rank as the fastest grid axis, a head's long programs
    started only after every program of the heads before it). Which program computes a tile moves
    no bit."""
    per_rank = n_kv_heads * n_seqs
    rank = pid // per_rank
    rest = pid - rank * per_rank
    return rank, rest % n_kv_heads, rest // n_kv_heads


@triton.jit
def _query_pos(q_pos, tok, rows, seq, n_queries, GROUP: tl.constexpr, FROM_LENS: tl.constexpr):
    """Absolute positions of the tile rows `rows` (query rows `tok`, as _rows gives them); FROM_LENS
    (q_pos: keys per sequence): a sequence's queries are its last n_queries positions."""
    if FROM_LENS:
        return tl.load(q_pos + seq) - n_queries + tl.minimum(rows // GROUP, n_queries - 1)
    return tl.load(q_pos + tok)


@triton.jit
def _kv_offsets(page_row, pos, page_size, stride_page, stride_slot, mask, PAGE_SHIFT: tl.constexpr = -1, pages=None,
                start=0):
    """Element offsets (head 0) of the keys at positions `pos`: their page, from the sequence's row
    of the page table, then their slot in it. PAGE_SHIFT >= 0: page_size is 1 << PAGE_SHIFT, and a
    shift and a mask find the page and slot (an integer division by a runtime page_size is ~10
    instructions a key: a quarter of decode's loop; decode_page_shift). pages: the entries of the
    chunk of keys from `start` (_chunk_pages), picked from registers instead of loaded."""
    if PAGE_SHIFT >= 0:
        page_of, slot = pos >> PAGE_SHIFT, pos & ((1 << PAGE_SHIFT) - 1)
    else:
        page_of, slot = pos // page_size, pos % page_size
    if pages is None:
        page = tl.load(page_row + page_of, mask=mask, other=0)
    else:
        page = tl.gather(pages, (pos - start) >> PAGE_SHIFT, 0)
    return page.to(tl.int64) * stride_page + slot.to(tl.int64) * stride_slot


@triton.jit
def _load_kv(k, v, offsets, mask, D: tl.constexpr):
    cols = tl.arange(0, D)[None, :]
    kb = tl.load(k + offsets[:, None] + cols, mask=mask[:, None], other=0.0)
    vb = tl.load(v + offsets[:, None] + cols, mask=mask[:, None], other=0.0)
    return kb, vb


@triton.jit
def _col(x, SWAP: tl.constexpr):
    """A per-row vector against a state tile: [ROWS, 1] (rows down dim 0), or with SWAP [1, ROWS]."""
    if SWAP:
        out = x[None, :]
    else:
        out = x[:, None]
    return out


@triton.jit
def _row_max(x, SWAP: tl.constexpr):
    """Each row's maximum over a state tile (rows along dim 0, or with SWAP dim 1): exact in any order."""
    if SWAP:
        out = tl.max(x, 0)
    else:
        out = tl.max(x, 1)
    return out


@triton.jit
def _tile_sums(l, SWAP: tl.constexpr):
    """A chunk's row sums from the tile their ones-dot accumulates (_empty_state's l): every column
    (SWAP: row) holds the same value, so the max reads it exactly."""
    return _row_max(l, SWAP)


@triton.jit
def _tile_offsets(idx, D: tl.constexpr, SWAP: tl.constexpr, cols=None):
    """Element offsets of rows idx of a [rows, D] tensor as a [ROWS, D] tile, or with SWAP [D, ROWS]
    (cols: of those columns only, [ROWS, len(cols)])."""
    if cols is None:
        cols = tl.arange(0, D)
    if SWAP:
        out = idx[None, :] * D + cols[:, None]
    else:
        out = idx[:, None] * D + cols[None, :]
    return out


@triton.jit
def _empty_state(ROWS: tl.constexpr, D: tl.constexpr, SWAP: tl.constexpr):
    """An empty chunk state: m = -inf; l (row sums) as the tile their dot accumulates into, every
    column equal ([ROWS, _SUM_COLS]), or with SWAP every row equal ([_SUM_ROWS, ROWS]); acc = 0."""
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    if SWAP:
        l, acc = tl.zeros((_SUM_ROWS, ROWS), tl.float32), tl.zeros((D, ROWS), tl.float32)
    else:
        l, acc = tl.zeros((ROWS, _SUM_COLS), tl.float32), tl.zeros((ROWS, D), tl.float32)
    return m, l, acc


@triton.jit
def _block_softmax(s, key_pos, pos, m, qk_scale, SWAP: tl.constexpr):
    """A key block's q.k products s -> (the rows' new max, the factor alpha that rescales their
    state, the unnormalised probabilities p in fp32): keys past a row's position are -inf. Written
    in tl and called from the Gluon forward too (_ws_consumer): every kernel runs this expression."""
    if SWAP:
        seen = key_pos[:, None] <= pos[None, :]
    else:
        seen = key_pos[None, :] <= pos[:, None]
    return _scaled_softmax(tl.where(seen, s, float("-inf")), m, qk_scale, SWAP)


@triton.jit
def _scaled_softmax(s, m, qk_scale, SWAP: tl.constexpr):
    """_block_softmax from the block's masked products s (keys a row must not see: -inf) and the
    softmax scale in log2 units: the new max is the row max of s times qk_scale (rounding is
    monotonic, so that is the max of the rounded scaled products: a multiply a row, not a key), and
    p = exp2(fma(s, qk_scale, -max)), one rounding and one instruction a key (FA3's form; a masked
    key's fma is -inf, its p 0)."""
    m_new = tl.maximum(m, _row_max(s, SWAP) * qk_scale)
    # A row that has seen no key of this chunk yet has m_new = -inf; measuring from 0 keeps its
    # state exactly empty (l = 0, acc = 0) instead of NaN (exp2(-inf - -inf)).
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = _col(tl.math.exp2(m - m_ref), SWAP)
    return m_new, alpha, tl.math.exp2(tl.math.fma(s, qk_scale, -_col(m_ref, SWAP)))


@triton.jit
def _fold_block(q, kb, vb, key_pos, pos, m, l, acc, qk_scale, KV_BLOCK: tl.constexpr, SWAP: tl.constexpr):
    """Fold one key block into the state (m: row max in log2 units; l: row sums, as a tile of
    equal columns; acc: unnormalised output).
    SWAP (decode tiles): the same dots with their operands swapped, S^T = K Q^T, l^T = 1 P^T and
    O^T = V^T P^T (q holds Q^T; every state tile is transposed): the key block, the ones and the
    head dim are the MMA's M side and a decode tile's few query rows its N side, instead of rows
    padded to the M side's 64. An element is the same sum of the same products over the same k
    steps either way (the GPU premise, checked by tests/test_attention.py::
    test_gpu_decode_tiles_give_the_training_bits)."""
    if SWAP:
        s = tl.dot(kb, q, input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(kb), input_precision="ieee")
    m_new, alpha, p = _block_softmax(s, key_pos, pos, m, qk_scale, SWAP)
    p = p.to(vb.dtype)
    if SWAP:
        ones = tl.full((_SUM_ROWS, KV_BLOCK), 1.0, tl.float32).to(vb.dtype)
        l = tl.dot(ones, p, l * alpha, input_precision="ieee")
        acc = tl.dot(tl.trans(vb), p, acc * alpha, input_precision="ieee")
    else:
        ones = tl.full((KV_BLOCK, _SUM_COLS), 1.0, tl.float32).to(vb.dtype)
        l = tl.dot(p, ones, l * alpha, input_precision="ieee")
        acc = tl.dot(p, vb, acc * alpha, input_precision="ieee")
    return m_new, l, acc


@triton.jit
def _block_kv(k, v, page_row, blk, hi, page_size, stride_page, stride_slot, KV_BLOCK: tl.constexpr, D: tl.constexpr,
              PAGE_SHIFT: tl.constexpr = -1, pages=None, start=0):
    """K/V block `blk` of a sequence (keys past `hi` masked: not loaded) and its key positions
    (pages, start: _kv_offsets')."""
    key_pos = blk * KV_BLOCK + tl.arange(0, KV_BLOCK)
    seen = key_pos <= hi
    kb, vb = _load_kv(k, v, _kv_offsets(page_row, key_pos, page_size, stride_page, stride_slot, seen, PAGE_SHIFT,
                                        pages, start), seen, D)
    return kb, vb, key_pos


@triton.jit
def _chunk_pages(page_row, start, last_key, KV_CHUNK: tl.constexpr, PAGE_SHIFT: tl.constexpr):
    """The page-table entries of the chunk of keys from `start` (a multiple of KV_CHUNK), loaded once
    before its blocks: with PAGE_SHIFT >= 0 (pages of 2^PAGE_SHIFT keys, so that a chunk spans
    max(1, KV_CHUNK >> PAGE_SHIFT) whole pages, or lies inside one) their vector, the entries past
    the page of key `last_key` (the sequence's last key, or the table's: the keys past the
    sequence's last are never loaded, so what their entries hold moves nothing) read as 0; else None
    (_kv_offsets then reads the table a block at a time). Read in the loop instead, a block's
    entries were a load that its K/V addresses waited on, which Triton's pipeliner issued after the
    block before's dots: two memory round trips a block."""
    if PAGE_SHIFT >= 0:
        NP: tl.constexpr = max(1, KV_CHUNK >> PAGE_SHIFT)
        j = tl.arange(0, NP) + (start >> PAGE_SHIFT)
        pages = tl.load(page_row + j, mask=j <= (last_key >> PAGE_SHIFT), other=0)
    else:
        pages = None
    return pages


@triton.jit
def _chunk_state(q, pos, hi, chunk, k, v, page_row, page_size, stride_page, stride_slot, qk_scale,
                 ROWS: tl.constexpr, D: tl.constexpr, KV_BLOCK: tl.constexpr, KV_CHUNK: tl.constexpr,
                 SWAP: tl.constexpr, PAGE_SHIFT: tl.constexpr, pages=None):
    """State of rows `q` (positions `pos`, largest `hi`) over one chunk of keys: from empty, blocks in
    increasing order. Keys past `hi` are neither visited nor loaded. pages: the chunk's page entries
    (_chunk_pages) where the caller loaded them ahead."""
    m, l, acc = _empty_state(ROWS, D, SWAP)
    start = chunk * KV_CHUNK
    if pages is None:
        pages = _chunk_pages(page_row, start, hi, KV_CHUNK, PAGE_SHIFT)
    for lo in range(start, tl.minimum(start + KV_CHUNK, hi + 1), KV_BLOCK):
        kb, vb, key_pos = _block_kv(k, v, page_row, lo // KV_BLOCK, hi, page_size, stride_page, stride_slot,
                                    KV_BLOCK, D, PAGE_SHIFT, pages, start)
        m, l, acc = _fold_block(q, kb, vb, key_pos, pos, m, l, acc, qk_scale, KV_BLOCK, SWAP)
    return m, _tile_sums(l, SWAP), acc


@triton.jit
def _merge(m, l, acc, m_c, l_c, acc_c, SWAP: tl.constexpr):
    """Merge a chunk state into the running state. The running state is empty only before chunk 0,
    which every row sees, so the two maxima are never both -inf."""
    m_new = tl.maximum(m, m_c)
    a = tl.math.exp2(m - m_new)
    b = tl.math.exp2(m_c - m_new)
    return m_new, l * a + l_c * b, acc * _col(a, SWAP) + acc_c * _col(b, SWAP)


@triton.jit
def _row_state(q, pos, hi, k, v, page_row, page_size, stride_page, stride_slot, qk_scale, k_desc, v_desc,
               desc_row, desc_col, ROWS: tl.constexpr, D: tl.constexpr, KV_BLOCK: tl.constexpr,
               KV_CHUNK: tl.constexpr, PREFETCH: tl.constexpr, SWAP: tl.constexpr, TMA: tl.constexpr,
               PAGE_SHIFT: tl.constexpr = -1):
    """State of rows `q` (positions `pos`, largest `hi`) over all their keys, merged chunk by chunk:
    _chunk_state's folds and _merge's chunk merges in one software-pipelined loop over the blocks (a
    loop per chunk would restart the pipeline at every chunk). The chunk state folds blocks in
    increasing order from empty and merges into the running state at the chunk's last block (or
    the last block that holds keys), in chunk order: the same operations in the same order.
    PREFETCH (speed only): load each block's K/V one block ahead into registers, instead of leaving
    the load schedule to Triton's pipeliner.
    TMA (speed only; a linear K/V, whose key at position p is row desc_row + p of the descriptors,
    its head at column desc_col): every block before the last, whose keys all lie at or before
    `hi`, comes whole through a TMA descriptor (the pipeliner's asynchronous copies into shared
    memory, where the MMA reads it); the last block as without TMA, its keys past `hi` masked to
    zeros. Every block's K/V hold the same values either way."""
    m, _, acc = _empty_state(ROWS, D, SWAP)
    l = tl.zeros((ROWS,), tl.float32)  # the running state's row sums: a vector (a chunk's are its dot's tile)
    m_c, l_c, acc_c = _empty_state(ROWS, D, SWAP)
    last = hi // KV_BLOCK
    if TMA:
        for blk in range(0, last):
            kb = k_desc.load([desc_row + blk * KV_BLOCK, desc_col])
            vb = v_desc.load([desc_row + blk * KV_BLOCK, desc_col])
            key_pos = blk * KV_BLOCK + tl.arange(0, KV_BLOCK)
            m_c, l_c, acc_c = _fold_block(q, kb, vb, key_pos, pos, m_c, l_c, acc_c, qk_scale, KV_BLOCK, SWAP)
            if (blk + 1) % (KV_CHUNK // KV_BLOCK) == 0:
                m, l, acc = _merge(m, l, acc, m_c, _tile_sums(l_c, SWAP), acc_c, SWAP)
                m_c, l_c, acc_c = _empty_state(ROWS, D, SWAP)
        kb, vb, key_pos = _block_kv(k, v, page_row, last, hi, page_size, stride_page, stride_slot, KV_BLOCK, D,
                                    PAGE_SHIFT)
        m_c, l_c, acc_c = _fold_block(q, kb, vb, key_pos, pos, m_c, l_c, acc_c, qk_scale, KV_BLOCK, SWAP)
        return _merge(m, l, acc, m_c, _tile_sums(l_c, SWAP), acc_c, SWAP)
    if PREFETCH:
        kb_n, vb_n, key_n = _block_kv(k, v, page_row, 0, hi, page_size, stride_page, stride_slot, KV_BLOCK, D,
                                      PAGE_SHIFT)
    for blk in range(0, last + 1):
        if PREFETCH:  # this block's K/V were loaded into registers during the last block; the next's now
            kb, vb, key_pos = kb_n, vb_n, key_n
            kb_n, vb_n, key_n = _block_kv(k, v, page_row, blk + 1, hi, page_size, stride_page, stride_slot,
                                          KV_BLOCK, D, PAGE_SHIFT)
        else:  # Triton's pipeliner schedules the loads (num_stages)
            kb, vb, key_pos = _block_kv(k, v, page_row, blk, hi, page_size, stride_page, stride_slot, KV_BLOCK, D,
                                        PAGE_SHIFT)
        m_c, l_c, acc_c = _fold_block(q, kb, vb, key_pos, pos, m_c, l_c, acc_c, qk_scale, KV_BLOCK, SWAP)
        if ((blk + 1) % (KV_CHUNK // KV_BLOCK) == 0) | (blk == last):
            m, l, acc = _merge(m, l, acc, m_c, _tile_sums(l_c, SWAP), acc_c, SWAP)
            m_c, l_c, acc_c = _empty_state(ROWS, D, SWAP)
    return m, l, acc


@triton.jit
def _store_rows(out, lse, idx, keep, m, l, acc, D: tl.constexpr, SWAP: tl.constexpr, cols=None):
    """Normalise and store rows (cols: acc holds those columns only); lse (log2 units) is what the
    backward recomputes P from."""
    tl.store(out + _tile_offsets(idx, D, SWAP, cols), _normalised(acc, l, SWAP).to(out.dtype.element_ty),
             mask=_col(keep, SWAP))
    tl.store(lse + idx, _lse(m, l), mask=keep)


@triton.jit
def _normalised(acc, l, SWAP: tl.constexpr):
    """A row state's output, in fp32 (also the Gluon forward's, _ws_consumer)."""
    return acc / _col(l, SWAP)


@triton.jit
def _lse(m, l):
    """A row state's log-sum-exp in log2 units: what the backward recomputes P from."""
    return m + tl.math.log2(l)


# ---- forward kernels -----------------------------------------------------------------------------

@triton.jit
def _prefill_kernel(q, k, v, out, lse, q_begin, q_count, q_pos, page_table, stride_table, page_size,
                    stride_page, stride_head, stride_slot, n_heads, qk_scale, min_queries, n_seqs, k_desc, v_desc,
                    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr,
                    KV_BLOCK: tl.constexpr, KV_CHUNK: tl.constexpr, PREFETCH: tl.constexpr,
                    FROM_LENS: tl.constexpr, TMA: tl.constexpr):
    """Query tiles of BLOCK_Q rows of sequences with at least min_queries queries. TMA: K/V are
    linear (a page per sequence, page p at row p * stride_page // stride_slot of k_desc/v_desc)."""
    rank, kv_head, seq = _ranked_program(tl.program_id(0), n_heads // GROUP, n_seqs)
    begin, n_queries = _sequence(q_begin, q_count, seq, FROM_LENS)
    tile = tl.cdiv(n_queries * GROUP, BLOCK_Q) - 1 - rank  # rank 0: the sequence's latest queries
    if (tile < 0) | (n_queries < min_queries):
        return
    rows = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    tok, head = _rows(rows, begin, n_queries, kv_head, GROUP)
    idx = tok * n_heads + head
    q_tile = tl.load(q + idx[:, None] * D + tl.arange(0, D)[None, :])
    pos = _query_pos(q_pos, tok, rows, seq, n_queries, GROUP, FROM_LENS)
    hi = tl.max(pos, 0)
    page_row = page_table + seq * stride_table
    desc_row = 0
    if TMA:
        desc_row = tl.load(page_row) * (stride_page // stride_slot)
    k, v = k + kv_head * stride_head, v + kv_head * stride_head
    m, l, acc = _row_state(q_tile, pos, hi, k, v, page_row, page_size, stride_page, stride_slot, qk_scale,
                           k_desc, v_desc, desc_row, kv_head * D, BLOCK_Q, D, KV_BLOCK, KV_CHUNK, PREFETCH,
                           False, TMA)
    _store_rows(out, lse, idx, rows < n_queries * GROUP, m, l, acc, D, False)


@triton.jit
def _walk(q_tile, pos, hi, k, v, page_row, page_size, stride_page, stride_slot, qk_scale, out, lse, idx, keep,
          ROWS: tl.constexpr, D: tl.constexpr, KV_BLOCK: tl.constexpr, KV_CHUNK: tl.constexpr,
          PREFETCH: tl.constexpr, SWAP: tl.constexpr, PAGE_SHIFT: tl.constexpr):
    """A decode program's whole walk of its (sequence, kv head): _row_state, then the rows stored."""
    m, l, acc = _row_state(q_tile, pos, hi, k, v, page_row, page_size, stride_page, stride_slot, qk_scale,
                           None, None, 0, 0, ROWS, D, KV_BLOCK, KV_CHUNK, PREFETCH, SWAP, False, PAGE_SHIFT)
    _store_rows(out, lse, idx, keep, m, l, acc, D, SWAP)


@triton.jit
def _store_chunk_state(part_m, part_l, part_acc, slot, keep, m, l, acc, D: tl.constexpr, SWAP: tl.constexpr):
    """A split decode program's chunk state (_chunk_state's) at rows `slot` of the states, its group's
    rows (keep) only."""
    tl.store(part_m + slot, m, mask=keep)
    tl.store(part_l + slot, l, mask=keep)
    tl.store(part_acc + _tile_offsets(slot, D, SWAP), acc, mask=_col(keep, SWAP))


@triton.jit
def _split_states(q, pos, hi, chunk0, stride, mine, k, v, page_row, page_size, stride_page, stride_slot, qk_scale,
                  part_m, part_l, part_acc, first, keep, GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                  KV_BLOCK: tl.constexpr, KV_CHUNK: tl.constexpr, SWAP: tl.constexpr, PAGE_SHIFT: tl.constexpr,
                  STAGES: tl.constexpr):
    """A split program's `mine` chunks chunk0, chunk0 + stride, ... (program p of P: p, P) in one
    pipelined loop over their blocks, each chunk's state folded from empty and stored at its last
    block (or the last that holds keys): _chunk_state's operations in its order, without a pipeline
    restart at every chunk."""
    BLOCKS: tl.constexpr = KV_CHUNK // KV_BLOCK
    last = chunk0 + (mine - 1) * stride  # only the sequence's last chunk can end before its last block
    n_blocks = (mine - 1) * BLOCKS + (tl.minimum(hi - last * KV_CHUNK, KV_CHUNK - 1) // KV_BLOCK + 1)
    m, l, acc = _empty_state(ROWS, D, SWAP)
    for i in tl.range(0, n_blocks, num_stages=STAGES):
        chunk = chunk0 + (i // BLOCKS) * stride
        kb, vb, key_pos = _block_kv(k, v, page_row, chunk * BLOCKS + i % BLOCKS, hi, page_size, stride_page,
                                    stride_slot, KV_BLOCK, D, PAGE_SHIFT)
        m, l, acc = _fold_block(q, kb, vb, key_pos, pos, m, l, acc, qk_scale, KV_BLOCK, SWAP)
        if ((i + 1) % BLOCKS == 0) | (i == n_blocks - 1):
            _store_chunk_state(part_m, part_l, part_acc, first + chunk * GROUP, keep, m, _tile_sums(l, SWAP), acc,
                               D, SWAP)
            m, l, acc = _empty_state(ROWS, D, SWAP)


@triton.jit
def _cluster_offsets(rows, cols, D: tl.constexpr, SWAP: tl.constexpr, MERGE_ROWS: tl.constexpr):
    """Byte offsets (int32, from the buffer's end: _cluster.py) of rows `rows`, columns `cols` (None:
    all D), of the chunk state a clustered split's CTA keeps in its cluster buffer: its accumulator
    [MERGE_ROWS, D] (as a [rows, cols] tile, or with SWAP [cols, rows]), then its maxima and its sums
    [MERGE_ROWS] each, fp32 (cluster_buffer_bytes). Returns (acc, m, l)."""
    end: tl.constexpr = MERGE_ROWS * (D + 2)
    acc = ((_tile_offsets(rows, D, SWAP, cols) - end) * 4).to(tl.int32)
    return acc, ((MERGE_ROWS * D + rows - end) * 4).to(tl.int32), ((MERGE_ROWS * (D + 1) + rows - end) * 4).to(tl.int32)


def cluster_buffer_bytes(group: int, head_dim: int) -> int:
    """Bytes of a clustered split CTA's cluster buffer: one chunk state (_cluster_offsets)."""
    return triton.next_power_of_2(group) * (head_dim + 2) * 4


@triton.jit
def _keep_chunk_state(keep, m, l, acc, D: tl.constexpr, SWAP: tl.constexpr, MERGE_ROWS: tl.constexpr):
    """A clustered split program's chunk state (_chunk_state's) in its cluster buffer, its group's
    rows (keep) only: _store_chunk_state's stores, into shared memory."""
    rows = tl.arange(0, keep.shape[0])
    off_acc, off_m, off_l = _cluster_offsets(rows, None, D, SWAP, MERGE_ROWS)
    kept = keep.to(tl.int32)
    _cluster.put(off_acc, _col(kept, SWAP), acc)
    _cluster.put(off_m, kept, m)
    _cluster.put(off_l, kept, l)


@triton.jit
def _merge_state(part_m, part_l, part_acc, at, c, n_need, g, cols, m_t, l_t, acc_t, MERGE_ROWS: tl.constexpr,
                 D: tl.constexpr, CLUSTER: tl.constexpr, MASKED: tl.constexpr):
    """Chunk c's state (rows `at` of the states; CLUSTER > 1: CTA c's buffer) merged into the running
    one (_merge_chunk_states' step). MASKED: c may be past the last chunk (n_need): its state is
    loaded masked and its merge's result not kept (a select: exact); else every load is in bounds
    and the merge's result is the new state."""
    here = c < n_need
    if CLUSTER > 1:
        off_acc, off_m, off_l = _cluster_offsets(g, cols, D, False, MERGE_ROWS)
        in_c, owner = here.to(tl.int32), tl.minimum(c, CLUSTER - 1)  # (a rank past the cluster: no address)
        acc_c = _cluster.take(off_acc, in_c, owner)
        m_c = _cluster.take(off_m, in_c, owner)
        l_c = _cluster.take(off_l, in_c, owner)
    else:
        if MASKED:
            acc_c = tl.load(part_acc + _tile_offsets(at, D, False), mask=here, other=0.0)
            m_c = tl.load(part_m + at, mask=here, other=0.0)
            l_c = tl.load(part_l + at, mask=here, other=0.0)
        else:
            acc_c = tl.load(part_acc + _tile_offsets(at, D, False))
            m_c = tl.load(part_m + at)
            l_c = tl.load(part_l + at)
    m_n, l_n, acc_n = _merge(m_t, l_t, acc_t, m_c, l_c, acc_c, False)
    if MASKED:
        m_n, l_n, acc_n = tl.where(here, m_n, m_t), tl.where(here, l_n, l_t), tl.where(here, acc_n, acc_t)
    return m_n, l_n, acc_n


@triton.jit
def _merge_step(part_m, part_l, part_acc, step_g, c_step, n_need, g, cols, m_t, l_t, acc_t, GROUP: tl.constexpr,
                MERGE_ROWS: tl.constexpr, D: tl.constexpr, CLUSTER: tl.constexpr, STEP: tl.constexpr,
                MASKED: tl.constexpr):
    """Chunks c_step .. c_step + STEP - 1 merged in order (_merge_state each; their rows from step_g)."""
    for i in tl.static_range(STEP):
        m_t, l_t, acc_t = _merge_state(part_m, part_l, part_acc, step_g + i * GROUP, c_step + i, n_need, g, cols, m_t,
                                       l_t, acc_t, MERGE_ROWS, D, CLUSTER, MASKED)
    return m_t, l_t, acc_t


@triton.jit
def _merge_chunk_states(part_m, part_l, part_acc, out, lse, tail, n_chunks, n_need, begin, kv_head, n_heads,
                        GROUP: tl.constexpr, MERGE_ROWS: tl.constexpr, D: tl.constexpr, CLUSTER: tl.constexpr = 1,
                        rank=0):
    """The n_need chunk states of split pair `tail` merged in chunk order and its rows stored (by the
    last of the pair's programs). The merge is elementwise per row: only the group's real rows (a
    power of two >= GROUP). CLUSTER > 1: CTA `rank` of the pair's cluster merges its share of the
    columns (D / CLUSTER of them, from rank * D / CLUSTER), chunk c's state read from the cluster
    buffer of CTA c (_keep_chunk_state; part_m, part_l, part_acc, tail and n_chunks unused): the same
    merges of the same values, in the same order."""
    W: tl.constexpr = D // CLUSTER
    g = tl.arange(0, MERGE_ROWS)
    cols = rank * W + tl.arange(0, W)
    tok_g, head_g = _rows(g, begin, 1, kv_head, GROUP)
    first_g = (tail * n_chunks).to(tl.int64) * GROUP + g % GROUP
    m_t = tl.full((MERGE_ROWS,), float("-inf"), tl.float32)
    l_t = tl.zeros((MERGE_ROWS,), tl.float32)
    acc_t = tl.zeros((MERGE_ROWS, W), tl.float32)
    # chunk order, _MERGE_AHEAD states a step: their loads are independent of the merges, so they are
    # all in flight before the first merge needs one; a state past the last is loaded masked and its
    # merge's result not kept (a select: exact). Plain loads: the ticket's acquire orders them after
    # the other programs' released stores (ptxas follows the acquiring atomic with an L1
    # invalidation, CCTL.IVALL), so no L1 line they fill is stale. L2-only loads (.cg, ptxas'
    # LDG.STRONG.GPU) took 1.04-1.05x their time at batch 1 x 4k-32k (the thirty-fourth session, H100,
    # ab_decode.py, bits equal); in that session's probes the merge cost ~80 ns a state whether its
    # loads or its arithmetic were taken out, and alone (the thirty-fifth, benchmarks/probe_merge.py)
    # ~190 ns, where ptxas (32 registers) loads a state at a time, unlike here (the thirty-ninth's
    # SASS): a two-pass form that halves that alone gained 2% here, not kept.
    # Measured, not kept (the thirty-eighth session, H100, ab_decode.py, bits equal): the last 4 or 8
    # programs to take the ticket each merging a share of the columns, with 8 or 32 states a step
    # (0.99-1.03x this merge's time at batch 1-8 x 8k-32k), and a polled merge without a ticket (the
    # pair's first programs reloading the states until none holds an unwritten NaN; 1.07-1.44x)
    # Also not kept (the forty-sixth session, H100, ab_decode.py, bits equal): the next step's states
    # loaded into registers while this step merges (a double buffer: 0.989-0.998x the kernel's time at
    # batch 1-2 x 16k-32k, 1.03-1.05x at 1 x 1k-4k) and the next two steps' (1.015-1.027x); the next one
    # or two steps' states asked of L1 (prefetch.global.L1, CCTL.E.PF1: 1.02-1.04x / 1.03-1.07x at batch
    # 1 x 1k-32k). ptxas issues all of a step's loads before its first merge at 8 states a step, not at
    # 12, 16 or 32 (their loads go out in 3-4 groups, each waited for): more states a step saves no
    # round trip. benchmarks/probe_decode.py --merge-forms times the loop's loads and arithmetic apart.
    # A whole step (every state of it exists) loads and merges without masks or selects: the same
    # merges of the same values in ~215 instructions a step instead of 292 (ptxas, sm_90a, the split
    # grid's kernel: the masked loads' zeroed registers, the selects and the per-state 64-bit
    # compares and addresses gone; 144 registers against 164); a part-full step (the last; a
    # cluster's only one) masks as before. A step's states lie at constant offsets from its first,
    # the count in int32. (One loop with both bodies: a second loop for the part-full step had the
    # compiler convert the running state's layout through shared memory, 32 barriers a step.)
    # Unmeasured on a GPU when written (the fifty-second session): ab_decode.py against 2c73daf's
    # module, bits compared, is its test.
    # A cluster's merge is one step of its CTAs' states (n_need <= CLUSTER <= CLUSTER_MAX), not of
    # _MERGE_AHEAD: a cluster of 2 or 4 merged 6 or 4 states past its last, each a no-op (their
    # selects kept the running state), in 403 or 291 instructions against 8 states' 308 at 8 (ptxas).
    STEP: tl.constexpr = CLUSTER if CLUSTER > 1 else _MERGE_AHEAD
    n_need = n_need.to(tl.int32)
    for c_step in range(0, n_need, STEP):
        step_g = first_g + c_step * GROUP
        whole = False
        if CLUSTER == 1:
            whole = c_step + STEP <= n_need
        if whole:
            m_t, l_t, acc_t = _merge_step(part_m, part_l, part_acc, step_g, c_step, n_need, g, cols, m_t, l_t, acc_t,
                                          GROUP, MERGE_ROWS, D, CLUSTER, STEP, False)
        else:
            m_t, l_t, acc_t = _merge_step(part_m, part_l, part_acc, step_g, c_step, n_need, g, cols, m_t, l_t, acc_t,
                                          GROUP, MERGE_ROWS, D, CLUSTER, STEP, True)
    # (a cluster's CTAs each store every row's lse: the same bits, from the same merges of m and l)
    _store_rows(out, lse, tok_g * n_heads + head_g, g < GROUP, m_t, l_t, acc_t, D, False, cols)


@triton.jit
def _decode_chunk_kernel(q, k, v, out, lse, part_m, part_l, part_acc, tickets, q_begin, q_count, q_pos, page_table,
                         stride_table, page_size, stride_page, stride_head, stride_slot, n_heads, qk_scale,
                         n_chunks, n_walks, per_split, table_width, GROUP: tl.constexpr, ROWS: tl.constexpr,
                         MERGE_ROWS: tl.constexpr, D: tl.constexpr, KV_BLOCK: tl.constexpr, KV_CHUNK: tl.constexpr,
                         WALKS: tl.constexpr, SPLITS: tl.constexpr, PREFETCH: tl.constexpr,
                         FROM_LENS: tl.constexpr, SWAP: tl.constexpr, PAGE_SHIFT: tl.constexpr,
                         FLAT_STAGES: tl.constexpr, ONE_CHUNK: tl.constexpr, CLUSTER: tl.constexpr = 1):
    """Single-query sequences, each (sequence, kv head) pair's rows the group's query heads. A grid
    with splits is 1-D: programs 0 .. n_walks - 1 walk pairs 0 .. n_walks - 1 whole, and each later
    pair is split across per_split programs (P); a grid of walks only is (1, kv heads, sequences). A
    walk runs as a prefill tile does (_row_state: its chunk states merged in registers, the same
    operations in the same order). Split program p of a pair stores the states of chunks p, p + P,
    p + 2P, ...; the last of the pair's programs to finish merges every chunk's state in chunk order
    and stores the rows (one launch per decode step). Which program computes a chunk, and how the
    walks and splits share the grid, move no bit. The launcher sets n_walks and P from the batch,
    never the cache length, so a grid sized for the longest sequence (a CUDA graph's) costs no idle
    programs. WALKS / SPLITS: whether the grid holds any walk / any split (a kernel of one kind holds
    only its path). SWAP: the tile's dots run with their operands swapped (_fold_block): the group's
    heads are the N side of the MMA, padded to ROWS = 16 rather than 64. PAGE_SHIFT: _kv_offsets'.
    table_width: the page table's entries a row (a split program loads its first chunk's entries
    before the sequence's bounds, masked by the table's width). ONE_CHUNK: no sequence has more
    chunks than its pair has programs (the launcher's bound, the cache's longest sequence), so the
    kernel holds no path for a program's second chunk. CLUSTER > 1 (ONE_CHUNK, a grid of splits alone,
    per_split = CLUSTER): each pair's programs are one thread-block cluster (_cluster.py): each keeps
    its chunk's state in its own shared memory, the cluster meets at its barrier, and each merges its
    share of the columns from every CTA's state (_merge_chunk_states), instead of the states going
    through memory and a ticket (a CTA past the sequence's chunks only merges)."""
    if SPLITS:
        pid = tl.program_id(0)
        if CLUSTER > 1:  # the cluster barrier's phase 0: every CTA arrives as it starts, before any return
            _cluster.arrive(pid, False)
        n_kv = n_heads // GROUP
        walking = pid < n_walks
        split_pid = tl.maximum(pid - n_walks, 0)
        pair = tl.where(walking, pid, n_walks + split_pid // per_split)
        p = tl.where(walking, 0, split_pid % per_split)
        seq, kv_head = pair // n_kv, pair % n_kv
        # a split program's first chunk's page entries, issued beside the bounds' loads below rather
        # than after them: its K/V loads then wait one memory round trip less (a walk loads none; the
        # bound in int64: a table of several 2^30-key pages would overflow int32; tl.cast, since a width
        # of 1, a linear K/V's, comes specialised as a Python int).
        # The thirty-fourth session (H100, ab_decode.py, CUDA graphs, bits equal): batch 1 at 1k /
        # 4k / 16k keys 1.039 / 1.033 / 1.010x; batches 4-64 (several chunks a program) 1.000-1.002x
        first_pages = None
        if PAGE_SHIFT >= 0:
            last_key = tl.where(walking, -1, (tl.cast(table_width, tl.int64) << PAGE_SHIFT) - 1)
            first_pages = _chunk_pages(page_table + seq * stride_table, p * KV_CHUNK, last_key, KV_CHUNK, PAGE_SHIFT)
    else:  # a grid of walks only: (1, kv heads, sequences)
        p, kv_head, seq, first_pages = 0, tl.program_id(1), tl.program_id(2), None
    begin, n_queries = _sequence(q_begin, q_count, seq, FROM_LENS)
    rows = tl.arange(0, ROWS)
    tok, head = _rows(rows, begin, 1, kv_head, GROUP)
    # the positions before the branch below: FROM_LENS, their load (the sequence's length) flies beside
    # the sequence's bounds instead of after them, one memory round trip fewer before the first K/V
    # load (a sequence of several queries loads an in-bounds value it never uses)
    pos = _query_pos(q_pos, tok, rows, seq, 1, GROUP, FROM_LENS)
    if n_queries != 1:
        return
    hi = tl.max(pos, 0)
    n_need = hi // KV_CHUNK + 1  # the chunks that hold keys
    if CLUSTER == 1:  # (a cluster's CTAs each merge a share of the columns: none leaves early)
        if p >= n_need:
            return
    q_tile = tl.load(q + _tile_offsets(tok * n_heads + head, D, SWAP))
    keep = rows < GROUP
    k, v, page_row = k + kv_head * stride_head, v + kv_head * stride_head, page_table + seq * stride_table
    if WALKS and not SPLITS:  # (a grid of walks only: no branch around the walk)
        _walk(q_tile, pos, hi, k, v, page_row, page_size, stride_page, stride_slot, qk_scale, out, lse,
              tok * n_heads + head, keep, ROWS, D, KV_BLOCK, KV_CHUNK, PREFETCH, SWAP, PAGE_SHIFT)
        return
    if WALKS and SPLITS:
        if walking:
            _walk(q_tile, pos, hi, k, v, page_row, page_size, stride_page, stride_slot, qk_scale, out, lse,
                  tok * n_heads + head, keep, ROWS, D, KV_BLOCK, KV_CHUNK, PREFETCH, SWAP, PAGE_SHIFT)
            return
    if SPLITS:
        # the split pairs' states and tickets, from the first split pair's
        tail = pair - n_walks
        first = (tail * n_chunks).to(tl.int64) * GROUP + rows % GROUP
        # FLAT_STAGES (the deeper split ring's grids): a program of several chunks folds them in one loop
        # over their blocks on that ring (_split_states); else, and always for a program of one chunk, a
        # loop a chunk, whose page entries come in one load (_chunk_state). On the table's ring a loop a
        # chunk: the one loop's in-loop store takes shared memory (78 KB a program against 71.7 at 2-3
        # stages), two programs an SM instead of three (0.91-0.97x the sixteenth session's kernel at
        # batch 16-64 in an A/B)
        if CLUSTER > 1:
            if p < n_need:
                m, l, acc = _chunk_state(q_tile, pos, hi, p, k, v, page_row, page_size, stride_page, stride_slot,
                                         qk_scale, ROWS, D, KV_BLOCK, KV_CHUNK, SWAP, PAGE_SHIFT, first_pages)
                _keep_chunk_state(keep, m, l, acc, D, SWAP, MERGE_ROWS)
            _cluster.wait(p)  # phase 0 done: every CTA of the cluster started
            _cluster.arrive(p, True)  # phase 1: this CTA's state is in its buffer (release)
            _cluster.wait(p)
            _merge_chunk_states(part_m, part_l, part_acc, out, lse, tail, n_chunks, n_need, begin, kv_head, n_heads,
                                GROUP, MERGE_ROWS, D, CLUSTER, p)
            _cluster.arrive(p, False)  # phase 2: done reading the other CTAs' buffers; none exits before
            _cluster.wait(p)
            return
        if ONE_CHUNK:  # a kernel without the paths of several chunks a program: the thirty-fifth session
            # (H100, ab_decode.py, CUDA graphs, bits equal), batch 1 at 1k / 4k 1.016 / 1.012-1.026x,
            # 2 x 4k 1.027x (that code, never run there, took their programs longer)
            mine = 1
        else:
            mine = (n_need - 1 - p) // per_split + 1
        if (FLAT_STAGES and not ONE_CHUNK) and (mine > 1):
            _split_states(q_tile, pos, hi, p, per_split, mine, k, v, page_row, page_size, stride_page,
                          stride_slot, qk_scale, part_m, part_l, part_acc, first, keep, GROUP, ROWS, D, KV_BLOCK,
                          KV_CHUNK, SWAP, PAGE_SHIFT, FLAT_STAGES)
        else:
            m, l, acc = _chunk_state(q_tile, pos, hi, p, k, v, page_row, page_size, stride_page, stride_slot,
                                     qk_scale, ROWS, D, KV_BLOCK, KV_CHUNK, SWAP, PAGE_SHIFT, first_pages)
            _store_chunk_state(part_m, part_l, part_acc, first + p * GROUP, keep, m, l, acc, D, SWAP)
            if not ONE_CHUNK:
                for chunk in range(p + per_split, n_need, per_split):
                    m, l, acc = _chunk_state(q_tile, pos, hi, chunk, k, v, page_row, page_size, stride_page,
                                             stride_slot, qk_scale, ROWS, D, KV_BLOCK, KV_CHUNK, SWAP, PAGE_SHIFT)
                    _store_chunk_state(part_m, part_l, part_acc, first + chunk * GROUP, keep, m, l, acc, D, SWAP)
        tl.debug_barrier()  # every thread's stores precede the release
        ticket = tl.atomic_add(tickets + tail, mine, sem="acq_rel", scope="gpu")
        if ticket + mine == n_need:  # this program stored the last of the chunk states
            tl.atomic_xchg(tickets + tail, 0, sem="relaxed", scope="gpu")  # _tickets.py
            _merge_chunk_states(part_m, part_l, part_acc, out, lse, tail, n_chunks, n_need, begin, kv_head, n_heads,
                                GROUP, MERGE_ROWS, D)


# ---- the forward, warp-specialised (Gluon) ---------------------------------------------------------
# _prefill_kernel's tiles and folds (TUNING["prefill_linear"] and ["prefill"], GLUON) with the schedule
# written out, over a linear K/V (training's) or a paged one (vLLM's):
# a producer warp brings every K/V block of the tile through TMA into a STAGES-deep ring, and two
# consumer warpgroups, each with 64 of the tile's 128 rows, multiply and fold every block and merge
# every chunk as _row_state does. They wait for nobody but the producer, so one folds while the other
# multiplies, and inside each a block's q.k runs beside the previous block's P@V (FA3's pipelining
# within a warpgroup). The same operations in the same order, per row:
# - q.k, P@V and the ones-dot row sums are wgmma's m64nNk16 chains over the same k steps as tl.dot's
#   (the instruction shapes of the tl kernel at 8 warps: tests/test_attention.py compares them);
# - the softmax of a block is _block_softmax, the chunk merge _merge, the output _normalised and _lse: the
#   tl functions, called from here;
# - every block's K/V hold the tl kernel's values: a block comes as TMA boxes of one page each (the
#   whole block where pages hold whole blocks: a linear K/V is one page); the box of the tile's last
#   key `hi` and those after it come through descriptors made on the device that end at hi's row, so
#   TMA fills the keys past hi with zeros, as the masked loads of the tl kernel's last block do.
_WS_TILE = gl.constexpr(128)  # rows of a program's tile (BLOCK_Q): two consumer warpgroups of _WS_HALF rows
_WS_HALF = gl.constexpr(64)
# registers a thread: the default partition (consumer 0) gets what the others leave (256); consumer 1
# holds the running and the chunk state (2 x 64 fp32 a thread), a block's products and probabilities;
# the producer only issues loads
_WS_CONSUMER_REGISTERS = gl.constexpr(240)
_WS_PRODUCER_REGISTERS = gl.constexpr(24)


@gluon.jit
def _load_rows_to_shared(src, tile_row0, begin, n_queries, kv_head, n_heads, dst, GROUP: gl.constexpr,
                         LAYOUT: gl.constexpr):
    """dst [ROWS, D] <- the rows tile_row0 .. + ROWS of a [tokens, heads, D] tensor, as the tl kernels
    load a tile (_rows: (query, head) rows, past the sequence its last query)."""
    ROWS: gl.constexpr = dst.shape[0]
    D: gl.constexpr = dst.shape[1]
    tok, head = _rows(tile_row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LAYOUT)), begin, n_queries, kv_head,
                      GROUP)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, LAYOUT))
    dst.store(gl.load(src + (tok * n_heads + head)[:, None] * D + cols[None, :]))


@gluon.jit
def _ws_producer(k_all, v_all, k, v, k_smem, v_smem, ready, empty, page_row, page_size, page_rows, head_row, col, hi,
                 kv_width, stride_slot, last, STAGES: gl.constexpr, ABLATE: gl.constexpr):
    """Blocks 0 .. last of the tile's keys, in order, into the ring (a slot refilled once both
    consumers freed it), each as BOX-key boxes of one page: a box whose keys are all at or before hi
    through k_all/v_all (host descriptors of the whole K/V), hi's box and those after it through
    descriptors of the K/V up to hi's row made here (k, v: its base), so that TMA reads the keys past
    hi as zeros (a box past hi lies wholly past it). Only block last has such boxes: its descriptors
    are made once the blocks before it are on their way, beside the ring's copies rather than before
    the program's first block (ABLATE's _HOST_ENDS: k_all's for every box). Made before the program's
    warps split, they held every program's start (~1.5 us: probe_prefill.py's host-descriptor
    ablation on 64 x 256 tokens); here the paged prefill of a 4k / 16k prompt takes 0.964 / 0.971x
    the time and training's forward on 4 x 4,096 tokens 0.994x (the forty-ninth session, H100, CUDA
    graphs, the two kernels in one call, bits equal)."""
    BOX: gl.constexpr = k_all.block_type.shape[0]
    D: gl.constexpr = k_all.block_type.shape[1]
    KV_BLOCK: gl.constexpr = k_smem.shape[1]
    BOXES: gl.constexpr = KV_BLOCK // BOX
    # a block of several boxes (pages shorter than a block: vLLM's 16-key pages) loads its page
    # entries a block ahead, before the slot's wait and the block before's copies, so that no copy
    # waits on its entry's load: the paged prefill of a 4k / 16k prompt at 16-key pages took 0.905 /
    # 0.921x the time of the entries loaded box by box (the fortieth session, H100, A/B, bits equal);
    # a block of one box (a linear K/V, pages of a block or more) loads its entry in place, as before
    # (the blocks before last pass k_all as their end descriptors too: no box of theirs reaches past hi)
    if BOXES > 1:
        box = gl.arange(0, BOXES, layout=gl.BlockedLayout([1], [32], [1], [0]))
        entries = _block_entries(page_row, box, 0, hi, page_size, KV_BLOCK, BOX)
    else:  # (a block's one entry is loaded in place: _ws_load_block passes these through)
        box = 0
        entries = gl.to_tensor(0)
    for blk in range(0, last):
        entries = _ws_load_block(k_all, v_all, k_all, v_all, k_smem, v_smem, ready, empty, page_row, page_size,
                                 page_rows, head_row, col, hi, hi, blk, entries, box, STAGES)
    if last >= 0:  # (ABLATE's _NO_LOADS: no block)
        row_hi = gl.load(page_row + hi // page_size) * page_rows + head_row + hi % page_size
        if ABLATE & _HOST_ENDS:
            k_end, v_end = k_all, v_all
        else:
            k_end = tma.make_tensor_descriptor(k, [row_hi + 1, kv_width], [stride_slot, 1], [BOX, D],
                                               k_smem.type.layout)
            v_end = tma.make_tensor_descriptor(v, [row_hi + 1, kv_width], [stride_slot, 1], [BOX, D],
                                               v_smem.type.layout)
        _ws_load_block(k_all, v_all, k_end, v_end, k_smem, v_smem, ready, empty, page_row, page_size, page_rows,
                       head_row, col, hi, row_hi, last, entries, box, STAGES)


@gluon.jit
def _ws_load_block(k_all, v_all, k_end, v_end, k_smem, v_smem, ready, empty, page_row, page_size, page_rows, head_row,
                   col, hi, row_hi, blk, entries, box, STAGES: gl.constexpr):
    """Block blk's boxes into its ring slot, once both consumers freed it (_ws_producer; entries: its
    boxes' page entries, box their indices, where a block has several). Returns the next block's
    entries (several boxes), else entries."""
    BOX: gl.constexpr = k_all.block_type.shape[0]
    KV_BLOCK: gl.constexpr = k_smem.shape[1]
    BOXES: gl.constexpr = KV_BLOCK // BOX
    st = blk % STAGES
    if BOXES > 1:
        ahead = _block_entries(page_row, box, blk + 1, hi, page_size, KV_BLOCK, BOX)
    else:
        ahead = entries
    mbarrier.wait(empty.index(st), ((blk // STAGES) & 1) ^ 1)  # (a slot's first use passes at once)
    bar = ready.index(st)
    mbarrier.expect(bar, 2 * BOXES * k_all.block_type.nbytes)
    for j in gl.static_range(BOXES):
        key = blk * KV_BLOCK + j * BOX
        k_box = k_smem.index(st).slice(j * BOX, BOX)
        v_box = v_smem.index(st).slice(j * BOX, BOX)
        if key + BOX - 1 <= hi:
            if BOXES > 1:
                entry = gl.max(gl.where(box == j, entries, 0), 0)  # (entries >= 0: a max is exact)
            else:
                entry = gl.load(page_row + key // page_size)
            row = entry * page_rows + head_row + key % page_size
            tma.async_copy_global_to_shared(k_all, [row, col], bar, k_box)
            tma.async_copy_global_to_shared(v_all, [row, col], bar, v_box)
        else:
            row = row_hi + 1 + gl.minimum(key - hi - 1, 0)
            tma.async_copy_global_to_shared(k_end, [row, col], bar, k_box)
            tma.async_copy_global_to_shared(v_end, [row, col], bar, v_box)
    return ahead


@gluon.jit
def _block_entries(page_row, box, blk, hi, page_size, KV_BLOCK: gl.constexpr, BOX: gl.constexpr):
    """The page-table entries of block blk's boxes (box: their indices) whose keys are all at or
    before hi (the others, copied through the end descriptors, read none: 0)."""
    key = blk * KV_BLOCK + box * BOX
    return gl.load(page_row + key // page_size, mask=key + BOX - 1 <= hi, other=0)


@gluon.jit
def _ws_merge(m, l, acc, m_c, l_c, acc_c):
    """_merge of a consumer's chunk state (m_c in the products' row layout, l_c its row-sum dot's
    tile: _tile_sums) into the running state (rows in acc's)."""
    row: gl.constexpr = m.type.layout
    l_sums = gl.convert_layout(_tile_sums(l_c, False), row)
    return _merge(m, l, acc, gl.convert_layout(m_c, row), l_sums, acc_c, False)


@gluon.jit
def _wgmma_a(smem, ACC_L: gl.constexpr, REGS: gl.constexpr):
    """A wgmma's A operand for accumulators of layout ACC_L: the shared-memory tile itself, or with
    REGS (TUNING's GLUON_Q_REGS) the tile loaded into registers once, an RS wgmma's operand, so that
    the wgmmas that reuse it read only their B operand from shared memory. The same arithmetic."""
    if REGS:
        a = smem.load(gl.DotOperandLayout(0, ACC_L, 2))
    else:
        a = smem
    return a


@gluon.jit
def _ws_softmax(s, blk, pos, m, qk_scale, n_full):
    """_block_softmax of block blk for a consumer's rows (positions pos). A block that every row
    sees whole (blk < n_full) skips the mask (its compares and selects): _scaled_softmax of the
    products as they are, every bit the masked expression's."""
    KV_BLOCK: gl.constexpr = s.shape[1]
    key_pos = blk * KV_BLOCK + gl.arange(0, KV_BLOCK, layout=gl.SliceLayout(0, s.type.layout))
    if blk < n_full:
        m_new, alpha, p = _scaled_softmax(s, m, qk_scale, False)
    else:
        m_new, alpha, p = _block_softmax(s, key_pos, pos, m, qk_scale, False)
    return m_new, alpha, p


# ABLATE (benchmarks/probe_prefill.py only; 0 everywhere else): bits of work the Gluon forward's
# consumers leave out, so that a probe can time what each costs. The results are then wrong.
_NO_SOFTMAX = gl.constexpr(1)  # P = the products as they are: no maxima, no exponentials a key
_NO_ROW_SUMS = gl.constexpr(2)  # no ones-dot: the row sums stay zero
_NO_RESCALE = gl.constexpr(4)  # the chunk state's accumulators not multiplied by alpha a block
_NO_MMA = gl.constexpr(8)  # the consumers only wait for each block and free it: the ring's loads alone
_NO_LOADS = gl.constexpr(16)  # no copies and no waits on the ring: the MMAs read what shared memory holds
_HOST_ENDS = gl.constexpr(32)  # no descriptors made on the device: the host's, over the whole K/V, for the
#                                tile's last blocks too (the keys past hi read as they are, not as zeros)


@gluon.jit
def _ws_wait(ready, st, phase, ABLATE: gl.constexpr):
    """A consumer's wait for ring slot st (ABLATE's _NO_LOADS: none)."""
    if not ABLATE & _NO_LOADS:
        mbarrier.wait(ready.index(st), phase)


@gluon.jit
def _ws_free(empty, st, ABLATE: gl.constexpr):
    """A consumer's release of ring slot st (ABLATE's _NO_LOADS: none)."""
    if not ABLATE & _NO_LOADS:
        mbarrier.arrive(empty.index(st), count=1)


@gluon.jit
def _ws_drain(ready, empty, last, STAGES: gl.constexpr):
    """ABLATE's _NO_MMA consumer: blocks 0 .. last waited for and freed in order, nothing computed."""
    for blk in range(0, last + 1):
        st = blk % STAGES
        mbarrier.wait(ready.index(st), (blk // STAGES) & 1)
        mbarrier.arrive(empty.index(st), count=1)


@gluon.jit
def _ablated_softmax(s, blk, pos, m, qk_scale, n_full, ABLATE: gl.constexpr):
    """_ws_softmax, or with ABLATE's _NO_SOFTMAX the products as P and qk_scale as alpha (a value the
    compiler cannot know, so that the rescale stays)."""
    if ABLATE & _NO_SOFTMAX:
        m_new, alpha, p = m, _col(gl.full(m.shape, qk_scale, gl.float32, m.type.layout), False), s
    else:
        m_new, alpha, p = _ws_softmax(s, blk, pos, m, qk_scale, n_full)
    return m_new, alpha, p


@gluon.jit
def _ws_fold(p_l, p_o, ones_smem, v_smem, st, l_c, acc_c, alpha, L_L: gl.constexpr, O_L: gl.constexpr,
             is_async: gl.constexpr, ABLATE: gl.constexpr):
    """A block's row-sum and P@V (V in ring slot st) wgmma chains on the chunk state rescaled by
    alpha (ABLATE: less)."""
    if not ABLATE & _NO_ROW_SUMS:
        if not ABLATE & _NO_RESCALE:
            l_c = l_c * gl.convert_layout(alpha, L_L)
        l_c = warpgroup_mma(p_l, ones_smem, l_c, is_async=is_async)
    v_block = v_smem.index(st)
    if not ABLATE & _NO_RESCALE:
        acc_c = acc_c * gl.convert_layout(alpha, O_L)
    acc_c = warpgroup_mma(p_o, v_block, acc_c, is_async=is_async)
    return l_c, acc_c


@gluon.jit
def _ws_consumer(q_smem, ones_smem, k_smem, v_smem, ready, empty, out, lse, q_pos, begin, n_queries, seq, row0,
                 kv_head, n_heads, qk_scale, last, GROUP: gl.constexpr, KV_CHUNK: gl.constexpr, STAGES: gl.constexpr,
                 FROM_LENS: gl.constexpr, Q_REGS: gl.constexpr, ABLATE: gl.constexpr):
    """Rows row0 .. row0 + 63 of the tile: every block folded into the chunk state, chunk states
    merged into the running state at each chunk's last block (or the tile's last), as _row_state."""
    ROWS: gl.constexpr = q_smem.shape[0]
    D: gl.constexpr = q_smem.shape[1]
    KV_BLOCK: gl.constexpr = k_smem.shape[1]
    SUM_COLS: gl.constexpr = ones_smem.shape[1]
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, KV_BLOCK, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    L_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, SUM_COLS, 16])
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    rows = row0 + gl.arange(0, ROWS, layout=ROW_S)
    tok, _ = _rows(rows, begin, n_queries, kv_head, GROUP)
    pos = _query_pos(q_pos, tok, rows, seq, n_queries, GROUP, FROM_LENS)
    n_full = (gl.min(pos, 0) + 1) // KV_BLOCK  # blocks every row sees whole
    m = gl.full([ROWS], float("-inf"), gl.float32, ROW_O)  # the running state (l: a vector)
    l = gl.zeros([ROWS], gl.float32, ROW_O)
    acc = gl.zeros([ROWS, D], gl.float32, O_L)
    m_c = gl.full([ROWS], float("-inf"), gl.float32, ROW_S)  # the chunk state (l_c: its dot's tile)
    l_c = gl.zeros([ROWS, SUM_COLS], gl.float32, L_L)
    acc_c = gl.zeros([ROWS, D], gl.float32, O_L)
    s0 = gl.zeros([ROWS, KV_BLOCK], gl.float32, S_L)
    # block blk's q.k runs while block blk - 1's P@V does, and block blk's softmax while that P@V
    # finishes (FA3's pipelining inside a warpgroup): block 0's q.k and softmax first, the last
    # block's P@V and merge after
    q_op = _wgmma_a(q_smem, S_L, Q_REGS)
    _ws_wait(ready, 0, 0, ABLATE)
    s = warpgroup_mma(q_op, k_smem.index(0).permute((1, 0)), s0, use_acc=False)
    m_c, alpha, p = _ablated_softmax(s, 0, pos, m_c, qk_scale, n_full, ABLATE)
    p_l = gl.convert_layout(p.to(k_smem.dtype), gl.DotOperandLayout(0, L_L, 2))
    p_o = gl.convert_layout(p.to(k_smem.dtype), gl.DotOperandLayout(0, O_L, 2))
    FOLD_GROUPS: gl.constexpr = 1 if ABLATE & _NO_ROW_SUMS else 2  # wgmma groups a block's fold commits
    for blk in range(1, last + 1):
        st = blk % STAGES
        prev = (blk - 1) % STAGES
        _ws_wait(ready, st, (blk // STAGES) & 1, ABLATE)
        s = warpgroup_mma(q_op, k_smem.index(st).permute((1, 0)), s0, use_acc=False, is_async=True)
        l_c, acc_c = _ws_fold(p_l, p_o, ones_smem, v_smem, prev, l_c, acc_c, alpha, L_L, O_L, True, ABLATE)
        s = warpgroup_mma_wait(num_outstanding=FOLD_GROUPS, deps=(s, ))
        m_done = m_c  # block blk - 1's chunk max
        if blk % (KV_CHUNK // KV_BLOCK) == 0:  # block blk starts a chunk: from the empty state
            m_c = gl.full([ROWS], float("-inf"), gl.float32, ROW_S)
        m_c, alpha, p = _ablated_softmax(s, blk, pos, m_c, qk_scale, n_full, ABLATE)
        l_c, acc_c, p_l, p_o = warpgroup_mma_wait(num_outstanding=0, deps=(l_c, acc_c, p_l, p_o))
        _ws_free(empty, prev, ABLATE)
        p_l = gl.convert_layout(p.to(k_smem.dtype), gl.DotOperandLayout(0, L_L, 2))
        p_o = gl.convert_layout(p.to(k_smem.dtype), gl.DotOperandLayout(0, O_L, 2))
        if blk % (KV_CHUNK // KV_BLOCK) == 0:  # block blk - 1 ended its chunk
            m, l, acc = _ws_merge(m, l, acc, m_done, l_c, acc_c)
            l_c = gl.zeros([ROWS, SUM_COLS], gl.float32, L_L)
            acc_c = gl.zeros([ROWS, D], gl.float32, O_L)
    st = last % STAGES
    l_c, acc_c = _ws_fold(p_l, p_o, ones_smem, v_smem, st, l_c, acc_c, alpha, L_L, O_L, False, ABLATE)
    _ws_free(empty, st, ABLATE)
    m, l, acc = _ws_merge(m, l, acc, m_c, l_c, acc_c)
    rows = gl.convert_layout(rows, ROW_O)
    tok, head = _rows(rows, begin, n_queries, kv_head, GROUP)
    idx = tok * n_heads + head
    keep = rows < n_queries * GROUP
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, O_L))
    gl.store(out + idx[:, None] * D + cols[None, :], _normalised(acc, l, False).to(out.dtype.element_ty),
             mask=keep[:, None])
    gl.store(lse + idx, _lse(m, l), mask=keep)


@gluon.jit
def _prefill_ws_kernel(q, k, v, out, lse, q_begin, q_count, q_pos, page_table, stride_table, page_size, page_rows,
                       head_rows, head_cols, stride_slot, kv_width, n_heads, qk_scale, min_queries, n_seqs, k_all, v_all,
                       GROUP: gl.constexpr, D: gl.constexpr, KV_BLOCK: gl.constexpr, KV_CHUNK: gl.constexpr,
                       BOX: gl.constexpr, STAGES: gl.constexpr, FROM_LENS: gl.constexpr, Q_REGS: gl.constexpr,
                       ABLATE: gl.constexpr = 0):
    """_prefill_kernel, warp-specialised: a program per (128-row tile, kv head, sequence), ranked as
    _prefill_kernel's. K/V are read as a [rows, kv_width] matrix of row pitch stride_slot: the key
    in slot s of page p of kv head h is row p * page_rows + h * head_rows + s, at column h *
    head_cols; k_all, v_all: its host descriptors in BOX-key boxes (the tile's last block's boxes
    past its last key come through descriptors the producer makes: _ws_producer). Q_REGS: TUNING's
    GLUON_Q_REGS (each consumer's q in registers, the A operand of its q.k wgmmas). ABLATE: 0, or
    work left out for a probe (above _ablated_softmax)."""
    rank, kv_head, seq = _ranked_program(gl.program_id(0), n_heads // GROUP, n_seqs)
    begin, n_queries = _sequence(q_begin, q_count, seq, FROM_LENS)
    tile = gl.cdiv(n_queries * GROUP, _WS_TILE) - 1 - rank  # rank 0: the sequence's latest queries
    if (tile < 0) | (n_queries < min_queries):
        return
    dtype: gl.constexpr = q.dtype.element_ty
    KV_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BOX, D], dtype)  # (gluon_layout: the host's)
    LOAD_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    ONES_L: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0])
    QS_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_WS_HALF, D], dtype)
    rows = tile * _WS_TILE + gl.arange(0, _WS_TILE, layout=gl.SliceLayout(1, LOAD_L))
    tok, _ = _rows(rows, begin, n_queries, kv_head, GROUP)
    hi = gl.max(_query_pos(q_pos, tok, rows, seq, n_queries, GROUP, FROM_LENS), 0)
    q0_smem = gl.allocate_shared_memory(dtype, [_WS_HALF, D], QS_L)
    q1_smem = gl.allocate_shared_memory(dtype, [_WS_HALF, D], QS_L)
    _load_rows_to_shared(q, tile * _WS_TILE, begin, n_queries, kv_head, n_heads, q0_smem, GROUP, LOAD_L)
    _load_rows_to_shared(q, tile * _WS_TILE + _WS_HALF, begin, n_queries, kv_head, n_heads, q1_smem, GROUP, LOAD_L)
    ones = gl.full([KV_BLOCK, _SUM_COLS], 1.0, gl.float32, ONES_L).to(dtype)
    ones_smem = gl.allocate_shared_memory(dtype, [KV_BLOCK, _SUM_COLS],
                                          gl.NVMMASharedLayout.get_default_for([KV_BLOCK, _SUM_COLS], dtype), ones)
    page_row = page_table + seq * stride_table
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, KV_BLOCK, D], KV_L)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, KV_BLOCK, D], KV_L)
    ready, empty = ring_barriers(STAGES)
    fence_async_shared()  # the q and ones stores, before the wgmmas read them
    last = hi // KV_BLOCK
    if ABLATE & _NO_LOADS:
        produced = -1
    else:
        produced = last
    loads = (k_all, v_all, k, v, k_smem, v_smem, ready, empty, page_row, page_size, page_rows, kv_head * head_rows,
             kv_head * head_cols, hi, kv_width, stride_slot, produced, STAGES, ABLATE)
    if ABLATE & _NO_MMA:
        gl.warp_specialize([(_ws_drain, (ready, empty, last, STAGES)), (_ws_drain, (ready, empty, last, STAGES)),
                            (_ws_producer, loads)], [4, 1], [_WS_CONSUMER_REGISTERS, _WS_PRODUCER_REGISTERS])
    else:
        gl.warp_specialize([
            (_ws_consumer, (q0_smem, ones_smem, k_smem, v_smem, ready, empty, out, lse, q_pos, begin, n_queries, seq,
                            tile * _WS_TILE, kv_head, n_heads, qk_scale, last, GROUP, KV_CHUNK, STAGES, FROM_LENS,
                            Q_REGS, ABLATE)),
            (_ws_consumer, (q1_smem, ones_smem, k_smem, v_smem, ready, empty, out, lse, q_pos, begin, n_queries, seq,
                            tile * _WS_TILE + _WS_HALF, kv_head, n_heads, qk_scale, last, GROUP, KV_CHUNK, STAGES,
                            FROM_LENS, Q_REGS, ABLATE)),
            (_ws_producer, loads),
        ], [4, 1], [_WS_CONSUMER_REGISTERS, _WS_PRODUCER_REGISTERS])
    invalidate_ring(ready, empty, STAGES)


# ---- backward kernels (FA2 style; deterministic: every sum runs in a fixed loop, no atomics) ------

@triton.jit
def _dkdv_tile(q, do, lse, delta, q_pos, kb, vb, key_pos, row0, q_first, n_queries, kv_head, n_heads, qk_scale,
               dk_acc, dv_acc, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, MASKED: tl.constexpr):
    """Add one BLOCK_Q-row query tile's share to a key block's dK, dV accumulators. MASKED: some row
    of the tile (a query before a key, or a row past the sequence) must not see some key; a tile
    whose every row sees every key skips the mask (where would select s everywhere: the same bits)."""
    rows = row0 + tl.arange(0, BLOCK_Q)
    tok, head = _rows(rows, q_first, n_queries, kv_head, GROUP)
    idx = tok * n_heads + head
    cols = tl.arange(0, D)[None, :]
    q_tile = tl.load(q + idx[:, None] * D + cols)
    do_tile = tl.load(do + idx[:, None] * D + cols)
    p_t = _dkdv_probs(tl.dot(kb, tl.trans(q_tile), input_precision="ieee"), key_pos, q_pos, tok, rows,
                      tl.load(lse + idx), n_queries * GROUP, qk_scale, MASKED)
    dv_acc = tl.dot(p_t.to(do_tile.dtype), do_tile, dv_acc, input_precision="ieee")
    dp_t = tl.dot(vb, tl.trans(do_tile), input_precision="ieee")
    ds_t = _dkdv_ds(p_t, dp_t, tl.load(delta + idx))
    dk_acc = tl.dot(ds_t.to(q_tile.dtype), q_tile, dk_acc, input_precision="ieee")
    return dk_acc, dv_acc


@triton.jit
def _dkdv_probs(s_t, key_pos, q_pos, tok, rows, row_lse, n_rows, qk_scale, MASKED: tl.constexpr):
    """P^T of a (key block, query tile) from its k.q products s_t [keys, rows] and the rows' lse
    (also the Gluon dK/dV's): masked, keys after a row's position and rows past the sequence are
    exact zeros."""
    s_t = s_t * qk_scale - row_lse[None, :]
    if MASKED:
        seen = (key_pos[:, None] <= tl.load(q_pos + tok)[None, :]) & (rows < n_rows)[None, :]
        s_t = tl.where(seen, s_t, float("-inf"))
    return tl.math.exp2(s_t)


@triton.jit
def _dkdv_ds(p_t, dp_t, row_delta):
    """dS^T = P^T * (dP^T - delta) (also the Gluon dK/dV's)."""
    return p_t * (dp_t - row_delta[None, :])


@triton.jit
def _dkdv_row_ranges(lo, pos0, n_queries, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr):
    """The query-row tiles of keys lo .. lo + BLOCK_KV - 1 (also the Gluon dK/dV's). Query positions
    are consecutive from pos0 (checked by the launcher), so the first query that sees the block and
    the first that sees all of it are known. Row tiles run in increasing order, which fixes the
    order of the sums: [first, full) masked (the diagonal), [full, whole) unmasked (every row sees
    every key), [whole, n_rows) masked (the tile with rows past the sequence)."""
    first = tl.minimum(tl.maximum(lo - pos0, 0), n_queries) * GROUP // BLOCK_Q * BLOCK_Q
    whole = n_queries * GROUP // BLOCK_Q * BLOCK_Q
    sees_all = tl.minimum(tl.maximum(lo + BLOCK_KV - 1 - pos0, 0), n_queries) * GROUP
    return first, tl.maximum(first, tl.minimum(tl.cdiv(sees_all, BLOCK_Q) * BLOCK_Q, whole)), whole


@triton.jit
def _bwd_dkdv_kernel(q, k, v, do, lse, delta, dk, dv, q_begin, q_count, q_pos, page_table, stride_table,
                     page_size, stride_page, stride_head, stride_slot, kv_count, n_heads, qk_scale, scale, n_seqs,
                     GROUP: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr):
    # rank 0: the first keys, which the most queries see
    block, kv_head, seq = _ranked_program(tl.program_id(0), n_heads // GROUP, n_seqs)
    lo = block * BLOCK_KV
    n_keys = tl.load(kv_count + seq)
    if lo >= n_keys:
        return
    key_pos = lo + tl.arange(0, BLOCK_KV)
    key_ok = key_pos < n_keys
    offsets = _kv_offsets(page_table + seq * stride_table, key_pos, page_size, stride_page, stride_slot,
                          key_ok) + kv_head * stride_head
    kb, vb = _load_kv(k, v, offsets, key_ok, D)
    dk_acc = tl.zeros((BLOCK_KV, D), tl.float32)
    dv_acc = tl.zeros((BLOCK_KV, D), tl.float32)
    n_queries = tl.load(q_count + seq)
    q_first = tl.load(q_begin + seq)
    n_rows = n_queries * GROUP
    first, full, whole = _dkdv_row_ranges(lo, tl.load(q_pos + q_first), n_queries, GROUP, BLOCK_Q, BLOCK_KV)
    for row0 in range(first, full, BLOCK_Q):
        dk_acc, dv_acc = _dkdv_tile(q, do, lse, delta, q_pos, kb, vb, key_pos, row0, q_first, n_queries, kv_head,
                                    n_heads, qk_scale, dk_acc, dv_acc, GROUP, D, BLOCK_Q, True)
    for row0 in range(full, whole, BLOCK_Q):
        dk_acc, dv_acc = _dkdv_tile(q, do, lse, delta, q_pos, kb, vb, key_pos, row0, q_first, n_queries, kv_head,
                                    n_heads, qk_scale, dk_acc, dv_acc, GROUP, D, BLOCK_Q, False)
    for row0 in range(tl.maximum(full, whole), n_rows, BLOCK_Q):
        dk_acc, dv_acc = _dkdv_tile(q, do, lse, delta, q_pos, kb, vb, key_pos, row0, q_first, n_queries, kv_head,
                                    n_heads, qk_scale, dk_acc, dv_acc, GROUP, D, BLOCK_Q, True)
    cols = tl.arange(0, D)[None, :]
    tl.store(dk + offsets[:, None] + cols, (dk_acc * scale).to(dk.dtype.element_ty), mask=key_ok[:, None])
    tl.store(dv + offsets[:, None] + cols, dv_acc.to(dv.dtype.element_ty), mask=key_ok[:, None])


@triton.jit
def _delta_kernel(out, grad, delta, n_rows, D: tl.constexpr, BLOCK_R: tl.constexpr):
    """delta[r] = sum over d of out[r, d] * grad[r, d] in fp32 (the row term of dS = P * (dP - delta)),
    BLOCK_R rows of [N * H, D] a program: one read of each input, no fp32 copies. The sum's order
    follows the tile's register layout, the same for every row (one table, aligned rows of D)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < n_rows
    offsets = rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    o = tl.load(out + offsets, mask=ok[:, None], other=0.0).to(tl.float32)
    g = tl.load(grad + offsets, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(delta + rows, tl.sum(o * g, 1), mask=ok)


@triton.jit
def _dq_block(q_tile, do_tile, kb, vb, key_pos, pos, row_lse, row_delta, dq_acc, qk_scale, MASKED: tl.constexpr):
    """Add one key block's share to a query tile's dQ accumulator; MASKED as in _dkdv_tile."""
    ds = _dq_ds(tl.dot(q_tile, tl.trans(kb), input_precision="ieee"), tl.dot(do_tile, tl.trans(vb), input_precision="ieee"),
                key_pos, pos, row_lse, row_delta, qk_scale, MASKED)
    return tl.dot(ds.to(kb.dtype), kb, dq_acc, input_precision="ieee")


@triton.jit
def _dq_ds(s, dp, key_pos, pos, row_lse, row_delta, qk_scale, MASKED: tl.constexpr):
    """dS = P * (dP - delta) of a (query tile, key block) from its q.k products s and dO.v products dp
    (also the Gluon dQ's)."""
    s = s * qk_scale - row_lse[:, None]
    if MASKED:
        s = tl.where(key_pos[None, :] <= pos[:, None], s, float("-inf"))
    return tl.math.exp2(s) * (dp - row_delta[:, None])


@triton.jit
def _bwd_dq_kernel(q, k, v, do, lse, delta, dq, q_begin, q_count, q_pos, page_table, stride_table,
                   page_size, stride_page, stride_head, stride_slot, n_heads, qk_scale, scale, n_seqs, k_desc, v_desc,
                   GROUP: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
                   TMA: tl.constexpr):
    """TMA: K/V are linear, as for _prefill_kernel; the blocks before the tile's last come through
    k_desc/v_desc (blocks of BLOCK_KV keys), the last by masked loads (the same values)."""
    rank, kv_head, seq = _ranked_program(tl.program_id(0), n_heads // GROUP, n_seqs)
    n_queries = tl.load(q_count + seq)
    tile = tl.cdiv(n_queries * GROUP, BLOCK_Q) - 1 - rank  # rank 0: the sequence's latest queries
    if tile < 0:
        return
    rows = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    tok, head = _rows(rows, tl.load(q_begin + seq), n_queries, kv_head, GROUP)
    idx = tok * n_heads + head
    cols = tl.arange(0, D)[None, :]
    q_tile = tl.load(q + idx[:, None] * D + cols)
    do_tile = tl.load(do + idx[:, None] * D + cols)
    row_lse = tl.load(lse + idx)
    row_delta = tl.load(delta + idx)
    pos = tl.load(q_pos + tok)
    hi = tl.max(pos, 0)
    page_row = page_table + seq * stride_table
    k, v = k + kv_head * stride_head, v + kv_head * stride_head
    dq_acc = tl.zeros((BLOCK_Q, D), tl.float32)
    # Blocks in increasing key order fix the order of the sum: [0, full) are seen by every row of the
    # tile (unmasked), [full, last] masked; with TMA every block before the last through descriptors.
    full = (tl.min(pos, 0) + 1) // BLOCK_KV
    last = hi // BLOCK_KV
    lo_loads = 0
    if TMA:
        desc_row = tl.load(page_row) * (stride_page // stride_slot)
        for blk in range(0, tl.minimum(full, last)):
            kb = k_desc.load([desc_row + blk * BLOCK_KV, kv_head * D])
            vb = v_desc.load([desc_row + blk * BLOCK_KV, kv_head * D])
            dq_acc = _dq_block(q_tile, do_tile, kb, vb, blk * BLOCK_KV + tl.arange(0, BLOCK_KV), pos, row_lse,
                               row_delta, dq_acc, qk_scale, False)
        for blk in range(tl.minimum(full, last), last):
            kb = k_desc.load([desc_row + blk * BLOCK_KV, kv_head * D])
            vb = v_desc.load([desc_row + blk * BLOCK_KV, kv_head * D])
            dq_acc = _dq_block(q_tile, do_tile, kb, vb, blk * BLOCK_KV + tl.arange(0, BLOCK_KV), pos, row_lse,
                               row_delta, dq_acc, qk_scale, True)
        lo_loads = last
    for blk in range(lo_loads, tl.maximum(lo_loads, full)):
        kb, vb, key_pos = _block_kv(k, v, page_row, blk, hi, page_size, stride_page, stride_slot, BLOCK_KV, D)
        dq_acc = _dq_block(q_tile, do_tile, kb, vb, key_pos, pos, row_lse, row_delta, dq_acc, qk_scale, False)
    for blk in range(tl.maximum(lo_loads, full), last + 1):
        kb, vb, key_pos = _block_kv(k, v, page_row, blk, hi, page_size, stride_page, stride_slot, BLOCK_KV, D)
        dq_acc = _dq_block(q_tile, do_tile, kb, vb, key_pos, pos, row_lse, row_delta, dq_acc, qk_scale, True)
    tl.store(dq + idx[:, None] * D + cols, (dq_acc * scale).to(dq.dtype.element_ty),
             mask=(rows < n_queries * GROUP)[:, None])


# ---- dK/dV, warp-specialised (Gluon) ---------------------------------------------------------------
# _bwd_dkdv_kernel's tiles (TUNING["bwd_dkdv"], GLUON: 128 keys a program, 64-row query tiles) with the
# schedule written out: each consumer warpgroup owns 64 of the program's keys (their dK/dV elements are
# the same sums: a key's row of a wgmma does not depend on the others), and a producer warp brings
# every query tile's q and dO rows through TMA, once for both. A tile's rows are (query, head) pairs,
# 64 / GROUP queries of GROUP heads: a [queries, GROUP, D] box of the [tokens, heads, D] tensors, in
# the tl kernel's row order. Rows past the sequence read as zeros (the descriptors end with the
# sequence) instead of its last query repeated; _dkdv_probs masks them either way.
@gluon.jit
def _dkdv_ws_producer(q_desc, do_desc, q_smem, do_smem, ready, empty, q_first, kv_head, first, n_rows,
                      GROUP: gl.constexpr, STAGES: gl.constexpr):
    TILE_Q: gl.constexpr = q_desc.block_type.shape[0]  # queries of a tile
    t = 0
    for row0 in range(first, n_rows, TILE_Q * GROUP):
        st = t % STAGES
        mbarrier.wait(empty.index(st), ((t // STAGES) & 1) ^ 1)
        bar = ready.index(st)
        mbarrier.expect(bar, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_first + row0 // GROUP, kv_head * GROUP, 0], bar, q_smem.index(st))
        tma.async_copy_global_to_shared(do_desc, [q_first + row0 // GROUP, kv_head * GROUP, 0], bar,
                                        do_smem.index(st))
        t += 1


@gluon.jit
def _dkdv_ws_consumer(k_smem, v_smem, q_smem, do_smem, ready, empty, dk, dv, lse, delta, q_pos, key0, n_keys,
                      key_offsets_row, stride_slot, q_first, n_queries, kv_head, n_heads, qk_scale, scale, first, full,
                      whole, n_rows, GROUP: gl.constexpr, STAGES: gl.constexpr):
    """Keys key0 .. key0 + 63 of the program: every query tile from `first` on, in increasing order,
    masked in [first, full) and [whole, n_rows) as _bwd_dkdv_kernel's loops. A tile's lse and delta
    are loaded before its first product, which hides their latency."""
    KEYS: gl.constexpr = k_smem.shape[0]
    D: gl.constexpr = k_smem.shape[1]
    ROWS: gl.constexpr = q_smem.shape[1] * q_smem.shape[2]
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    key_pos = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, S_L))
    s0 = gl.zeros([KEYS, ROWS], gl.float32, S_L)
    dk_acc = gl.zeros([KEYS, D], gl.float32, O_L)
    dv_acc = gl.zeros([KEYS, D], gl.float32, O_L)
    t = 0
    for row0 in range(first, n_rows, ROWS):
        st = t % STAGES
        mbarrier.wait(ready.index(st), (t // STAGES) & 1)
        q_tile = q_smem.index(st).reshape([ROWS, D])
        do_tile = do_smem.index(st).reshape([ROWS, D])
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, S_L))
        tok, head = _rows(rows, q_first, n_queries, kv_head, GROUP)
        idx = tok * n_heads + head
        row_lse = gl.load(lse + idx)
        row_delta = gl.load(delta + idx)
        s_t = warpgroup_mma(k_smem, q_tile.permute((1, 0)), s0, use_acc=False)
        if (row0 < full) | (row0 >= whole):
            p_t = _dkdv_probs(s_t, key_pos, q_pos, tok, rows, row_lse, n_rows, qk_scale, True)
        else:
            p_t = _dkdv_probs(s_t, key_pos, q_pos, tok, rows, row_lse, n_rows, qk_scale, False)
        dv_acc = warpgroup_mma(gl.convert_layout(p_t.to(do_tile.dtype), gl.DotOperandLayout(0, O_L, 2)), do_tile,
                               dv_acc)
        dp_t = warpgroup_mma(v_smem, do_tile.permute((1, 0)), s0, use_acc=False)
        ds_t = _dkdv_ds(p_t, dp_t, row_delta)
        dk_acc = warpgroup_mma(gl.convert_layout(ds_t.to(q_tile.dtype), gl.DotOperandLayout(0, O_L, 2)), q_tile,
                               dk_acc)
        mbarrier.arrive(empty.index(st), count=1)
        t += 1
    keys = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, O_L))
    offsets = (key_offsets_row + keys.to(gl.int64) * stride_slot)[:, None] + gl.arange(0, D, layout=gl.SliceLayout(
        0, O_L))[None, :]
    keep = (keys < n_keys)[:, None]
    gl.store(dk + offsets, (dk_acc * scale).to(dk.dtype.element_ty), mask=keep)
    gl.store(dv + offsets, dv_acc.to(dv.dtype.element_ty), mask=keep)


@gluon.jit
def _bwd_dkdv_ws_kernel(q, k, v, do, lse, delta, dk, dv, q_begin, q_count, q_pos, page_table, stride_table,
                        stride_page, stride_head, stride_slot, kv_count, n_heads, qk_scale, scale, n_seqs,
                        GROUP: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    """_bwd_dkdv_kernel over a linear K/V at 128 keys and 64-row query tiles, warp-specialised."""
    block, kv_head, seq = _ranked_program(gl.program_id(0), n_heads // GROUP, n_seqs)  # as _bwd_dkdv_kernel's
    lo = block * _WS_TILE
    n_keys = gl.load(kv_count + seq)
    if lo >= n_keys:
        return
    dtype: gl.constexpr = q.dtype.element_ty
    TILE_Q: gl.constexpr = _WS_HALF // GROUP
    LOAD_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    KS_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_WS_HALF, D], dtype)
    QS_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_Q, GROUP, D], dtype)
    # the program's keys as the tl kernel loads them (past the sequence: zeros), a half a consumer
    key_row = gl.load(page_table + seq * stride_table).to(gl.int64) * stride_page + kv_head * stride_head
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD_L))
    k0_smem = gl.allocate_shared_memory(dtype, [_WS_HALF, D], KS_L)
    k1_smem = gl.allocate_shared_memory(dtype, [_WS_HALF, D], KS_L)
    v0_smem = gl.allocate_shared_memory(dtype, [_WS_HALF, D], KS_L)
    v1_smem = gl.allocate_shared_memory(dtype, [_WS_HALF, D], KS_L)
    for half in gl.static_range(2):
        keys = lo + half * _WS_HALF + gl.arange(0, _WS_HALF, layout=gl.SliceLayout(1, LOAD_L))
        at = (key_row + keys.to(gl.int64) * stride_slot)[:, None] + cols[None, :]
        ok = (keys < n_keys)[:, None]
        if half == 0:
            k0_smem.store(gl.load(k + at, mask=ok, other=0.0))
            v0_smem.store(gl.load(v + at, mask=ok, other=0.0))
        else:
            k1_smem.store(gl.load(k + at, mask=ok, other=0.0))
            v1_smem.store(gl.load(v + at, mask=ok, other=0.0))
    n_queries = gl.load(q_count + seq)
    q_first = gl.load(q_begin + seq)
    n_rows = n_queries * GROUP
    first, full, whole = _dkdv_row_ranges(lo, gl.load(q_pos + q_first), n_queries, GROUP, _WS_HALF, _WS_TILE)
    # the sequence's q and dO rows only: a tile's rows past it read as zeros (never another's values)
    q_desc = tma.make_tensor_descriptor(q, [q_first + n_queries, n_heads, D], [n_heads * D, D, 1], [TILE_Q, GROUP, D],
                                        QS_L)
    do_desc = tma.make_tensor_descriptor(do, [q_first + n_queries, n_heads, D], [n_heads * D, D, 1],
                                         [TILE_Q, GROUP, D], QS_L)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE_Q, GROUP, D], QS_L)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE_Q, GROUP, D], QS_L)
    ready, empty = ring_barriers(STAGES)
    fence_async_shared()  # the k and v stores, before the wgmmas read them
    gl.warp_specialize([
        (_dkdv_ws_consumer, (k0_smem, v0_smem, q_smem, do_smem, ready, empty, dk, dv, lse, delta, q_pos, lo, n_keys,
                             key_row, stride_slot, q_first, n_queries, kv_head, n_heads, qk_scale, scale, first, full,
                             whole, n_rows, GROUP, STAGES)),
        (_dkdv_ws_consumer, (k1_smem, v1_smem, q_smem, do_smem, ready, empty, dk, dv, lse, delta, q_pos,
                             lo + _WS_HALF, n_keys, key_row, stride_slot, q_first, n_queries, kv_head, n_heads,
                             qk_scale, scale, first, full, whole, n_rows, GROUP, STAGES)),
        (_dkdv_ws_producer, (q_desc, do_desc, q_smem, do_smem, ready, empty, q_first, kv_head, first, n_rows, GROUP,
                             STAGES)),
    ], [4, 1], [_WS_CONSUMER_REGISTERS, _WS_PRODUCER_REGISTERS])
    invalidate_ring(ready, empty, STAGES)


# ---- dQ, warp-specialised (Gluon) ------------------------------------------------------------------
# _bwd_dq_kernel's sums (TUNING["bwd_dq"]: 64-row query tiles, BLOCK_KV-key blocks in increasing
# order, the blocks every row sees whole unmasked) with the schedule written out: a program holds two
# 64-row tiles, a consumer warpgroup each, and a producer warp brings every key block's K and V
# through TMA once for both (over a linear K/V: one descriptor, made on the device, that ends at the
# program's last key). A consumer's rows see keys up to its own last position; the blocks past its
# own last it waits for and frees without computing, as the tl kernel never loads them. Keys past a
# row's position in its last block hold their values here (the tl kernel's masked loads give zeros):
# their probabilities are exact zeros either way, so their dS terms add nothing.
@gluon.jit
def _dq_ws_producer(k_desc, v_desc, k_smem, v_smem, ready, empty, desc_row, col, last, STAGES: gl.constexpr):
    """K/V blocks 0 .. last (rows desc_row + blk * BLOCK_KV of the descriptors) into the ring, in
    order (a slot refilled once both consumers freed it)."""
    BLOCK_KV: gl.constexpr = k_desc.block_type.shape[0]
    for blk in range(0, last + 1):
        st = blk % STAGES
        mbarrier.wait(empty.index(st), ((blk // STAGES) & 1) ^ 1)
        bar = ready.index(st)
        mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [desc_row + blk * BLOCK_KV, col], bar, k_smem.index(st))
        tma.async_copy_global_to_shared(v_desc, [desc_row + blk * BLOCK_KV, col], bar, v_smem.index(st))


@gluon.jit
def _dq_ws_ds(s, dp, blk, pos, row_lse, row_delta, qk_scale, full, O_L: gl.constexpr, DTYPE: gl.constexpr):
    """_dq_ds of key block blk (unmasked before block `full`) as the A operand (DTYPE) of the dQ wgmma."""
    BLOCK_KV: gl.constexpr = s.shape[1]
    key_pos = blk * BLOCK_KV + gl.arange(0, BLOCK_KV, layout=gl.SliceLayout(0, s.type.layout))
    if blk < full:
        ds = _dq_ds(s, dp, key_pos, pos, row_lse, row_delta, qk_scale, False)
    else:
        ds = _dq_ds(s, dp, key_pos, pos, row_lse, row_delta, qk_scale, True)
    return gl.convert_layout(ds.to(DTYPE), gl.DotOperandLayout(0, O_L, 2))


@gluon.jit
def _dq_ws_consumer(q_smem, do_smem, k_smem, v_smem, ready, empty, dq, lse, delta, q_pos, begin, n_queries, row0,
                    kv_head, n_heads, qk_scale, scale, last, GROUP: gl.constexpr, STAGES: gl.constexpr,
                    Q_REGS: gl.constexpr):
    """Rows row0 .. row0 + 63 of the program: dQ over blocks 0 .. their own last, in order (as
    _bwd_dq_kernel's loops), then freeing the program's later blocks. Q_REGS: q and dO in registers,
    the A operands of the q.k and dO.v wgmmas."""
    ROWS: gl.constexpr = q_smem.shape[0]
    D: gl.constexpr = q_smem.shape[1]
    BLOCK_KV: gl.constexpr = k_smem.shape[1]
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_KV, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, S_L))
    tok, head = _rows(rows, begin, n_queries, kv_head, GROUP)
    idx = tok * n_heads + head
    row_lse = gl.load(lse + idx)
    row_delta = gl.load(delta + idx)
    pos = gl.load(q_pos + tok)
    full = (gl.min(pos, 0) + 1) // BLOCK_KV
    mine = gl.max(pos, 0) // BLOCK_KV
    n_mine = mine + 1  # the blocks this consumer computes: none where its rows lie past the sequence
    if row0 >= n_queries * GROUP:
        n_mine = 0
    s0 = gl.zeros([ROWS, BLOCK_KV], gl.float32, S_L)
    dq_acc = gl.zeros([ROWS, D], gl.float32, O_L)
    if n_mine > 0:
        # block blk's q.k and dO.v run while block blk - 1's dQ product does, and block blk's dS
        # while that product finishes: block 0's products and dS first, the last block's dQ after
        q_op, do_op = _wgmma_a(q_smem, S_L, Q_REGS), _wgmma_a(do_smem, S_L, Q_REGS)
        mbarrier.wait(ready.index(0), 0)
        s = warpgroup_mma(q_op, k_smem.index(0).permute((1, 0)), s0, use_acc=False)
        dp = warpgroup_mma(do_op, v_smem.index(0).permute((1, 0)), s0, use_acc=False)
        ds = _dq_ws_ds(s, dp, 0, pos, row_lse, row_delta, qk_scale, full, O_L, k_smem.dtype)
        for blk in range(1, n_mine):
            st = blk % STAGES
            prev = (blk - 1) % STAGES
            mbarrier.wait(ready.index(st), (blk // STAGES) & 1)
            s = warpgroup_mma(q_op, k_smem.index(st).permute((1, 0)), s0, use_acc=False, is_async=True)
            dp = warpgroup_mma(do_op, v_smem.index(st).permute((1, 0)), s0, use_acc=False, is_async=True)
            dq_acc = warpgroup_mma(ds, k_smem.index(prev), dq_acc, is_async=True)
            s, dp = warpgroup_mma_wait(num_outstanding=1, deps=(s, dp))
            ds_next = _dq_ws_ds(s, dp, blk, pos, row_lse, row_delta, qk_scale, full, O_L, k_smem.dtype)
            dq_acc, ds = warpgroup_mma_wait(num_outstanding=0, deps=(dq_acc, ds))
            mbarrier.arrive(empty.index(prev), count=1)
            ds = ds_next
        st = (n_mine - 1) % STAGES
        dq_acc = warpgroup_mma(ds, k_smem.index(st), dq_acc)
        mbarrier.arrive(empty.index(st), count=1)
    for blk in range(n_mine, last + 1):  # the other consumer's blocks
        st = blk % STAGES
        mbarrier.wait(ready.index(st), (blk // STAGES) & 1)
        mbarrier.arrive(empty.index(st), count=1)
    rows = gl.convert_layout(rows, gl.SliceLayout(1, O_L))
    tok, head = _rows(rows, begin, n_queries, kv_head, GROUP)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, O_L))
    gl.store(dq + (tok * n_heads + head)[:, None] * D + cols[None, :], (dq_acc * scale).to(dq.dtype.element_ty),
             mask=(rows < n_queries * GROUP)[:, None])


@gluon.jit
def _bwd_dq_ws_kernel(q, k, v, do, lse, delta, dq, q_begin, q_count, q_pos, page_table, stride_table, page_rows,
                      head_rows, head_cols, stride_slot, kv_width, n_heads, qk_scale, scale, n_seqs,
                      GROUP: gl.constexpr, D: gl.constexpr, BLOCK_KV: gl.constexpr, STAGES: gl.constexpr,
                      Q_REGS: gl.constexpr):
    """_bwd_dq_kernel over a linear K/V read through its _TmaView (a sequence's keys are consecutive
    rows from its page's first, kv head h's at row offset h * head_rows, column h * head_cols), 128
    rows a program, warp-specialised. Q_REGS: TUNING["bwd_dq"]'s GLUON_Q_REGS (_dq_ws_consumer's)."""
    rank, kv_head, seq = _ranked_program(gl.program_id(0), n_heads // GROUP, n_seqs)  # as _bwd_dq_kernel's
    begin = gl.load(q_begin + seq)
    n_queries = gl.load(q_count + seq)
    tile = gl.cdiv(n_queries * GROUP, _WS_TILE) - 1 - rank  # rank 0: the sequence's latest queries
    if tile < 0:
        return
    dtype: gl.constexpr = q.dtype.element_ty
    LOAD_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    QS_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_WS_HALF, D], dtype)
    KV_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_KV, D], dtype)
    rows = tile * _WS_TILE + gl.arange(0, _WS_TILE, layout=gl.SliceLayout(1, LOAD_L))
    tok, _ = _rows(rows, begin, n_queries, kv_head, GROUP)
    hi = gl.max(gl.load(q_pos + tok), 0)
    q0_smem = gl.allocate_shared_memory(dtype, [_WS_HALF, D], QS_L)
    q1_smem = gl.allocate_shared_memory(dtype, [_WS_HALF, D], QS_L)
    do0_smem = gl.allocate_shared_memory(dtype, [_WS_HALF, D], QS_L)
    do1_smem = gl.allocate_shared_memory(dtype, [_WS_HALF, D], QS_L)
    _load_rows_to_shared(q, tile * _WS_TILE, begin, n_queries, kv_head, n_heads, q0_smem, GROUP, LOAD_L)
    _load_rows_to_shared(q, tile * _WS_TILE + _WS_HALF, begin, n_queries, kv_head, n_heads, q1_smem, GROUP, LOAD_L)
    _load_rows_to_shared(do, tile * _WS_TILE, begin, n_queries, kv_head, n_heads, do0_smem, GROUP, LOAD_L)
    _load_rows_to_shared(do, tile * _WS_TILE + _WS_HALF, begin, n_queries, kv_head, n_heads, do1_smem, GROUP, LOAD_L)
    # the sequence's keys up to hi: TMA reads the rows past it as zeros
    desc_row = gl.load(page_table + seq * stride_table) * page_rows + kv_head * head_rows
    k_desc = tma.make_tensor_descriptor(k, [desc_row + hi + 1, kv_width], [stride_slot, 1], [BLOCK_KV, D], KV_L)
    v_desc = tma.make_tensor_descriptor(v, [desc_row + hi + 1, kv_width], [stride_slot, 1], [BLOCK_KV, D], KV_L)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_KV, D], KV_L)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_KV, D], KV_L)
    ready, empty = ring_barriers(STAGES)
    fence_async_shared()  # the q and dO stores, before the wgmmas read them
    last = hi // BLOCK_KV
    gl.warp_specialize([
        (_dq_ws_consumer, (q0_smem, do0_smem, k_smem, v_smem, ready, empty, dq, lse, delta, q_pos, begin, n_queries,
                           tile * _WS_TILE, kv_head, n_heads, qk_scale, scale, last, GROUP, STAGES, Q_REGS)),
        (_dq_ws_consumer, (q1_smem, do1_smem, k_smem, v_smem, ready, empty, dq, lse, delta, q_pos, begin, n_queries,
                           tile * _WS_TILE + _WS_HALF, kv_head, n_heads, qk_scale, scale, last, GROUP, STAGES,
                           Q_REGS)),
        (_dq_ws_producer, (k_desc, v_desc, k_smem, v_smem, ready, empty, desc_row, kv_head * head_cols, last, STAGES)),
    ], [4, 1], [_WS_CONSUMER_REGISTERS, _WS_PRODUCER_REGISTERS])
    invalidate_ring(ready, empty, STAGES)


# ---- host side: where each sequence's queries and keys are -----------------------------------------

class _Queries(NamedTuple):
    """Queries packed as [N, H, D] (contiguous); sequence r owns rows begin[r] .. begin[r]+count[r]-1.
    from_lens (the paged layout): `begin` is the [R+1] query_start_loc, `count` is None and `pos` the
    [R] seq_lens; the forward kernels derive each sequence's count and its queries' positions (its
    last count positions) from them, so a decode step computes no per-token tensor per layer."""
    q: torch.Tensor
    begin: torch.Tensor  # [R] int32 ([R+1] from_lens)
    count: torch.Tensor | None  # [R] int32 (None from_lens)
    pos: torch.Tensor  # [N] int32, absolute position of every query ([R] keys per sequence from_lens)
    max_count: int
    n_seqs: int
    from_lens: bool = False


class _Keys(NamedTuple):
    """K/V seen as pages: the key at position p of sequence r lives in page table[r, p // page_size],
    slot p % page_size. A packed or padded K/V is one page per sequence (page_size = _LINEAR_PAGE)."""
    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor  # [R, pages] int32
    page_size: int
    stride_page: int
    stride_head: int
    stride_slot: int
    n_heads: int
    count: torch.Tensor  # [R] int32 keys of each sequence
    max_count: int


@triton.jit
def _varlen_positions_kernel(cu, pos, BLOCK: tl.constexpr):
    """pos[t] = t - cu[r] for every token t of sequence r (a program a sequence)."""
    r = tl.program_id(0)
    begin = tl.load(cu + r)
    end = tl.load(cu + r + 1)
    for t0 in range(begin, end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        tl.store(pos + t, t - begin, mask=t < end)


def _varlen_positions(cu: torch.Tensor, n: int) -> torch.Tensor:
    """[n] int32: each packed token's index within its sequence of cu [B+1], in one launch (the torch
    ops that computed it took six; _varlen_layout's host time was 0.10-0.16 ms with them on the
    H200's host)."""
    pos = torch.empty(n, device=cu.device, dtype=torch.int32)
    if cu.numel() > 1:
        _varlen_positions_kernel[(cu.numel() - 1,)](cu, pos, BLOCK=1024)
    return pos


def _varlen_layout(q, k, v, cu_seqlens, max_seqlen: int | None) -> tuple[_Queries, _Keys]:
    """max_seqlen (the caller's bound on the longest sequence) sizes the grids; without it, one
    device-to-host read of the longest."""
    cu = cu_seqlens.int()
    begin, count = cu[:-1], cu[1:] - cu[:-1]
    if max_seqlen is not None:
        max_count = max_seqlen
    else:
        max_count = int(count.max()) if count.numel() else 0
    pos = _varlen_positions(cu.contiguous(), q.shape[0])
    k, v = k.contiguous(), v.contiguous()
    keys = _Keys(k, v, begin[:, None].contiguous(), _LINEAR_PAGE, k.stride(0), k.stride(1), k.stride(0),
                 k.shape[1], count, max_count)
    return _Queries(q.contiguous(), begin, count, pos, max_count, count.numel()), keys


def _padded_layout(q, k, v, q_pos) -> tuple[_Queries, _Keys]:
    b, tq, h, d = q.shape
    s = k.shape[1]
    dev = q.device
    rows = torch.arange(b, device=dev, dtype=torch.int32)
    k, v = k.contiguous(), v.contiguous()
    keys = _Keys(k, v, rows[:, None].contiguous(), _LINEAR_PAGE, k.stride(0), k.stride(2), k.stride(1),
                 k.shape[2], torch.full((b,), s, device=dev, dtype=torch.int32), s)
    queries = _Queries(q.reshape(b * tq, h, d).contiguous(), rows * tq,
                       torch.full((b,), tq, device=dev, dtype=torch.int32), q_pos.reshape(-1).int(), tq, b)
    return queries, keys


def _paged_layout(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, max_query_len,
                  max_seq_len) -> tuple[_Queries, _Keys]:
    """The maxima size the grids; given by the caller, they spare a device-to-host sync (and let
    the call be captured in a CUDA graph)."""
    qsl, seq_lens = query_start_loc.int().contiguous(), seq_lens.int().contiguous()
    n_seqs = qsl.numel() - 1
    if max_query_len is None or max_seq_len is None:
        count = qsl[1:] - qsl[:-1]
        max_query_len, max_seq_len = torch.stack([count.max(), seq_lens.max()]).tolist() if n_seqs else (0, 0)
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("paged_attention: k_cache and v_cache must share strides with a contiguous last dim")
    keys = _Keys(k_cache, v_cache, block_table.int().contiguous(), k_cache.shape[2], k_cache.stride(0),
                 k_cache.stride(1), k_cache.stride(2), k_cache.shape[1], seq_lens, max_seq_len)
    return _Queries(q.contiguous(), qsl, None, seq_lens, max_query_len, n_seqs, from_lens=True), keys


# ---- launchers -----------------------------------------------------------------------------------

def _check(queries: _Queries, keys: _Keys) -> None:
    d = queries.q.shape[2]
    if queries.q.dtype != keys.k.dtype:
        raise ValueError(f"attention (triton): queries are {queries.q.dtype} but keys are {keys.k.dtype}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"attention (triton): head_dim {d} must be a power of two >= 16")
    if KV_CHUNK % KV_BLOCK or KV_BLOCK < 16 or KV_BLOCK & (KV_BLOCK - 1):
        raise ValueError(f"attention (triton): KV_BLOCK {KV_BLOCK} must be a power of two >= 16 dividing "
                         f"KV_CHUNK {KV_CHUNK}")


def _query_args(queries: _Queries) -> tuple:
    """q_begin, q_count, q_pos of the forward kernels (from_lens: q_count is unused)."""
    return (queries.begin, queries.begin if queries.from_lens else queries.count, queries.pos)


def _page_args(keys: _Keys) -> tuple:
    return (keys.table, keys.table.stride(0), keys.page_size, keys.stride_page, keys.stride_head, keys.stride_slot)


def _forward(queries: _Queries, keys: _Keys, scale: float, decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [N, H, D], lse [N, H] in log2 units). decode: single-query sequences go to the split
    decode kernels (whose programs exit at once for other sequences) and the prefill kernel, launched
    only when some sequence has more than one query, skips them."""
    _check(queries, keys)
    q = queries.q
    n, h, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((n, h), device=q.device, dtype=torch.float32)
    n_seqs = queries.n_seqs
    if n == 0:
        return out, lse
    group, qk_scale = h // keys.n_heads, scale * _LOG2E
    seq_args = (*_query_args(queries), *_page_args(keys), h, qk_scale)
    if decode:
        _decode(queries, keys, out, lse, group, qk_scale)
    if queries.max_count > 1 or not decode:
        linear = keys.page_size == _LINEAR_PAGE
        cfg = TUNING["prefill_linear" if linear else "prefill"]
        view = _gluon_view(keys) if cfg.get("GLUON") else None
        if view is not None:
            _prefill_ws(queries, keys, view, out, lse, group, qk_scale, 2 if decode else 1,
                        cfg, "prefill_linear" if linear else "prefill")
            return out, lse
        descs = _descriptors(keys, KV_BLOCK) if linear and cfg.get("TMA") else (None, None)
        tiles = triton.cdiv(queries.max_count * group, cfg["BLOCK_Q"])
        _prefill_kernel[_ranked_grid(tiles, keys, n_seqs)](
            q, keys.k, keys.v, out, lse, *seq_args, 2 if decode else 1, n_seqs, *descs, GROUP=group, D=d,
            BLOCK_Q=cfg["BLOCK_Q"], KV_BLOCK=KV_BLOCK, KV_CHUNK=KV_CHUNK, PREFETCH=cfg["PREFETCH"],
            FROM_LENS=queries.from_lens, TMA=descs[0] is not None, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
    return out, lse


def _ranked_grid(ranks: int, keys: _Keys, n_seqs: int) -> tuple[int]:
    """The 1-D grid of _ranked_program: `ranks` programs per (kv head, sequence), rank-major."""
    return (ranks * keys.n_heads * n_seqs,)


class _TmaView(NamedTuple):
    """How the kernels read a K/V through TMA: as a [rows, width] matrix of row pitch
    keys.stride_slot, the key in slot s of page p of kv head h at row p * page_rows + h * head_rows
    + s, column h * head_cols; _prefill_ws_kernel in boxes of `box` keys (each inside one page)."""
    box: int
    page_rows: int
    head_rows: int
    head_cols: int
    rows: int
    width: int


def _gluon_view(keys: _Keys) -> _TmaView | None:
    """keys' _TmaView where the Gluon forward runs (_on_gluon) and can read them, else None."""
    return _tma_view(keys) if _on_gluon(keys.k) else None


def _tma_view(keys: _Keys) -> _TmaView | None:
    """keys' _TmaView, or None where TMA cannot read them so: K and V of one layout with contiguous
    head dims and 16-byte aligned slots, a kv head a run of rows (a paged cache: vLLM's, the
    benchmarks') or of columns (a linear K/V: [tokens, kv heads, D]), and pages whose TMA boxes stay
    in one page: a linear K/V, a multiple of the 64-key block, or a divisor of it that is a multiple
    of 8 slots (the 128-byte swizzle's period)."""
    k, v = keys.k, keys.v
    d, slot = k.shape[-1], keys.stride_slot
    if not (k.stride() == v.stride() and k.stride(-1) == 1 and is_aligned(k) and is_aligned(v)
            and (slot * k.element_size()) % ALIGN_BYTES == 0 and keys.stride_page % slot == 0):
        return None
    if keys.stride_head % slot == 0:
        head_rows, head_cols, width = keys.stride_head // slot, 0, d
    elif keys.stride_head == d and keys.n_heads * d <= slot:
        head_rows, head_cols, width = 0, d, keys.n_heads * d
    else:
        return None
    page = keys.page_size
    if page == _LINEAR_PAGE or page % KV_BLOCK == 0:
        box = KV_BLOCK
    elif KV_BLOCK % page == 0 and page % 8 == 0:
        box = page
    else:
        return None
    page_rows = keys.stride_page // slot
    return _TmaView(box, page_rows, head_rows, head_cols, k.shape[0] * page_rows, width)


def _prefill_ws(queries: _Queries, keys: _Keys, view: _TmaView, out, lse, group: int, qk_scale: float,
                min_queries: int, cfg: dict, entry: str, ablate: int = 0) -> None:
    """_prefill_ws_kernel over sequences with at least min_queries queries (TUNING[entry]: cfg);
    ablate: the kernel's ABLATE (benchmarks/probe_prefill.py's; 0, the whole kernel, everywhere else)."""
    if cfg["GLUON_STAGES"] < 2:  # a consumer frees a block's slot after waiting for the next block
        raise ValueError(f"attention (triton): TUNING['{entry}'] has GLUON with GLUON_STAGES="
                         f"{cfg['GLUON_STAGES']}; the Gluon forward's ring needs at least 2")
    q, d = queries.q, queries.q.shape[2]
    k_all, v_all = (gluon_descriptor(t.as_strided((view.rows, view.width), (keys.stride_slot, 1)), [view.box, d])
                    for t in (keys.k, keys.v))
    install_descriptor_allocator(q.device)  # the tile's end descriptors are made on the device
    n_seqs = queries.n_seqs
    _prefill_ws_kernel[_ranked_grid(triton.cdiv(queries.max_count * group, _WS_TILE.value), keys, n_seqs)](
        q, keys.k, keys.v, out, lse, *_query_args(queries), keys.table, keys.table.stride(0), keys.page_size,
        view.page_rows, view.head_rows, view.head_cols, keys.stride_slot, view.width, q.shape[1], qk_scale,
        min_queries, n_seqs, k_all, v_all, GROUP=group, D=d, KV_BLOCK=KV_BLOCK, KV_CHUNK=KV_CHUNK, BOX=view.box,
        STAGES=cfg["GLUON_STAGES"], FROM_LENS=queries.from_lens, Q_REGS=cfg["GLUON_Q_REGS"], ABLATE=ablate,
        num_warps=4)


def _tma_capable(t: torch.Tensor) -> bool:
    """TMA loads for t's blocks: 16-bit t on Hopper or later (the tables' stages of fp32 blocks would
    not fit shared memory), or the interpreter (which emulates descriptors, for the CPU tests)."""
    return INTERPRETING or (t.is_cuda and t.element_size() == 2 and torch.cuda.get_device_capability(t.device)[0] >= 9)


def _descriptors(keys: _Keys, block: int) -> tuple[TensorDescriptor | None, TensorDescriptor | None]:
    """TMA descriptors of a linear K/V as [rows, kv heads * D] matrices (its _TmaView) of block x D
    blocks for the tl kernels, or (None, None) where TMA cannot take it: no device with TMA
    (_tma_capable), a layout TMA cannot address, or a paged K/V."""
    view = _tma_view(keys) if _tma_capable(keys.k) and keys.page_size == _LINEAR_PAGE else None
    if view is None:
        return None, None
    d = keys.k.shape[-1]
    return tuple(TensorDescriptor(t, [view.rows, view.width], [keys.stride_slot, 1], [block, d])
                 for t in (keys.k, keys.v))


def _on_gluon(t: torch.Tensor) -> bool:
    """Whether the Gluon kernels (_prefill_ws_kernel, _bwd_dkdv_ws_kernel, _bwd_dq_ws_kernel) can run on t's device and
    tiles: 16-bit on Hopper itself (their MMAs are wgmma), a head dim whose tiles fit shared memory
    (D <= 128), outside the interpreter. Each launcher adds what its TMA loads need."""
    return (not INTERPRETING and t.is_cuda and t.element_size() == 2
            and torch.cuda.get_device_capability(t.device)[0] == 9 and t.shape[-1] <= 128)


def decode_swapped(head_dim: int) -> bool:
    """Whether decode tiles run their dots with the operands swapped (_fold_block's SWAP): as the
    table says, where every M side of them (the key block, the head dim) keeps them on wgmma."""
    return bool(TUNING["decode"]["SWAP"]) and min(head_dim, KV_BLOCK) >= _WGMMA_M


def decode_rows(group: int, head_dim: int) -> int:
    """Rows of a decode tile: the group's query heads, padded to the tl.dot minimum as the N side of
    swapped dots, else to the M side's MIN_ROWS."""
    pad = _SUM_COLS.value if decode_swapped(head_dim) else TUNING["decode"]["MIN_ROWS"]
    return max(pad, triton.next_power_of_2(group))


def _decode(queries: _Queries, keys: _Keys, out, lse, group: int, qk_scale: float) -> None:
    q = queries.q
    d, n_seqs = q.shape[2], queries.n_seqs
    cfg = TUNING["decode"]
    swapped = decode_swapped(d)
    if swapped and cfg["num_stages"] < 2:
        raise ValueError("attention (triton): TUNING['decode'] has num_stages=1 with SWAP: swapped decode tiles "
                         "unpipelined made an illegal memory access on an H200 (Triton 3.6); use num_stages >= 2")
    n_chunks = triton.cdiv(keys.max_count, KV_CHUNK)
    pairs = n_seqs * keys.n_heads
    walks, per_split, stages, flat_stages = _decode_grid(pairs, n_chunks, resident_programs(q.device), cfg)
    split = pairs - walks  # pairs split across programs: their chunk states go through memory
    one_chunk = bool(split and n_chunks <= per_split)
    kwargs = dict(GROUP=group, ROWS=decode_rows(group, d), MERGE_ROWS=triton.next_power_of_2(group), D=d,
                  KV_BLOCK=KV_BLOCK, KV_CHUNK=KV_CHUNK, WALKS=walks > 0, SPLITS=split > 0, PREFETCH=cfg["PREFETCH"],
                  FROM_LENS=queries.from_lens, SWAP=swapped, PAGE_SHIFT=decode_page_shift(keys.page_size),
                  FLAT_STAGES=flat_stages, ONE_CHUNK=one_chunk, num_warps=cfg["num_warps"], num_stages=stages)
    cluster = _decode_cluster(walks, per_split, n_chunks, pairs, resident_programs(q.device), d, cfg)
    if cluster > 1 and not INTERPRETING and _cluster.supported(q.device):
        # each pair's programs one cluster: no chunk state goes through memory, no ticket
        unused = lse  # (the states' and tickets' pointers: a clustered kernel takes neither)
        args = (q, keys.k, keys.v, out, lse, unused, unused, unused, unused, *_query_args(queries), *_page_args(keys),
                q.shape[1], qk_scale, n_chunks, 0, cluster, keys.table.shape[1])
        if _cluster.cluster_launch(_decode_chunk_kernel, (split, 1, 1), cluster, cluster_buffer_bytes(group, d), *args,
                                   CLUSTER=cluster, **kwargs):
            return
    states = (split, n_chunks, group) if split else (1,)
    part_m = torch.empty(states, device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((*states, d), device=q.device, dtype=torch.float32)
    # ticket counters (one per split pair; a walk takes none) that the merging programs leave at zero
    tickets = zeroed_tickets(q.device, max(split, 1))
    # walks alone keep a (1, kv heads, sequences) grid: on the 1-D one the deep walk ran 4-5% slower in
    # an A/B (the twenty-fourth session; the same loop by ptxas), for no reason found
    grid = (walks + split * per_split, 1, 1) if split else (1, keys.n_heads, n_seqs)
    _decode_chunk_kernel[grid](
        q, keys.k, keys.v, out, lse, part_m, part_l, part_acc, tickets, *_query_args(queries),
        *_page_args(keys), q.shape[1], qk_scale, n_chunks, walks, per_split, keys.table.shape[1], **kwargs)


def _decode_cluster(walks: int, per_split: int, n_chunks: int, pairs: int, sms: int, head_dim: int,
                    cfg: dict) -> int:
    """CTAs a cluster of the decode grid (_decode_grid's walks and per_split) over `pairs` pairs of at
    most n_chunks chunks, TUNING["decode"]'s CLUSTER_MAX and CLUSTER_FILL (of `sms` SMs); 1: no
    cluster. Only a grid of one-chunk splits alone clusters (no walk, per_split >= n_chunks). A
    cluster is a power of two of CTAs (each merges head_dim / cluster columns), the first at least
    n_chunks: one chunk a CTA, as the grid's programs, CTAs past a sequence's chunks only merging; 4
    warps a CTA (the occupancy query's CTAs: _cluster.cluster_launch)."""
    cluster = triton.next_power_of_2(n_chunks)
    if (walks or n_chunks < 2 or per_split < n_chunks or cluster > cfg["CLUSTER_MAX"] or head_dim % cluster
            or pairs * cluster > cfg["CLUSTER_FILL"] * sms or cfg["num_warps"] != 4):
        return 1
    return cluster


def decode_page_shift(page_size: int) -> int:
    """The decode kernel's PAGE_SHIFT: log2 of a power-of-two page size (vLLM's 16; a packed or padded
    K/V's _LINEAR_PAGE), else -1 (a division, e.g. a 48-key page). The twenty-fourth session (H200,
    CUDA graphs, 16-key pages, bits equal): 1.01-1.06x the division at batch 1-256."""
    return page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1


def _decode_grid(pairs: int, n_chunks: int, sms: int, cfg: dict) -> tuple[int, int, int, int]:
    """(walks, per_split, num_stages, flat_stages) of the decode grid (TUNING["decode"]: cfg) for
    `pairs` (sequence, kv head) pairs of at most n_chunks chunks: the first `walks` pairs get one
    program each, every later pair per_split programs. A wave holds PROGRAMS_PER_SM programs an SM (its slots):
    - one walk a pair where those walks, at most WALK_PER_SM an SM, fill at least WALK_FILL of their
      waves of one walk an SM: on the WALK_STAGES ring;
    - fewer pairs than slots: each pair's chunks split across as many programs as make one wave, at
      most one a chunk (a second, part-full wave of a program's whole walk costs more than the split
      saves), on the deeper SPLIT_STAGES ring (SPLIT_PER_SM an SM) where that still splits each pair,
      a program's several chunks in one loop on FLAT_STAGES' ring there (flat_stages; 0 elsewhere:
      a loop a chunk), else on the table's; one program a pair where the batch alone fills the wave;
    - more pairs than slots: one program a pair on the deeper WALK_STAGES ring where _walk_fits, else
      on the table's, and with SPLIT_TAIL the pairs of the last, part-full wave split across as many
      programs as fill it (one wave of short programs where each of that wave's walks would have run
      alone on its SM)."""
    slots = cfg["PROGRAMS_PER_SM"] * sms
    deep = _walk_fits(pairs, sms, cfg)
    walk = (pairs, 1, cfg["WALK_STAGES"] if deep else cfg["num_stages"], 0)
    if slots == 0:  # (0 programs an SM asks for one program a pair)
        return walk
    waves = -(-pairs // sms)  # of one walk an SM
    if 0 < cfg["WALK_FILL"] * waves * sms <= pairs and waves <= cfg["WALK_PER_SM"]:
        return walk
    if pairs <= slots:
        deep_split = min(n_chunks, cfg["SPLIT_PER_SM"] * sms // pairs)
        if deep_split > 1:
            return 0, deep_split, cfg["SPLIT_STAGES"], cfg["FLAT_STAGES"]
        per_split = min(n_chunks, slots // pairs)
        return walk if per_split <= 1 else (0, per_split, cfg["num_stages"], 0)
    tail = pairs % slots
    per_split = min(n_chunks, slots // tail) if tail and cfg["SPLIT_TAIL"] and not deep else 1
    return walk if per_split <= 1 else (pairs - tail, per_split, cfg["num_stages"], 0)


def _walk_fits(programs: int, sms: int, cfg: dict) -> bool:
    """Whether the one-program walk takes TUNING["decode"]["WALK_STAGES"]: its `programs` (one per
    sequence and kv head), WALK_PER_SM an SM, need no more waves than PROGRAMS_PER_SM an SM would."""
    return triton.cdiv(programs, cfg["WALK_PER_SM"] * sms) <= triton.cdiv(programs, max(1, cfg["PROGRAMS_PER_SM"]) * sms)


def _backward(grad, queries: _Queries, keys: _Keys, out, lse, scale: float):
    """(dq [N, H, D], dk, dv shaped like keys.k). Needs consecutive query positions per sequence."""
    if queries.from_lens:
        raise NotImplementedError("attention backward over a paged layout")
    q = queries.q
    n, h, d = q.shape
    grad = grad.reshape(n, h, d).contiguous()
    lse = lse.reshape(n, h).contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(keys.k), torch.empty_like(keys.v)
    if n == 0:
        return dq, dk.zero_(), dv.zero_()
    delta = torch.empty((n, h), device=q.device, dtype=torch.float32)
    cfg = TUNING["bwd_delta"]
    _delta_kernel[(triton.cdiv(n * h, cfg["BLOCK_R"]),)](out.reshape(n, h, d).contiguous(), grad, delta, n * h, D=d,
                                                         BLOCK_R=cfg["BLOCK_R"], num_warps=cfg["num_warps"])
    n_seqs, group, qk_scale = queries.n_seqs, h // keys.n_heads, scale * _LOG2E
    seq_args = (queries.begin, queries.count, queries.pos, *_page_args(keys))
    cfg = TUNING["bwd_dkdv"]
    # the Gluon form runs the table's tiles (so its sums) when they are 128 keys x 64 rows of whole
    # queries, and reads q and dO through TMA (16-byte aligned, one dtype for its ring); K/V by loads
    if (cfg.get("GLUON") and _on_gluon(q) and (cfg["BLOCK_KV"], cfg["BLOCK_Q"]) == (_WS_TILE.value, _WS_HALF.value)
            and _WS_HALF.value % group == 0 and grad.dtype == q.dtype and is_aligned(q) and is_aligned(grad)):
        install_descriptor_allocator(q.device)  # the q and dO descriptors are made on the device
        _bwd_dkdv_ws_kernel[_ranked_grid(triton.cdiv(keys.max_count, _WS_TILE.value), keys, n_seqs)](
            q, keys.k, keys.v, grad, lse, delta, dk, dv, *seq_args[:5], keys.stride_page, keys.stride_head,
            keys.stride_slot, keys.count, h, qk_scale, scale, n_seqs, GROUP=group, D=d, STAGES=cfg["GLUON_STAGES"],
            num_warps=4)
    else:
        _bwd_dkdv_kernel[_ranked_grid(triton.cdiv(keys.max_count, cfg["BLOCK_KV"]), keys, n_seqs)](
            q, keys.k, keys.v, grad, lse, delta, dk, dv, *seq_args, keys.count, h, qk_scale, scale, n_seqs, GROUP=group,
            D=d,
            BLOCK_Q=cfg["BLOCK_Q"], BLOCK_KV=cfg["BLOCK_KV"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    cfg = TUNING["bwd_dq"]
    # the Gluon form reads a linear K/V through TMA (its _TmaView) and runs the table's sums at 64-row tiles
    view = (_tma_view(keys) if cfg.get("GLUON") and _on_gluon(q) and keys.page_size == _LINEAR_PAGE
            and cfg["BLOCK_Q"] == _WS_HALF.value and grad.dtype == q.dtype else None)
    if view is not None:
        install_descriptor_allocator(q.device)  # the K/V descriptors are made on the device
        _bwd_dq_ws_kernel[_ranked_grid(triton.cdiv(queries.max_count * group, _WS_TILE.value), keys, n_seqs)](
            q, keys.k, keys.v, grad, lse, delta, dq, queries.begin, queries.count, queries.pos, keys.table,
            keys.table.stride(0), view.page_rows, view.head_rows, view.head_cols, keys.stride_slot, view.width, h,
            qk_scale, scale, n_seqs, GROUP=group, D=d, BLOCK_KV=cfg["BLOCK_KV"], STAGES=cfg["GLUON_STAGES"],
            Q_REGS=cfg["GLUON_Q_REGS"], num_warps=4)
        return dq, dk, dv
    descs = _descriptors(keys, cfg["BLOCK_KV"]) if cfg.get("TMA") else (None, None)
    _bwd_dq_kernel[_ranked_grid(triton.cdiv(queries.max_count * group, cfg["BLOCK_Q"]), keys, n_seqs)](
        q, keys.k, keys.v, grad, lse, delta, dq, *seq_args, h, qk_scale, scale, n_seqs, *descs, GROUP=group, D=d,
        BLOCK_Q=cfg["BLOCK_Q"], BLOCK_KV=cfg["BLOCK_KV"], TMA=descs[0] is not None, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return dq, dk, dv


# ---- the ops: forward and backward functions, as torch custom ops (for torch.compile) and as one
# autograd.Function (eager) ---------------------------------------------------------------------

def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    queries, keys = _padded_layout(q, k, v, q_pos)
    out, lse = _forward(queries, keys, scale, decode=q.shape[1] == 1)
    return out.view(q.shape), lse.view(q.shape[:3])


def _causal_bwd(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    consecutive = q_pos[:, :1] + torch.arange(q_pos.shape[1], device=q_pos.device)
    if not torch.equal(q_pos, consecutive):
        raise ValueError("causal_attention (triton) backward needs consecutive query positions per sequence "
                         "(q_pos[b] = q_pos[b, 0] + arange(Tq)), as in training")
    queries, keys = _padded_layout(q, k, v, q_pos)
    dq, dk, dv = _backward(grad, queries, keys, out, lse, scale)
    return dq.view(q.shape), dk, dv


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
               scale: float, max_seqlen: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    queries, keys = _varlen_layout(q, k, v, cu_seqlens, max_seqlen)
    return _forward(queries, keys, scale, decode=False)


def _varlen_bwd(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, scale: float,
                   max_seqlen: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    queries, keys = _varlen_layout(q, k, v, cu_seqlens, max_seqlen)
    return _backward(grad, queries, keys, out, lse, scale)


def _paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
              seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int | None,
              max_seq_len: int | None) -> torch.Tensor:
    queries, keys = _paged_layout(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, max_query_len,
                                  max_seq_len)
    return _forward(queries, keys, scale, decode=True)[0]


_causal_op = torch.library.custom_op("lockstep::causal_attention", _causal, mutates_args=())
_causal_bwd_op = torch.library.custom_op("lockstep::causal_attention_backward", _causal_bwd, mutates_args=())
_varlen_op = torch.library.custom_op("lockstep::varlen_attention", _varlen, mutates_args=())
_varlen_bwd_op = torch.library.custom_op("lockstep::varlen_attention_backward", _varlen_bwd, mutates_args=())
_paged_op = torch.library.custom_op("lockstep::paged_attention", _paged, mutates_args=())


@_causal_op.register_fake
def _(q, k, v, q_pos, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@_varlen_op.register_fake
def _(q, k, v, cu_seqlens, scale, max_seqlen=None):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@_causal_bwd_op.register_fake
def _(grad, q, k, v, index, out, lse, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@_varlen_bwd_op.register_fake
def _(grad, q, k, v, index, out, lse, scale, max_seqlen=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@_paged_op.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, max_query_len, max_seq_len):
    return torch.empty_like(q)


def _register_autograd(op, backward_op: Callable) -> None:
    """Autograd of an op (q, k, v, index, scale, *rest) -> (out, lse) through its backward op, which
    takes the forward's `rest` (varlen's max_seqlen) after the scale; lse is internal (the entry
    points return out only), so its gradient is never used."""
    def setup_context(ctx, inputs, output):
        q, k, v, index, scale, *rest = inputs
        ctx.save_for_backward(q, k, v, index, *output)
        ctx.scale, ctx.rest = scale, rest

    def backward(ctx, grad, _grad_lse):
        q, k, v, index, out, lse = ctx.saved_tensors
        dq, dk, dv = backward_op(grad, q, k, v, index, out, lse, ctx.scale, *ctx.rest)
        return dq, dk, dv, None, None, *(None for _ in ctx.rest)

    op.register_autograd(backward, setup_context=setup_context)


_register_autograd(_causal_op, _causal_bwd_op)
_register_autograd(_varlen_op, _varlen_bwd_op)


class _Eager(torch.autograd.Function):
    """An op's autograd outside a torch.compile trace: the custom op's forward and backward functions
    called directly, without the custom op's dispatch (host time that eager training and vLLM's
    eager attention would pay every layer: 0.19-0.30 ms a call in three of four readings on the H200
    machine's host, benchmarks/RESULTS.md). The same functions, so the same kernels and bits."""

    @staticmethod
    def forward(ctx, forward, backward, q, k, v, index, scale, *rest):
        out, lse = forward(q, k, v, index, scale, *rest)
        ctx.save_for_backward(q, k, v, index, out, lse)
        ctx.backward_fn, ctx.scale, ctx.rest = backward, scale, rest
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, index, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backward_fn(grad, q, k, v, index, out, lse, ctx.scale, *ctx.rest)
        return None, None, dq, dk, dv, None, None, *(None for _ in ctx.rest)


def _call(op, forward, backward, q, k, v, index, scale, *rest):
    """out of the op: the custom op inside a torch.compile trace (opaque to it), else _Eager."""
    if torch.compiler.is_compiling():
        return op(q, k, v, index, scale, *rest)[0]
    return _Eager.apply(forward, backward, q, k, v, index, scale, *rest)


# ---- entry points (called by lockstep.kernels.attention when the backend is triton) ---------------

def _scale(scale: float | None, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def causal_attention(q, k, v, q_pos, scale=None):
    return _call(_causal_op, _causal, _causal_bwd, q, k, v, q_pos, _scale(scale, q.shape[-1]))


def varlen_attention(q, k, v, cu_seqlens, scale=None, max_seqlen=None):
    return _call(_varlen_op, _varlen, _varlen_bwd, q, k, v, cu_seqlens, _scale(scale, q.shape[-1]), max_seqlen)


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale=None, max_query_len=None,
                    max_seq_len=None):
    paged = _paged_op if torch.compiler.is_compiling() else _paged  # (forward only: no autograd)
    return paged(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, _scale(scale, q.shape[-1]),
                 max_query_len, max_seq_len)
