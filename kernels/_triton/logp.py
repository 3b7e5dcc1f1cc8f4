"""Triton backend of linear_logp's chunk states (semantics: lockstep.kernels.logp.torch_chunk_states).

Forward: one program per (row block, vocab chunk), launched as a 1-D grid in grouped order. A
program walks its chunk in BLOCK_V-column tiles in increasing column order; a tile's logits are one
fp32 accumulator built by a BLOCK_K loop over H in increasing k (operands through TMA), and the
tile is folded at once into each row's running (max, sum exp, sum exp*z). The [T, V] logits never
exist: memory beyond the inputs is the [T, n_chunks] states.

Batch invariance (bitwise, per row), by construction:
- a logit is the same sum whatever tile or batch holds it: tl.dot reduces every output element
  over K on its own, and the K steps are fixed (BLOCK_K, increasing k);
- a tile's row sums run through an explicit balanced tree over the column index (`_tree_sum`),
  never `tl.sum`, whose order follows the register layout, which changes with BLOCK_T and warps;
- the tiles of a chunk merge in increasing column order, whatever BLOCK_T is.
So BLOCK_T is chosen per call, for occupancy only; the rest of the numerics is the config table.
On Hopper, 16-bit forwards with enough work (WS_FORWARD) run the same tiles and folds as a
warp-specialised Gluon kernel (_chunk_states_ws_kernel): the fold's functions are the tl ones,
called from Gluon, so there is one definition of the fold, and the GPU tests check its bits
against the tl kernel's.

Backward: the reference's autograd formula with the chunk max as a constant, z recomputed. The
vocab is processed in slices of whole chunks: a kernel recomputes the slice's logits tile by tile
(the forward's tiles, so z and p are the forward's bits) and writes dlogits = dz / temperature in
the input dtype, then two cuBLAS GEMMs add the slice's share to grad_hidden (an fp32 accumulator
carried across slices, in slice order) and write its rows of grad_weight. Deterministic: no
atomics, every gradient element comes from one fixed sequence of GEMMs. Memory: one dlogits slice
(at most a quarter of the vocab, see the tunables) and the fp32 grad_hidden, never all of [T, V].
Recomputing z costs one more GEMM than keeping it, but keeping it (bf16 [T, V]: 1.16 GiB at T=4096
on Qwen3's vocab) would on its own exceed the memory budget (a tenth of the naive path's 8.4 GiB).

Both directions are torch custom ops (lockstep::linear_logp_chunk_states[_backward]) with fake
implementations, and the forward's autograd is registered on the op. The ops run where a
torch.compile trace or autograd needs them; an inference call outside a trace (vLLM's sampler, every
decode step) calls the functions they wrap directly (`_call`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.tools.tensor_descriptor import TensorDescriptor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from lockstep.kernels._triton._alignment import ALIGN_BYTES, is_aligned
from lockstep.kernels._triton._device import INTERPRETING, resident_programs
from lockstep.kernels._triton._order import grouped_tile
from lockstep.kernels._triton._tma import aligned_empty
from lockstep.kernels._triton.splitk_ws import HALF, SHARED_BYTES, gluon_descriptor, invalidate_ring, ring_barriers
from lockstep.kernels.logp import ChunkStates, LinearLogpOutput, torch_merge_states, torch_support_logits

# ------------------------------------------------------------------------------------------------
# Tunables: every number to touch when tuning lives here.
# BLOCK_V and BLOCK_K are part of the numerics (the K steps of each logit, the tiles and sum tree
# of each chunk): changing one changes bits, identically for every row, batch and side, so trainer
# and rollout must run the same table. BLOCK_T, the warps, GROUP_T, num_stages and the backward
# slice only move speed and memory.
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileConfig:
    block_v: int  # vocab columns per tile (a power of two): the merge step of every chunk
    block_k: int  # hidden features per dot step: the K steps of every logit
    num_stages: int  # software-pipeline depth of the (tile, k) loop


TILE_CONFIGS = {
    # 6 stages * (128 + 128) * 64 * 2 B = 192 KiB of operand buffers: one program per SM (every tl
    # kernel here fits the 227 KiB at 128-row blocks, tests/test_triton_logp.py). benchmarks/
    # sweep_logp.py, H200, the bare GEMM's time in alternating turns: 6 / 5 / 4 stages 1.13x /
    # 1.28x / 1.46x at T = 128 (64-row blocks), 1.14x / 1.13x / 1.14x at 256, 1.11x / 1.11x / 1.12x
    # at 4,096.
    torch.bfloat16: TileConfig(block_v=128, block_k=64, num_stages=6),
    torch.float16: TileConfig(block_v=128, block_k=64, num_stages=6),
    # fp32: tl.dot(input_precision="ieee") on FMA units, operands in registers: small tiles.
    torch.float32: TileConfig(block_v=32, block_k=32, num_stages=2),
}
# Rows per program -> warps, largest first; a call takes the largest whose programs fill at least
# MIN_WAVE_FILL of the waves they take (one program per SM a wave). 64-row programs multiply at about
# 0.7x the rate of 128-row ones (benchmarks/sweep_logp.py, H200, T=4096: 1.71x vs 1.18x the bare
# GEMM), so 128 rows win unless they leave about a third of the machine idle. One warp per 16 rows
# keeps each row of a 16-bit (wgmma) accumulator inside one warp (its max and sums never cross
# warps), and no choice is below 64 rows, so Hopper always runs the dot as wgmma, never as mma.sync
# (an instruction whose rounding has not been checked to be the same).
BLOCK_T_WARPS = {128: 8, 64: 4}
MIN_WAVE_FILL = 0.7
# Row blocks that sweep the vocab together: their weight tiles are shared in L2. benchmarks/
# sweep_logp.py, H200, T = 4,096 (32 row blocks), four alternating-turn timings over two calls:
# 8 / 16 / 24 / 32 -> 1.106-1.112x / 1.096-1.102x / 1.112x / 1.150x the bare GEMM. (At T <= 256
# there are at most two row blocks: no effect.)
GROUP_T = 16
# The forward at 128-row blocks of 16-bit operands on Hopper runs _chunk_states_ws_kernel: the same
# tiles, products and fold as _chunk_states_kernel (checked bitwise on an H200, tests/
# test_triton_logp.py), scheduled in Gluon: a producer warp issues the TMA loads into a
# WS_STAGES-deep ring, two consumer warpgroups of 64 rows each multiply two vocab tiles a step into
# two accumulators (the rows loaded once for both: a quarter less L2 traffic a product), leave a
# step's wgmmas in flight while issuing the next, and fold the tiles in column order; the programs
# are persistent over (row block, chunk) items. benchmarks/sweep_logp.py, H200, Qwen3's head, T =
# 4,096, against the bare GEMM in alternating turns: 1.045x / 1.058x with / without wgmmas in
# flight, 1.117x one tile a step (6 stages), the tl kernel 1.106-1.108x; with entropy 1.109x
# against 1.172x. False: the tl kernel everywhere.
WS_FORWARD = True
WS_STAGES = 4  # 4 x 48 KiB of rows and two weight tiles
# ... and only where its persistent programs get at least this many (row block, chunk) items each:
# T = 256 (128 items, one a program) ran 1.165x / 1.174x against the tl kernel's 1.122x / 1.129x.
WS_MIN_ITEMS_PER_PROGRAM = 2
# The backward holds the dlogits of one slice of whole chunks: at most BACKWARD_SLICE_CHUNKS chunks
# (a quarter of the vocab: ~2 bytes per logit against the naive path's ~18, at any T) and at most
# BACKWARD_SLICE_BYTES (but at least one chunk). Fewer, larger slices mean fewer passes over the
# fp32 grad_hidden accumulator and larger GEMMs.
BACKWARD_SLICE_CHUNKS = 8
BACKWARD_SLICE_BYTES = 512 << 20
# chunk states (rows x chunks, padded to a power of two) one program of the merge holds per array
MERGE_STATES_PER_PROGRAM = 4096
# Top-p replay's support logits (lockstep.kernels.logp.torch_support_logits) run
# _support_logits_kernel at every size: the reference's bits without its [T, k, H] products, and
# faster than its expression (benchmarks/bench_logp.py's support table, H200, T = 128, H = 4,096,
# bf16: 0.131 / 0.73 ms against the expression's 0.325 / 3.52 ms at k = 64 / 1,024, whose products
# take 0.125 / 2 GiB for a moment; the kernel's memory is the [T, k] logits).
# weight-row bytes (slots x hidden columns padded to a power of two) a warp of the kernel holds: a
# program takes as many slots as fit one warp's share (at least one row), and a warp per share of
# them. bf16 at H = 4,096: one warp of 2 slots. Compiled for sm_90a: 99-146 registers and no spill
# for bf16 at H = 2,048-16,384 and fp32 at 2,048-8,192; about 2,900 warp instructions a slot at
# H = 4,096, against 17,500 at 4 warps x 2 slots (the tree's late levels run replicated over a
# program's lanes and warps) and 2,472 bytes spilled at 4 x 4 (the first measured form: 11.7 ms at
# T = 128, k = 1,024). `sweep_logp.py support` (H200, T = 128, H = 4,096, bf16, against the
# expression): 8 / 16 / 32 / 64 KiB a warp read 0.216 / 0.175 / 0.668 / 0.503x at k = 64 and
# 0.228 / 0.178 / 0.827 / 0.666x at k = 1,024
SUPPORT_WARP_BYTES = 16384
# enable_fp_fusion=False: a product and the first sum it meets stay two roundings (an fma would be
# one: ptxas gets 64 of them at fp32 otherwise, tests/test_triton_logp.py)
SUPPORT_OPTIONS = dict(enable_fp_fusion=False)

# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


@triton.jit
def _program_tile(n_row_blocks, n_col_tiles, GROUP_T: tl.constexpr):
    """(row block, column tile) of this program (grouped_tile of its id)."""
    return grouped_tile(tl.program_id(0), n_row_blocks, n_col_tiles, GROUP_T)


@triton.jit
def _dot_tile(h_desc, w_desc, row0, col0, H, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
              BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """hidden[row0:+BLOCK_T] @ weight[col0:+BLOCK_V]^T in fp32, one BLOCK_K step at a time in
    increasing k: each logit is the same sum whatever tile, row block or batch holds it. Rows past
    the end and the K tail load as TMA zero-fill, which adds exact zeros."""
    acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        h = h_desc.load([row0, k0])
        w = w_desc.load([col0, k0]).T
        if UPCAST:  # see _launch_args: the interpreter cannot dot bf16; the products are exact in fp32
            h, w = h.to(tl.float32), w.to(tl.float32)
        # ieee: fp32 operands get exact fp32 FMAs instead of TF32; no effect on 16-bit operands
        acc = tl.dot(h, w, acc, input_precision="ieee")
    return acc


@triton.jit
def _logits(h_desc, w_desc, b_ptr, z_ptr, stride_z, inv_temp, row0, rows, row_ok, col0, hi, V_local, H, vocab_start,
            real_vocab_size, HAS_BIAS: tl.constexpr, HAS_TEMP: tl.constexpr, LOAD_Z: tl.constexpr,
            BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """z = (hidden @ weight^T + bias) / temperature in fp32 for one tile, -inf at columns past the
    chunk end `hi` or at/after real_vocab_size. Returns (z, cols, valid cols). The division is a
    multiply by the row's IEEE reciprocal of the temperature: an exact division per logit would
    cost a MUFU op (shared with exp) and a slow-path check, on the path the MMA waits for.
    LOAD_Z: the products come from z_ptr, where _head_logits_kernel wrote them (the same fp32 values;
    what lies outside the rows and the local vocab reads 0, as TMA's zero-fill does)."""
    cols = col0 + tl.arange(0, BLOCK_V)
    if LOAD_Z:
        z = tl.load(z_ptr + rows.to(tl.int64)[:, None] * stride_z + cols[None, :],
                    mask=row_ok[:, None] & (cols < V_local)[None, :], other=0.0)
        # + a product of zeros: the tile moves into the MMA accumulator layout, so the fold below
        # compiles as in the multiplying kernel (a blocked tile spilled and compiled for minutes)
        zeros_h = tl.zeros([BLOCK_T, 16], dtype=h_desc.dtype)
        zeros_w = tl.zeros([16, BLOCK_V], dtype=h_desc.dtype)
        z = tl.dot(zeros_h, zeros_w, z, input_precision="ieee")
    else:
        z = _dot_tile(h_desc, w_desc, row0, col0, H, BLOCK_T, BLOCK_V, BLOCK_K, UPCAST)
    z, valid = _scaled_logits(z, cols, b_ptr, inv_temp, hi, V_local, vocab_start, real_vocab_size, HAS_BIAS, HAS_TEMP)
    return z, cols, valid


@triton.jit
def _scaled_logits(z, cols, b_ptr, inv_temp, hi, V_local, vocab_start, real_vocab_size, HAS_BIAS: tl.constexpr,
                   HAS_TEMP: tl.constexpr):
    """A tile of products z [rows, cols] -> (z + bias) * (1 / temperature), -inf at columns past the
    chunk end `hi` or at/after real_vocab_size; and which columns are valid. (Written in tl and
    called from the Gluon kernel too: every forward folds the same expression.)"""
    if HAS_BIAS:
        z += tl.load(b_ptr + cols, mask=cols < V_local, other=0.0).to(tl.float32)[None, :]
    if HAS_TEMP:
        z *= inv_temp[:, None]
    valid = (cols < hi) & (vocab_start + cols < real_vocab_size)
    return tl.where(valid[None, :], z, float("-inf")), valid


@triton.jit
def _halves(x):
    """(x[:, :C/2], x[:, C/2:]) of x [R, C]: a tree level's two operands, by column index."""
    x = tl.reshape(x, [x.shape[0], 2, x.shape[1] // 2])
    return tl.split(tl.permute(x, (0, 2, 1)))


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """fp32 x rounded to dtype, to nearest even, as torch rounds. bf16 through its bits: Triton's
    interpreter truncates a bf16 cast (the GPU's cvt.rn rounds as this does; NaN payloads aside)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = x.to(dtype)
    return out


@triton.jit
def _tree_sum(x, LOG2_N: tl.constexpr):
    """Row sums of x [R, 2**LOG2_N] as a balanced tree over the column index (column j meets
    j + N/2 first, like _invariant.tree_sum): the order is fixed by the columns' indices, never by
    the register layout the compiler picks for a given BLOCK_T. In x's dtype: a 16-bit x's sums are
    each rounded to it, as torch's 16-bit adds are (fp32 x: the casts are no-ops)."""
    for _ in tl.static_range(LOG2_N):
        first, second = _halves(x)
        x = _rounded(first.to(tl.float32) + second.to(tl.float32), x.dtype)
    return tl.reshape(x, [x.shape[0]])


@triton.jit
def _fold_tile(m, s, w, tz, z, cols, valid, target, WITH_ENTROPY: tl.constexpr, LOG2_V: tl.constexpr,
               TREE_SUM: tl.constexpr):
    """The chunk-state kernels' step per tile (tl's and the Gluon one's): the target's logit into
    tz (plus exact zeros: the same value in any summation order), then _merge_tile."""
    tz += tl.sum(tl.where(cols[None, :] == target[:, None], z, 0.0), axis=1)
    m, s, w = _merge_tile(m, s, w, z, valid, WITH_ENTROPY, LOG2_V, TREE_SUM)
    return m, s, w, tz


@triton.jit
def _merge_tile(m, s, w, z, valid, WITH_ENTROPY: tl.constexpr, LOG2_V: tl.constexpr, TREE_SUM: tl.constexpr):
    """Fold one tile of z into each row's running (max, sum exp(z - max), sum exp(z - max) * z).
    While a row has seen only -inf its max stays -inf and exp is taken against 0 instead, so
    nothing becomes NaN (the reference's `_safe`). TREE_SUM: _tree_sum, or in the Gluon kernel
    _ws_tree_sum (the same sums, its result in the rows' layout)."""
    m_new = tl.maximum(m, tl.max(z, axis=1))
    base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - base)
    p = tl.exp(z - base[:, None])
    s = s * alpha + TREE_SUM(p, LOG2_V)
    if WITH_ENTROPY:
        w = w * alpha + TREE_SUM(p * tl.where(valid[None, :], z, 0.0), LOG2_V)
    return m_new, s, w


@triton.jit
def _row_inputs(temp_ptr, tgt_ptr, row_block, T, vocab_start, HAS_TEMP: tl.constexpr, BLOCK_T: tl.constexpr):
    """The block's rows, which of them exist, 1 / their temperatures, and their targets as local
    columns (int32: a local column always fits, and the per-logit compare stays one instruction)."""
    rows = row_block * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    inv_temp, target = _row_values(temp_ptr, tgt_ptr, rows, row_ok, vocab_start, HAS_TEMP)
    return rows, row_ok, inv_temp, target


@triton.jit
def _row_values(temp_ptr, tgt_ptr, rows, row_ok, vocab_start, HAS_TEMP: tl.constexpr):
    """1 / the rows' temperatures and their targets as local columns (also the Gluon kernel's)."""
    # compiled Triton cannot return None from a jit function: without a temperature the reciprocal
    # is a (never used) 1.0, and HAS_TEMP keeps the multiply out of the kernel
    if HAS_TEMP:
        inv_temp = tl.math.div_rn(1.0, tl.load(temp_ptr + rows, mask=row_ok, other=1.0))
    else:
        inv_temp = tl.where(row_ok, 1.0, 1.0)
    target = (tl.load(tgt_ptr + rows, mask=row_ok, other=-1) - vocab_start).to(tl.int32)
    return inv_temp, target


# T and vocab_start are not specialised: T == 1 or T % 16 == 0 (or a rank's vocab_start) would
# each get a binary of their own; one binary for every batch size and shard leaves nothing to differ.
@triton.jit(do_not_specialize=["T", "vocab_start"])
def _chunk_states_kernel(h_desc, w_desc, b_ptr, temp_ptr, tgt_ptr, m_ptr, s_ptr, ent_ptr, tz_ptr, z_ptr, stride_z,
                         T, H, V_local, n_chunks, width, vocab_start, real_vocab_size,
                         HAS_BIAS: tl.constexpr, HAS_TEMP: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                         UPCAST: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
                         BLOCK_K: tl.constexpr, LOG2_V: tl.constexpr, GROUP_T: tl.constexpr,
                         LOAD_Z: tl.constexpr):
    """One program per (row block, vocab chunk): the chunk's tiles in increasing column order.
    LOAD_Z: fold the products _head_logits_kernel wrote instead of multiplying again."""
    row_block, chunk = _program_tile(tl.cdiv(T, BLOCK_T), n_chunks, GROUP_T)
    rows, row_ok, inv_temp, target = _row_inputs(temp_ptr, tgt_ptr, row_block, T, vocab_start, HAS_TEMP, BLOCK_T)
    lo = chunk * width
    hi = tl.minimum(lo + width, V_local)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_T], tl.float32)
    w = tl.zeros([BLOCK_T], tl.float32)
    tz = tl.zeros([BLOCK_T], tl.float32)
    # Tiles merge in increasing column order: the order is part of every row's numerics. (flatten:
    # one software-pipelined loop over (tile, k), so the next tile's loads fly while this one merges.)
    for c0 in tl.range(lo, hi, BLOCK_V, flatten=True):
        z, cols, valid = _logits(h_desc, w_desc, b_ptr, z_ptr, stride_z, inv_temp, row_block * BLOCK_T, rows, row_ok,
                                 c0, hi, V_local, H, vocab_start, real_vocab_size, HAS_BIAS, HAS_TEMP, LOAD_Z,
                                 BLOCK_T, BLOCK_V, BLOCK_K, UPCAST)
        m, s, w, tz = _fold_tile(m, s, w, tz, z, cols, valid, target, WITH_ENTROPY, LOG2_V, _tree_sum)
    _store_states(m_ptr, s_ptr, ent_ptr, tz_ptr, m, s, w, tz, rows, row_ok, target, chunk, n_chunks, lo, hi, V_local,
                  WITH_ENTROPY)


@triton.jit
def _store_states(m_ptr, s_ptr, ent_ptr, tz_ptr, m, s, w, tz, rows, row_ok, target, chunk, n_chunks, lo, hi, V_local,
                  WITH_ENTROPY: tl.constexpr):
    """A (row block, chunk)'s states into [T, n_chunks], and the target logits (also the Gluon kernel's)."""
    at = rows * n_chunks + chunk
    tl.store(m_ptr + at, m, mask=row_ok)
    tl.store(s_ptr + at, s, mask=row_ok)
    if WITH_ENTROPY:
        tl.store(ent_ptr + at, w, mask=row_ok)
    # one writer per row: the chunk holding the target, or chunk 0 (an exact 0) where this shard
    # does not hold it (so the output needs no zero-fill of its own)
    local = (target >= 0) & (target < V_local)
    writes = tl.where(local, (target >= lo) & (target < hi), chunk == 0)
    tl.store(tz_ptr + rows, tl.where(local, tz, 0.0), mask=row_ok & writes)


# The Gluon forward's layouts and registers. A consumer warpgroup's [64, 128] fp32 tile is wgmma's
# accumulator (m64n128k16 steps, as tl.dot's at 128-row blocks and 8 warps).
WS_BLOCK_V = 128
_WS_ACC_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, WS_BLOCK_V, 16]))
# The tree's last three levels pair columns that the accumulator spreads over the four threads (a
# quad) holding a row: the last eight partial sums of every row go to each thread of its quad first
# (as in the accumulator, a thread holds rows r and r + 8, a warp 16 rows), as Triton's tl kernel
# converts its own tile.
_WS_LAST_LEVELS = gl.constexpr(3)
_WS_ROW_QUAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[HALF, 1 << _WS_LAST_LEVELS.value]))
# Registers a thread of the worker partitions (setmaxnreg): the second consumer holds two
# accumulators and a tile's fold (the first, the default partition, gets 256); the producer only
# issues loads. 4 x 32 x (256 + 240) + 32 x 24 fits the 64 K registers of an SM.
WS_CONSUMER_REGISTERS = gl.constexpr(240)
WS_PRODUCER_REGISTERS = gl.constexpr(24)


@gluon.jit
def _ws_tree_sum(x, LOG2_N: gl.constexpr):
    """_tree_sum of a consumer's tile (the same sums): the levels whose pairs lie in one thread,
    then the last eight columns gathered into each thread of the row's quad, and the rest."""
    for _ in gl.static_range(LOG2_N - _WS_LAST_LEVELS):
        first, second = _halves(x)
        x = first + second
    x = _tree_sum(gl.convert_layout(x, _WS_ROW_QUAD), _WS_LAST_LEVELS)
    return gl.convert_layout(x, gl.SliceLayout(1, _WS_ACC_LAYOUT), assert_trivial=True)


@gluon.jit
def _ws_producer(h_desc, w_desc, h0_smem, h1_smem, wa_smem, wb_smem, ready, empty, my_items, pid, num_programs,
                 n_row_blocks, n_chunks, width, V_local, H, GROUP_T: gl.constexpr, STAGES: gl.constexpr):
    """Every (item, pair of tiles, k step) of the program in order: the TMA loads of the row block's
    two 64-row halves and of two tiles' weight rows (a chunk's odd last tile: its own only) into a
    STAGES-deep ring, waiting only for a free slot."""
    HALF_ROWS: gl.constexpr = h_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = h_desc.block_type.shape[1]
    BLOCK_V: gl.constexpr = w_desc.block_type.shape[0]
    t = 0
    for local in range(my_items):
        row_block, chunk = grouped_tile(pid + local * num_programs, n_row_blocks, n_chunks, GROUP_T)
        lo = chunk * width
        hi = gl.minimum(lo + width, V_local)
        for c0 in range(lo, hi, 2 * BLOCK_V):
            pair = c0 + BLOCK_V < hi  # else the chunk's odd last tile, which the consumers multiply alone
            for k in range(0, H, BLOCK_K):
                s = t % STAGES
                # a slot is free once both consumers released it (its first use passes at once)
                mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, 2 * h_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes, pred=pair)
                mbarrier.expect(bar, 2 * h_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=not pair)
                tma.async_copy_global_to_shared(h_desc, [row_block * 2 * HALF_ROWS, k], bar, h0_smem.index(s))
                tma.async_copy_global_to_shared(h_desc, [row_block * 2 * HALF_ROWS + HALF_ROWS, k], bar,
                                                h1_smem.index(s))
                tma.async_copy_global_to_shared(w_desc, [c0, k], bar, wa_smem.index(s))
                tma.async_copy_global_to_shared(w_desc, [c0 + BLOCK_V, k], bar, wb_smem.index(s), pred=pair)
                t += 1


@gluon.jit
def _ws_fold(acc, c0, m, s, w, tz, b_ptr, inv_temp, target, hi, V_local, vocab_start, real_vocab_size,
             HAS_BIAS: gl.constexpr, HAS_TEMP: gl.constexpr, WITH_ENTROPY: gl.constexpr, LOG2_V: gl.constexpr):
    """One tile's products (columns c0 ..) folded into the rows' states: the tl kernel's functions."""
    cols = c0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, _WS_ACC_LAYOUT))
    z, valid = _scaled_logits(acc, cols, b_ptr, inv_temp, hi, V_local, vocab_start, real_vocab_size, HAS_BIAS,
                              HAS_TEMP)
    return _fold_tile(m, s, w, tz, z, cols, valid, target, WITH_ENTROPY, LOG2_V, _ws_tree_sum)


@gluon.jit
def _ws_consumer(h_smem, wa_smem, wb_smem, ready, empty, b_ptr, temp_ptr, tgt_ptr, m_ptr, s_ptr, ent_ptr, tz_ptr, T,
                 H, V_local, n_chunks, width, vocab_start, real_vocab_size, my_items, pid, num_programs, n_row_blocks,
                 ROW_HALF: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_TEMP: gl.constexpr, WITH_ENTROPY: gl.constexpr,
                 LOG2_V: gl.constexpr, GROUP_T: gl.constexpr, STAGES: gl.constexpr, HALF_ROWS: gl.constexpr,
                 BLOCK_V: gl.constexpr, BLOCK_K: gl.constexpr):
    """Rows ROW_HALF * HALF_ROWS .. + HALF_ROWS of every item, two tiles at a time (a chunk's odd
    last tile alone): the products in ascending k, one wgmma per tile and step from a zero
    accumulator (tl.dot's), a step's wgmmas in flight while the next step's are issued (its slot
    freed one step later); then the tiles folded in column order (_ws_fold) and the states stored
    (_store_states)."""
    row_layout: gl.constexpr = gl.SliceLayout(1, _WS_ACC_LAYOUT)
    acc_a = gl.zeros([HALF_ROWS, BLOCK_V], gl.float32, _WS_ACC_LAYOUT)
    acc_b = gl.zeros([HALF_ROWS, BLOCK_V], gl.float32, _WS_ACC_LAYOUT)
    t = 0
    for local in range(my_items):
        row_block, chunk = grouped_tile(pid + local * num_programs, n_row_blocks, n_chunks, GROUP_T)
        rows = row_block * 2 * HALF_ROWS + ROW_HALF * HALF_ROWS + gl.arange(0, HALF_ROWS, layout=row_layout)
        row_ok = rows < T
        inv_temp, target = _row_values(temp_ptr, tgt_ptr, rows, row_ok, vocab_start, HAS_TEMP)
        lo = chunk * width
        hi = gl.minimum(lo + width, V_local)
        m = gl.full([HALF_ROWS], float("-inf"), gl.float32, row_layout)
        s = gl.zeros([HALF_ROWS], gl.float32, row_layout)
        w = gl.zeros([HALF_ROWS], gl.float32, row_layout)
        tz = gl.zeros([HALF_ROWS], gl.float32, row_layout)
        for c0 in range(lo, hi, 2 * BLOCK_V):  # the chunk's tiles in increasing column order
            if c0 + BLOCK_V < hi:
                for k in range(0, H, BLOCK_K):
                    st = t % STAGES
                    mbarrier.wait(ready.index(st), (t // STAGES) & 1)
                    acc_a = warpgroup_mma(h_smem.index(st), wa_smem.index(st).permute((1, 0)), acc_a, use_acc=k > 0,
                                          is_async=True)
                    acc_b = warpgroup_mma(h_smem.index(st), wb_smem.index(st).permute((1, 0)), acc_b, use_acc=k > 0,
                                          is_async=True)
                    acc_a, acc_b = warpgroup_mma_wait(num_outstanding=2, deps=(acc_a, acc_b))
                    mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), count=1, pred=k > 0)
                    t += 1
                acc_a, acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc_a, acc_b))
                mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), count=1)
                m, s, w, tz = _ws_fold(acc_a, c0, m, s, w, tz, b_ptr, inv_temp, target, hi, V_local, vocab_start,
                                       real_vocab_size, HAS_BIAS, HAS_TEMP, WITH_ENTROPY, LOG2_V)
                m, s, w, tz = _ws_fold(acc_b, c0 + BLOCK_V, m, s, w, tz, b_ptr, inv_temp, target, hi, V_local,
                                       vocab_start, real_vocab_size, HAS_BIAS, HAS_TEMP, WITH_ENTROPY, LOG2_V)
            else:
                for k in range(0, H, BLOCK_K):
                    st = t % STAGES
                    mbarrier.wait(ready.index(st), (t // STAGES) & 1)
                    acc_a = warpgroup_mma(h_smem.index(st), wa_smem.index(st).permute((1, 0)), acc_a, use_acc=k > 0,
                                          is_async=True)
                    acc_a = warpgroup_mma_wait(num_outstanding=1, deps=(acc_a,))
                    mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), count=1, pred=k > 0)
                    t += 1
                acc_a = warpgroup_mma_wait(num_outstanding=0, deps=(acc_a,))
                mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), count=1)
                m, s, w, tz = _ws_fold(acc_a, c0, m, s, w, tz, b_ptr, inv_temp, target, hi, V_local, vocab_start,
                                       real_vocab_size, HAS_BIAS, HAS_TEMP, WITH_ENTROPY, LOG2_V)
        _store_states(m_ptr, s_ptr, ent_ptr, tz_ptr, m, s, w, tz, rows, row_ok, target, chunk, n_chunks, lo, hi,
                      V_local, WITH_ENTROPY)


# T and vocab_start are not specialised, as in _chunk_states_kernel.
@gluon.jit(do_not_specialize=["T", "vocab_start"])
def _chunk_states_ws_kernel(h_desc, w_desc, b_ptr, temp_ptr, tgt_ptr, m_ptr, s_ptr, ent_ptr, tz_ptr, T, H, V_local,
                            n_chunks, width, vocab_start, real_vocab_size, num_programs, HAS_BIAS: gl.constexpr,
                            HAS_TEMP: gl.constexpr, WITH_ENTROPY: gl.constexpr, LOG2_V: gl.constexpr,
                            GROUP_T: gl.constexpr, STAGES: gl.constexpr):
    """_chunk_states_kernel's forward at 128-row blocks, warp-specialised (see WS_FORWARD): a
    producer warp and two consumer warpgroups of 64 rows, persistent over (row block, chunk) items."""
    HALF_ROWS: gl.constexpr = h_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = h_desc.block_type.shape[1]
    BLOCK_V: gl.constexpr = w_desc.block_type.shape[0]
    pid = gl.program_id(0)
    n_row_blocks = gl.cdiv(T, 2 * HALF_ROWS)
    my_items = (n_row_blocks * n_chunks - pid + num_programs - 1) // num_programs
    h0_smem = gl.allocate_shared_memory(h_desc.dtype, [STAGES, HALF_ROWS, BLOCK_K], h_desc.layout)
    h1_smem = gl.allocate_shared_memory(h_desc.dtype, [STAGES, HALF_ROWS, BLOCK_K], h_desc.layout)
    wa_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_V, BLOCK_K], w_desc.layout)
    wb_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_V, BLOCK_K], w_desc.layout)
    ready, empty = ring_barriers(STAGES)
    # (the argument tuples are written out in the call: a tuple variable loses their constexprs)
    gl.warp_specialize([
        (_ws_consumer, (h0_smem, wa_smem, wb_smem, ready, empty, b_ptr, temp_ptr, tgt_ptr, m_ptr, s_ptr, ent_ptr,
                        tz_ptr, T, H, V_local, n_chunks, width, vocab_start, real_vocab_size, my_items, pid,
                        num_programs, n_row_blocks, 0, HAS_BIAS, HAS_TEMP, WITH_ENTROPY, LOG2_V, GROUP_T, STAGES,
                        HALF_ROWS, BLOCK_V, BLOCK_K)),
        (_ws_consumer, (h1_smem, wa_smem, wb_smem, ready, empty, b_ptr, temp_ptr, tgt_ptr, m_ptr, s_ptr, ent_ptr,
                        tz_ptr, T, H, V_local, n_chunks, width, vocab_start, real_vocab_size, my_items, pid,
                        num_programs, n_row_blocks, 1, HAS_BIAS, HAS_TEMP, WITH_ENTROPY, LOG2_V, GROUP_T, STAGES,
                        HALF_ROWS, BLOCK_V, BLOCK_K)),
        (_ws_producer, (h_desc, w_desc, h0_smem, h1_smem, wa_smem, wb_smem, ready, empty, my_items, pid,
                        num_programs, n_row_blocks, n_chunks, width, V_local, H, GROUP_T, STAGES)),
    ], [4, 1], [WS_CONSUMER_REGISTERS, WS_PRODUCER_REGISTERS])
    invalidate_ring(ready, empty, STAGES)


@triton.jit
def _chunk_tile(tile, chunk0, width, V_local, BLOCK_V: tl.constexpr):
    """Tile `tile` of a grid laid out per vocab chunk from chunk0 on (cdiv(width, BLOCK_V) tiles a
    chunk): (its chunk, the chunk's end, the tile's first column). c0 >= end: a trailing tile of a
    short last chunk."""
    tiles_per_chunk = tl.cdiv(width, BLOCK_V)
    chunk = chunk0 + tile // tiles_per_chunk
    lo = chunk * width
    return chunk, tl.minimum(lo + width, V_local), lo + (tile % tiles_per_chunk) * BLOCK_V


@triton.jit(do_not_specialize=["T"])
def _head_logits_kernel(h_desc, w_desc, z_ptr, stride_z, T, H, V_local, width, UPCAST: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_T: tl.constexpr):
    """z [T, V_local] = hidden @ weight^T in fp32, one tile per program, the tiles laid out per
    vocab chunk as the chunk-state kernel walks them (_dot_tile: the same products, bit for bit).
    Nothing is folded, so no tile waits for another: a decode batch gets as many programs as tiles."""
    tiles_per_chunk = tl.cdiv(width, BLOCK_V)
    row_block, tile = _program_tile(tl.cdiv(T, BLOCK_T), tl.cdiv(V_local, width) * tiles_per_chunk, GROUP_T)
    _, hi, c0 = _chunk_tile(tile, 0, width, V_local, BLOCK_V)
    if c0 >= hi:  # a trailing tile of a short last chunk
        return
    z = _dot_tile(h_desc, w_desc, row_block * BLOCK_T, c0, H, BLOCK_T, BLOCK_V, BLOCK_K, UPCAST)
    rows = row_block * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = c0 + tl.arange(0, BLOCK_V)
    tl.store(z_ptr + rows.to(tl.int64)[:, None] * stride_z + cols[None, :], z,
             mask=(rows < T)[:, None] & (cols < hi)[None, :])


@triton.jit(do_not_specialize=["T", "vocab_start"])
def _dlogits_kernel(h_desc, w_desc, b_ptr, temp_ptr, tgt_ptr, m_ptr, gs_ptr, gw_ptr, gt_ptr, out_ptr,
                    T, H, V_local, n_chunks, width, vocab_start, real_vocab_size,
                    chunk0, n_slice_chunks, stride_out,
                    HAS_BIAS: tl.constexpr, HAS_TEMP: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                    UPCAST: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
                    BLOCK_K: tl.constexpr, LOG2_V: tl.constexpr, GROUP_T: tl.constexpr):
    """dlogits of chunks [chunk0, chunk0 + n_slice_chunks) into out [T, their columns], one tile per
    program, tiles laid out per chunk as in the forward: dz = g_s p + g_w p (1 + z) + g_t [j ==
    target] with p = exp(z - m), then dlogits = dz / temperature (times the reciprocal, as z)."""
    row_block, tile = _program_tile(tl.cdiv(T, BLOCK_T), n_slice_chunks * tl.cdiv(width, BLOCK_V), GROUP_T)
    chunk, hi, c0 = _chunk_tile(tile, chunk0, width, V_local, BLOCK_V)
    if c0 >= hi:  # a trailing tile of a short last chunk
        return
    rows, row_ok, inv_temp, target = _row_inputs(temp_ptr, tgt_ptr, row_block, T, vocab_start, HAS_TEMP, BLOCK_T)
    z, cols, valid = _logits(h_desc, w_desc, b_ptr, None, 0, inv_temp, row_block * BLOCK_T, rows, row_ok, c0, hi,
                             V_local, H, vocab_start, real_vocab_size, HAS_BIAS, HAS_TEMP, False,
                             BLOCK_T, BLOCK_V, BLOCK_K, UPCAST)
    at = rows * n_chunks + chunk
    m = tl.load(m_ptr + at, mask=row_ok, other=0.0)
    p = tl.exp(z - tl.where(m == float("-inf"), 0.0, m)[:, None])
    dz = p * tl.load(gs_ptr + at, mask=row_ok, other=0.0)[:, None]
    if WITH_ENTROPY:
        g_w = tl.load(gw_ptr + at, mask=row_ok, other=0.0)
        dz += p * (1.0 + tl.where(valid[None, :], z, 0.0)) * g_w[:, None]
    g_t = tl.load(gt_ptr + rows, mask=row_ok, other=0.0)
    dz += tl.where(cols[None, :] == target[:, None], g_t[:, None], 0.0)
    if HAS_TEMP:
        dz *= inv_temp[:, None]
    # 64-bit block origin, 32-bit offsets inside the block: the per-element address math stays cheap
    out = (out_ptr + tl.cast(row_block * BLOCK_T, tl.int64) * stride_out
           + tl.arange(0, BLOCK_T)[:, None] * stride_out + (cols - chunk0 * width)[None, :])
    tl.store(out, dz.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < hi)[None, :])


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    else:  # the interpreter runs no libdevice call
        return tl.exp(x)


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit(do_not_specialize=["T"])
def _merge_kernel(tz_ptr, m_ptr, s_ptr, w_ptr, logp_ptr, lse_ptr, ent_ptr, T, n, WITH_ENTROPY: tl.constexpr,
                  LOG2_N: tl.constexpr, BLOCK_R: tl.constexpr, LIBDEVICE: tl.constexpr):
    """kernels/logp.py's merge_tree then _finish, for BLOCK_R rows of [T, n] chunk states: the same
    operations in the same order, each rounded on its own (the launch turns FMA contraction off),
    exp and log as libdevice's expf / logf without flush-to-zero (CUDA's, which torch runs) and the
    division correctly rounded, so the bits are the torch reference's on the same GPU."""
    N: tl.constexpr = 1 << LOG2_N
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, N)
    row_ok = rows < T
    # rows past T merge a copy of row T - 1 (never stored); columns past n are merge_tree's padding,
    # the identity of a merge
    at = tl.minimum(rows, T - 1).to(tl.int64)[:, None] * n + cols[None, :]
    ok = (cols < n)[None, :]
    m = tl.load(m_ptr + at, mask=ok, other=float("-inf"))
    s = tl.load(s_ptr + at, mask=ok, other=0.0)
    w = tl.load(w_ptr + at, mask=ok, other=0.0) if WITH_ENTROPY else s
    for _ in tl.static_range(LOG2_N):  # chunk j meets chunk j + N/2, as in merge_tree
        m1, m2 = _halves(m)
        s1, s2 = _halves(s)
        m = tl.maximum(m1, m2)
        ref = tl.where(m == float("-inf"), 0.0, m)
        a1 = _exp(m1 - ref, LIBDEVICE)
        a2 = _exp(m2 - ref, LIBDEVICE)
        s = s1 * a1 + s2 * a2
        if WITH_ENTROPY:
            w1, w2 = _halves(w)
            w = w1 * a1 + w2 * a2
    m = tl.reshape(m, [BLOCK_R])
    lse = m + _log(tl.reshape(s, [BLOCK_R]), LIBDEVICE)
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    tl.store(logp_ptr + rows, tl.load(tz_ptr + rows, mask=row_ok) - lse, mask=row_ok)
    if WITH_ENTROPY:
        tl.store(ent_ptr + rows, lse - tl.math.div_rn(tl.reshape(w, [BLOCK_R]), tl.reshape(s, [BLOCK_R])),
                 mask=row_ok)


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------


def _tma_rows(t: torch.Tensor) -> torch.Tensor:
    """t when TMA can read it as a row-major matrix in place (unit inner stride, 16-byte aligned
    base and row stride, as hidden states and LM heads are), else an aligned copy."""
    if t.stride(1) == 1 and is_aligned(t) and (t.stride(0) * t.element_size()) % ALIGN_BYTES == 0:
        return t
    copy = aligned_empty(t.shape[0], t.shape[1], t.dtype, t.device)
    copy.copy_(t)
    return copy


def _launch_args(hidden, weight, targets, bias, temperature, *, width, vocab_start, real_vocab_size, with_entropy):
    """Scalar and per-row arguments shared by both kernels (`_launch` adds the operands and BLOCK_T)."""
    cfg = TILE_CONFIGS[hidden.dtype]
    return dict(b_ptr=None if bias is None else bias.contiguous(), temp_ptr=temperature,
                tgt_ptr=targets.contiguous(), T=hidden.shape[0], H=hidden.shape[1], V_local=weight.shape[0],
                n_chunks=triton.cdiv(weight.shape[0], width), width=width, vocab_start=vocab_start,
                real_vocab_size=real_vocab_size, HAS_BIAS=bias is not None, HAS_TEMP=temperature is not None,
                WITH_ENTROPY=with_entropy,
                # Triton 3.6's interpreter multiplies bf16 dot operands as raw uint16 bits; widening
                # them to fp32 is exact, and so are the bf16 products: the GPU's arithmetic.
                UPCAST=INTERPRETING and hidden.dtype == torch.bfloat16,
                BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, LOG2_V=cfg.block_v.bit_length() - 1,
                GROUP_T=GROUP_T, num_stages=cfg.num_stages)


def _block_t(n_rows: int, n_col_tiles: int, device: torch.device) -> int:
    """The largest row block whose programs fill at least MIN_WAVE_FILL of their waves, else the
    smallest (speed only: no row's numerics depend on it). T=256 on a 64-chunk vocab: 128 programs
    of 128 rows on 132 SMs, one wave 97% full (with 64-row blocks the forward took 3.7x the bare
    GEMM, timed eagerly)."""
    sms = resident_programs(device)
    for block in BLOCK_T_WARPS:
        programs = triton.cdiv(n_rows, block) * n_col_tiles
        if programs / (triton.cdiv(programs, sms) * sms) >= MIN_WAVE_FILL:
            return block
    return block


def _launch(kernel, hidden, weight, args: dict, n_col_tiles: int, **outputs) -> None:
    """Run `kernel` over (row blocks x n_col_tiles) programs, BLOCK_T picked for this launch. The
    operands go in as host-built TMA descriptors: no program spends time building its own."""
    block_t = _block_t(hidden.shape[0], n_col_tiles, hidden.device)
    h_desc = TensorDescriptor.from_tensor(hidden, [block_t, args["BLOCK_K"]])
    w_desc = TensorDescriptor.from_tensor(weight, [args["BLOCK_V"], args["BLOCK_K"]])
    kernel[(triton.cdiv(hidden.shape[0], block_t) * n_col_tiles,)](
        h_desc, w_desc, **args, **outputs, BLOCK_T=block_t, num_warps=BLOCK_T_WARPS[block_t])


def _forward(hidden, weight, targets, bias, temperature, vocab_start, width, real_vocab_size, with_entropy,
             logits=None):
    T, n = hidden.shape[0], triton.cdiv(weight.shape[0], width)
    m, s = (hidden.new_empty(T, n, dtype=torch.float32) for _ in range(2))
    w = hidden.new_empty(T, n if with_entropy else 0, dtype=torch.float32)
    target_z = hidden.new_empty(T, dtype=torch.float32)  # 0 where the target is in another shard (the kernel)
    if T:
        args = _launch_args(hidden, weight, targets, bias, temperature, width=width, vocab_start=vocab_start,
                            real_vocab_size=real_vocab_size, with_entropy=with_entropy)
        outputs = dict(m_ptr=m, s_ptr=s, ent_ptr=w, tz_ptr=target_z)
        if logits is None and _warp_specialized(hidden, n):
            _launch_ws(_tma_rows(hidden), _tma_rows(weight), args, n, **outputs)
        else:
            z = logits.contiguous() if logits is not None else target_z
            _launch(_chunk_states_kernel, _tma_rows(hidden), _tma_rows(weight), args, n, **outputs, z_ptr=z,
                    stride_z=z.stride(0), LOAD_Z=logits is not None)
    return m, s, w, target_z


def _warp_specialized(hidden: torch.Tensor, n_chunks: int) -> bool:
    """Whether this forward runs the Gluon kernel (WS_FORWARD): 16-bit operands on a Hopper GPU at
    the 128-row blocks that _block_t picks, with WS_MIN_ITEMS_PER_PROGRAM items a program (the tl
    kernel's bits, either way: only the speed differs)."""
    if not (WS_FORWARD and not INTERPRETING and hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(hidden.device)[0] == 9):
        return False
    items = triton.cdiv(hidden.shape[0], 2 * HALF) * n_chunks
    return (_block_t(hidden.shape[0], n_chunks, hidden.device) == 2 * HALF
            and items >= WS_MIN_ITEMS_PER_PROGRAM * resident_programs(hidden.device))


def _launch_ws(hidden, weight, args: dict, n_chunks: int, **outputs) -> None:
    """_chunk_states_ws_kernel over (row blocks x n_chunks) items, one persistent program per SM at most."""
    if args["BLOCK_V"] != WS_BLOCK_V:
        raise ValueError(f"TILE_CONFIGS: the warp-specialised forward folds {WS_BLOCK_V}-column tiles (one wgmma "
                         f"accumulator), got block_v={args['BLOCK_V']}; set WS_FORWARD = False to run another")
    block_k = args["BLOCK_K"]
    shared = WS_STAGES * (2 * HALF + 2 * WS_BLOCK_V) * block_k * hidden.element_size()
    if shared > SHARED_BYTES:
        raise ValueError(f"WS_STAGES = {WS_STAGES}: the ring's {shared} bytes exceed the {SHARED_BYTES} bytes of "
                         "shared memory of a Hopper SM")
    items = triton.cdiv(hidden.shape[0], 2 * HALF) * n_chunks
    programs = min(items, resident_programs(hidden.device))
    kernel_args = {k: v for k, v in args.items() if k not in ("UPCAST", "BLOCK_V", "BLOCK_K", "num_stages")}
    _chunk_states_ws_kernel[(programs,)](
        gluon_descriptor(hidden, [HALF, block_k]), gluon_descriptor(weight, [WS_BLOCK_V, block_k]), **kernel_args,
        **outputs, num_programs=programs, STAGES=WS_STAGES, num_warps=4)


def _head_logits(hidden, weight, width):
    """[T, V_local] fp32: hidden @ weight^T exactly as the chunk-state kernel multiplies it."""
    T, V = hidden.shape[0], weight.shape[0]
    z = hidden.new_empty(T, V, dtype=torch.float32)
    if T:
        cfg = TILE_CONFIGS[hidden.dtype]
        tiles = triton.cdiv(V, width) * triton.cdiv(width, cfg.block_v)
        _launch(_head_logits_kernel, _tma_rows(hidden), _tma_rows(weight),
                dict(T=T, H=hidden.shape[1], V_local=V, width=width,
                     UPCAST=INTERPRETING and hidden.dtype == torch.bfloat16,
                     BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, GROUP_T=GROUP_T, num_stages=cfg.num_stages),
                tiles, z_ptr=z, stride_z=z.stride(0))
    return z


def _merge(target_z, m, s, w):
    """(logp, lse, entropy) of [T, n] chunk states (entropy [0] without w): one launch."""
    (T, n), with_entropy = m.shape, w is not None
    logp, lse = torch.empty_like(target_z), torch.empty_like(target_z)
    entropy = target_z.new_empty(T if with_entropy else 0)
    if T:
        log2_n = (n - 1).bit_length()
        block_r = max(1, MERGE_STATES_PER_PROGRAM >> log2_n)
        m, s = m.contiguous(), s.contiguous()
        _merge_kernel[(triton.cdiv(T, block_r),)](
            target_z.contiguous(), m, s, w.contiguous() if with_entropy else s, logp, lse, entropy, T, n,
            WITH_ENTROPY=with_entropy, LOG2_N=log2_n, BLOCK_R=block_r, LIBDEVICE=not INTERPRETING, num_warps=4,
            # every product and sum rounded on its own, as torch's separate kernels round them
            enable_fp_fusion=False, enable_reflect_ftz=False)
    return logp, lse, entropy


def _add_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a @ b, accumulated into the fp32 acc that is carried across vocab slices (grad_hidden
    is rounded once at the end, as by one GEMM over the whole vocab)."""
    if a.dtype == acc.dtype:
        return torch.addmm(acc, a, b)
    if a.is_cuda:
        return torch.addmm(acc, a, b, out_dtype=acc.dtype)
    return torch.addmm(acc, a.to(acc.dtype), b.to(acc.dtype))  # CPU has no mixed-dtype GEMM (interpreter)


def _backward(grad_s, grad_w, grad_t, hidden, weight, targets, bias, temperature, m, vocab_start, width,
              real_vocab_size, with_entropy, need_hidden, need_weight, need_bias):
    (T, H), V_local, n = hidden.shape, weight.shape[0], m.shape[1]
    grad_h = hidden.new_zeros(T, H, dtype=torch.float32) if need_hidden else None
    # every row of grad_weight is written below when there are rows (no 1 GiB memset at Qwen3 scale)
    grad_wt = (weight.new_empty if T else weight.new_zeros)(weight.shape) if need_weight else None
    grad_b = hidden.new_zeros(V_local, dtype=torch.float32) if need_bias else None
    if T:
        args = _launch_args(hidden, weight, targets, bias, temperature, width=width, vocab_start=vocab_start,
                            real_vocab_size=real_vocab_size, with_entropy=with_entropy)
        operands = _tma_rows(hidden), _tma_rows(weight)
        tiles_per_chunk = triton.cdiv(width, args["BLOCK_V"])
        slice_chunks = max(1, min(BACKWARD_SLICE_CHUNKS, BACKWARD_SLICE_BYTES // (T * width * hidden.element_size())))
        buffer = hidden.new_empty(T, min(slice_chunks * width, V_local))
        # Slices in increasing vocab order: grad_hidden's fp32 sum over slices has a fixed order.
        for c0 in range(0, n, slice_chunks):
            lo, hi = c0 * width, min((c0 + slice_chunks) * width, V_local)
            dl = buffer[:, :hi - lo]
            chunks = min(slice_chunks, n - c0)
            _launch(_dlogits_kernel, *operands, args, chunks * tiles_per_chunk, m_ptr=m, gs_ptr=grad_s,
                    gw_ptr=grad_w, gt_ptr=grad_t, out_ptr=dl, chunk0=c0, n_slice_chunks=chunks,
                    stride_out=dl.stride(0))
            if need_hidden:
                grad_h = _add_mm(grad_h, dl, weight[lo:hi])
            if need_weight:
                torch.mm(dl.t(), hidden, out=grad_wt[lo:hi])
            if need_bias:
                grad_b[lo:hi] = dl.sum(0, dtype=torch.float32)
    empty = hidden.new_empty(0)
    return (grad_h.to(hidden.dtype) if need_hidden else empty, grad_wt if need_weight else empty,
            grad_b.to(bias.dtype) if need_bias else empty)


@triton.jit
def _support_logits_kernel(h_ptr, w_ptr, ids_ptr, z_ptr, k, H, stride_h, stride_w, SLOTS: tl.constexpr,
                           LOG2_H: tl.constexpr, PADDED: tl.constexpr):
    """z[t, j] for SLOTS slots j of one row t: torch_support_logits' products, each rounded to the
    operands' dtype (exact in fp32 first: 16-bit operands' products fit it), then tree-summed over
    the hidden columns zero-padded to 2**LOG2_H (_tree_sum, as _invariant.tree_sum pads and pairs).
    PADDED: H < 2**LOG2_H, the columns masked (otherwise no column mask, so the loads vectorise)."""
    pid = tl.program_id(0)
    per_row = tl.cdiv(k, SLOTS)
    t = (pid // per_row).to(tl.int64)
    slots = (pid % per_row) * SLOTS + tl.arange(0, SLOTS)
    used = slots < k
    ids = tl.load(ids_ptr + t * k + slots, mask=used, other=0)
    cols = tl.arange(0, 1 << LOG2_H)
    inside = (cols < H) | (not PADDED)
    h = tl.load(h_ptr + t * stride_h + cols, mask=inside, other=0.0)
    w = tl.load(w_ptr + ids.to(tl.int64)[:, None] * stride_w + cols[None, :], mask=used[:, None] & inside[None, :],
                other=0.0)
    z = _tree_sum(_rounded(h.to(tl.float32)[None, :] * w.to(tl.float32), w.dtype), LOG2_H)
    tl.store(z_ptr + t * k + slots, z, mask=used)


def _support_logits(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if hidden.dtype != weight.dtype or ids.dim() != 2 or ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"linear_logp (triton): support logits need hidden and weight of one dtype (got "
                         f"{hidden.dtype}, {weight.dtype}) and ids [T, k] (got {tuple(ids.shape)})")
    T, k = ids.shape
    H = hidden.shape[1]
    z = hidden.new_empty(T, k)
    if z.numel() == 0:
        return z
    log2_h = max(0, (H - 1).bit_length())
    row = (1 << log2_h) * hidden.element_size()
    slots = max(1, min(triton.next_power_of_2(k), SUPPORT_WARP_BYTES // row))
    hidden, weight = hidden.contiguous(), weight.contiguous()
    _support_logits_kernel[(T * triton.cdiv(k, slots),)](
        hidden, weight, ids.contiguous(), z, k, H, hidden.stride(0), weight.stride(0), SLOTS=slots, LOG2_H=log2_h,
        PADDED=H != 1 << log2_h, num_warps=max(1, slots * row // SUPPORT_WARP_BYTES), **SUPPORT_OPTIONS)
    return z


# ------------------------------------------------------------------------------------------------
# Custom ops and autograd
# ------------------------------------------------------------------------------------------------


@torch.library.custom_op("lockstep::linear_logp_support_logits", mutates_args=())
def _support_logits_op(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """torch_support_logits' [T, k] logits, without its [T, k, H] products."""
    return _support_logits(hidden, weight, ids)


@_support_logits_op.register_fake
def _(hidden, weight, ids):
    return hidden.new_empty(ids.shape[0], ids.shape[1])


def _support_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _support_backward(ctx, grad_z):
    """The reference's gradient, its graph rebuilt from the saved inputs (the [T, k, H] products
    exist during the backward only)."""
    hidden, weight, ids = ctx.saved_tensors
    need = ctx.needs_input_grad[:2]
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(n) for x, n in zip((hidden, weight), need)]
        z = torch_support_logits(leaves[0], leaves[1], ids)
        grads = iter(torch.autograd.grad(z, [x for x, n in zip(leaves, need) if n], grad_z))
    return (next(grads) if need[0] else None, next(grads) if need[1] else None, None)


_support_logits_op.register_autograd(_support_backward, setup_context=_support_setup_context)


@torch.library.custom_op("lockstep::linear_logp_chunk_states", mutates_args=())
def _chunk_states_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: Optional[torch.Tensor],
                     temperature: Optional[torch.Tensor], vocab_start: int, width: int, real_vocab_size: int,
                     with_entropy: bool, logits: Optional[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, s, w, target_z); w is [T, 0] without entropy; temperature is None or fp32 [T]; logits:
    None, or head_logits_op's products for these rows (folded instead of multiplied again)."""
    return _forward(hidden, weight, targets, bias, temperature, vocab_start, width, real_vocab_size, with_entropy,
                    logits)


@_chunk_states_op.register_fake
def _(hidden, weight, targets, bias, temperature, vocab_start, width, real_vocab_size, with_entropy, logits):
    T, n = hidden.shape[0], triton.cdiv(weight.shape[0], width)
    states = hidden.new_empty(T, n, dtype=torch.float32)
    return (states, torch.empty_like(states), hidden.new_empty(T, n if with_entropy else 0, dtype=torch.float32),
            hidden.new_empty(T, dtype=torch.float32))


@torch.library.custom_op("lockstep::linear_logp_chunk_states_backward", mutates_args=())
def _chunk_states_backward_op(grad_s: torch.Tensor, grad_w: torch.Tensor, grad_t: torch.Tensor, hidden: torch.Tensor,
                              weight: torch.Tensor, targets: torch.Tensor, bias: Optional[torch.Tensor],
                              temperature: Optional[torch.Tensor], m: torch.Tensor, vocab_start: int, width: int,
                              real_vocab_size: int, with_entropy: bool, need_hidden: bool, need_weight: bool,
                              need_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight, grad_bias); an empty tensor for each one not needed."""
    return _backward(grad_s, grad_w, grad_t, hidden, weight, targets, bias, temperature, m, vocab_start, width,
                     real_vocab_size, with_entropy, need_hidden, need_weight, need_bias)


@_chunk_states_backward_op.register_fake
def _(grad_s, grad_w, grad_t, hidden, weight, targets, bias, temperature, m, vocab_start, width, real_vocab_size,
      with_entropy, need_hidden, need_weight, need_bias):
    empty = hidden.new_empty(0)
    return (torch.empty_like(hidden) if need_hidden else empty, torch.empty_like(weight) if need_weight else empty,
            torch.empty_like(bias) if need_bias else empty)


@torch.library.custom_op("lockstep::linear_logp_head_logits", mutates_args=())
def head_logits_op(hidden: torch.Tensor, weight: torch.Tensor, width: int) -> torch.Tensor:
    """[T, V_local] fp32 products hidden @ weight^T, tile by tile as the chunk-state kernel makes them."""
    return _head_logits(hidden, weight, width)


@head_logits_op.register_fake
def _(hidden, weight, width):
    return hidden.new_empty(hidden.shape[0], weight.shape[0], dtype=torch.float32)


@torch.library.custom_op("lockstep::linear_logp_merge", mutates_args=())
def _merge_op(target_z: torch.Tensor, m: torch.Tensor, s: torch.Tensor, w: Optional[torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, lse, entropy) [T]; entropy is [0] when w is None."""
    return _merge(target_z, m, s, w)


@_merge_op.register_fake
def _(target_z, m, s, w):
    return torch.empty_like(target_z), torch.empty_like(target_z), target_z.new_empty(m.shape[0] if w is not None else 0)


def _merge_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _merge_backward(ctx, grad_logp, grad_lse, grad_entropy):
    """The reference's gradient (the max is a constant, as in the chunk states): its autograd graph
    rebuilt from the saved states. The backward runs once per training step, off the sampler's path."""
    target_z, m, s, w = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (target_z, s, w) if t is not None]
        out = torch_merge_states(leaves[0], m, leaves[1], leaves[2] if w is not None else None)
        pairs = [(o, g) for o, g in zip(out, (grad_logp, grad_lse, grad_entropy)) if o is not None and g is not None]
        grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
    return grads[0], None, grads[1], grads[2] if w is not None else None


_merge_op.register_autograd(_merge_backward, setup_context=_merge_setup_context)


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, bias, temperature, *statics, _logits = inputs
    ctx.vocab_start, ctx.width, ctx.real_vocab_size, ctx.with_entropy = statics
    ctx.mark_non_differentiable(output[0])  # the max is a stabiliser: a constant, as in the reference
    ctx.save_for_backward(hidden, weight, targets, bias, temperature, output[0])


def _chunk_states_backward(ctx, _grad_m, grad_s, grad_w, grad_t):
    hidden, weight, targets, bias, temperature, m = ctx.saved_tensors
    need_hidden, need_weight, _, need_bias = ctx.needs_input_grad[:4]
    grad_h, grad_wt, grad_b = _chunk_states_backward_op(
        grad_s.contiguous(), grad_w.contiguous(), grad_t.contiguous(), hidden, weight, targets, bias, temperature,
        m, ctx.vocab_start, ctx.width, ctx.real_vocab_size, ctx.with_entropy, need_hidden, need_weight, need_bias)
    # the temperature gets no gradient: it is a sampling setting, not a parameter
    return (grad_h if need_hidden else None, grad_wt if need_weight else None, None,
            grad_b if need_bias else None, None, None, None, None, None, None)


_chunk_states_op.register_autograd(_chunk_states_backward, setup_context=_setup_context)


def _row_temperatures(temperature, hidden: torch.Tensor) -> torch.Tensor | None:
    """None, or one fp32 temperature per row, whether given as a float or as a tensor (built on the
    device: no host-to-device copy, so a call stays capturable in a CUDA graph)."""
    if temperature is None:
        return None
    if isinstance(temperature, torch.Tensor):
        return temperature.to(hidden.device, torch.float32).reshape(-1).expand(hidden.shape[0]).contiguous()
    return torch.full((hidden.shape[0],), float(temperature), dtype=torch.float32, device=hidden.device)


def chunk_states(hidden, weight, targets, *, vocab_start, width, real_vocab_size, bias, temperature,
                 with_entropy, logits=None) -> ChunkStates:
    """Triton version of lockstep.kernels.logp.torch_chunk_states (same signature and semantics)."""
    m, s, w, target_z = _call(_chunk_states_op, _forward, hidden, weight, targets, bias,
                              _row_temperatures(temperature, hidden), vocab_start, width, real_vocab_size,
                              with_entropy, logits)
    return ChunkStates(m, s, w if with_entropy else None, target_z)


def support_logits(hidden, weight, ids):
    """Triton version of lockstep.kernels.logp.torch_support_logits (the same bits): the kernel above."""
    return _call(_support_logits_op, _support_logits, hidden, weight, ids)


def head_logits(hidden, weight, *, width):
    """Triton version of lockstep.kernels.logp.torch_head_logits."""
    return _call(head_logits_op, _head_logits, hidden, weight, width)


def merge_states(target_z, m, s, w) -> LinearLogpOutput:
    """Triton version of lockstep.kernels.logp.torch_merge_states (the same bits on a GPU)."""
    logp, lse, entropy = _call(_merge_op, _merge, target_z, m, s, w)
    return LinearLogpOutput(logp, lse, entropy if w is not None else None)


def _call(op, fn, *args):
    """op(*args) where the custom op is needed: inside a torch.compile trace (opaque to it) and where
    autograd records the call (the op's registered backward); else fn(*args), the function the op
    wraps: the same kernels and bits without the custom op's dispatch, host time that vLLM's sampler
    pays on every decode step outside its CUDA graph (benchmarks/host_logp.py times both)."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
        return op(*args)
    return fn(*args)
