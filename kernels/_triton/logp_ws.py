"""linear_logp's multiplying chunk-state kernel (logp._chunk_states_kernel) warp-specialised in
Gluon for 16-bit operands on Hopper: the same products, the same fold, the same bits.

Why: in the `tl` kernel the warps that multiply also fold each finished 128x128 tile (its max, 16K
exponentials, the fixed-order row sums), and the tensor cores idle while they do: about as long as
the tile's last few K steps. Here the fold of tile i runs while the MMAs of tile i + 1 are already
in flight:
- a producer warp walks every (tile, K step) of the program's vocab chunk and issues the TMA loads
  of the hidden rows (two 64-row halves) and the weight tile into a STAGES-deep ring;
- two consumer warpgroups each own 64 of the block's 128 rows: for every tile they issue its first
  AHEAD K steps as asynchronous wgmma groups without waiting, fold the previous tile's finished
  accumulator meanwhile, then run the tile's remaining steps (one group in flight) and drain it.
  Each frees a ring slot once its own MMAs have read it; they synchronise with nobody but the
  producer.

The numerics are logp.py's: each logit the fp32 sum over BLOCK_K steps in ascending k (one wgmma
group a step, 64x128x16 instructions as in the `tl` kernel), the tiles of a chunk folded in
ascending column order with the same operations (bias, 1 / temperature, masks, running max,
exp, the balanced row-sum tree over the tile's columns). Two notes on the sums:
- the row-sum tree adds column j and column j + C/2 at every level as a reduction over an axis of
  two (gl.sum of [R, 2, C/2]): a sum of two numbers is the same in either order, so this is
  `_tree_sum`'s split-and-add, without the split's demand that both halves sit in one thread;
- which warpgroup holds a row never changes its arithmetic.
The GPU tests compare every output with the `tl` kernel bit for bit.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from lockstep.kernels._triton.splitk_ws import CONSUMER_REGISTERS, HALF, PRODUCER_REGISTERS, gluon_descriptor

# K steps of a tile issued before the previous tile is folded: the fold (~1.5K cycles of MUFU and
# ALU work a warpgroup) runs while the two warpgroups' AHEAD steps (~490 cycles each) multiply.
AHEAD = 3
STAGES = 6  # ring slots of (2 x 64 hidden rows + 128 weight rows) x 64 features: 32 KiB each
ROWS = gl.constexpr(HALF)  # rows a consumer warpgroup owns (a wgmma's M side); the block holds two


@gluon.jit
def _program_tile(n_row_blocks, n_col_tiles, GROUP_T: gl.constexpr):
    """logp._program_tile: GROUP_T row blocks sweep the vocab chunks side by side."""
    pid = gl.program_id(0)
    per_group = GROUP_T * n_col_tiles
    first = (pid // per_group) * GROUP_T
    size = gl.minimum(n_row_blocks - first, GROUP_T)
    idx = pid % per_group
    return first + idx % size, idx // size


@gluon.jit
def _producer(h_desc, w_desc, h_smem, w_smem, ready, empty, row0, lo, n_steps, steps, STAGES: gl.constexpr):
    BLOCK_K: gl.constexpr = h_desc.block_type.shape[1]
    BLOCK_V: gl.constexpr = w_desc.block_type.shape[0]
    for t in range(n_steps):
        s = t % STAGES
        # a slot is free once both consumers released it (its first use passes at once)
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, 2 * h_desc.block_type.nbytes + w_desc.block_type.nbytes)
        k = (t % steps) * BLOCK_K
        tma.async_copy_global_to_shared(h_desc, [row0, k], bar, h_smem.index(2 * s))
        tma.async_copy_global_to_shared(h_desc, [row0 + ROWS, k], bar, h_smem.index(2 * s + 1))
        tma.async_copy_global_to_shared(w_desc, [lo + (t // steps) * BLOCK_V, k], bar, w_smem.index(s))


@gluon.jit
def _tree_sum(x, LOG2_N: gl.constexpr):
    """Row sums of x [R, 2**LOG2_N]: column j meets j + N/2 first (logp._tree_sum's tree)."""
    for _ in gl.static_range(LOG2_N):
        x = gl.sum(gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), axis=1)
    return gl.reshape(x, [x.shape[0]])


@gluon.jit
def _fold(z, m, s, w, tz, c0, hi, b_ptr, inv_temp, target, V_local, vocab_start, real_vocab_size, mma: gl.constexpr,
          HAS_BIAS: gl.constexpr, HAS_TEMP: gl.constexpr, WITH_ENTROPY: gl.constexpr, LOG2_V: gl.constexpr):
    """logp._logits' epilogue and logp._merge_tile for one finished tile z [64, BLOCK_V]."""
    BLOCK_V: gl.constexpr = z.shape[1]
    rows_of: gl.constexpr = gl.SliceLayout(1, mma)
    cols = c0 + gl.arange(0, BLOCK_V, layout=gl.SliceLayout(0, mma))
    if HAS_BIAS:
        z += gl.load(b_ptr + cols, mask=cols < V_local, other=0.0).to(gl.float32)[None, :]
    if HAS_TEMP:
        z *= inv_temp[:, None]
    valid = (cols < hi) & (vocab_start + cols < real_vocab_size)
    z = gl.where(valid[None, :], z, float("-inf"))
    # the target's logit plus exact zeros: the same value in any summation order
    tz += gl.sum(gl.where(cols[None, :] == target[:, None], z, 0.0), axis=1)
    m_new = gl.maximum(m, gl.max(z, axis=1))
    base = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp(m - base)
    p = gl.exp(z - base[:, None])
    s = s * alpha + gl.convert_layout(_tree_sum(p, LOG2_V), rows_of)
    if WITH_ENTROPY:
        w = w * alpha + gl.convert_layout(_tree_sum(p * gl.where(valid[None, :], z, 0.0), LOG2_V), rows_of)
    return m_new, s, w, tz


@gluon.jit
def _consumer(h_smem, w_smem, ready, empty, b_ptr, temp_ptr, tgt_ptr, m_ptr, s_ptr, ent_ptr, tz_ptr, T, V_local,
              n_chunks, vocab_start, real_vocab_size, row0, chunk, lo, hi, n_tiles, steps, ROW_HALF: gl.constexpr,
              HAS_BIAS: gl.constexpr, HAS_TEMP: gl.constexpr, WITH_ENTROPY: gl.constexpr, LOG2_V: gl.constexpr,
              STAGES: gl.constexpr, AHEAD: gl.constexpr, BLOCK_V: gl.constexpr):
    """Rows row0 + ROW_HALF * 64 .. + 64 of the block: every tile of the chunk multiplied, each folded
    while the next one's first AHEAD K steps multiply, the chunk's states stored."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_V, 16])
    rows_of: gl.constexpr = gl.SliceLayout(1, mma)
    rows = row0 + ROW_HALF * ROWS + gl.arange(0, ROWS, layout=rows_of)
    row_ok = rows < T
    if HAS_TEMP:
        inv_temp = gl.div_rn(1.0, gl.load(temp_ptr + rows, mask=row_ok, other=1.0))
    else:
        inv_temp = gl.full([ROWS], 1.0, gl.float32, rows_of)
    target = (gl.load(tgt_ptr + rows, mask=row_ok, other=-1) - vocab_start).to(gl.int32)
    m = gl.full([ROWS], float("-inf"), gl.float32, rows_of)
    s = gl.zeros([ROWS], gl.float32, rows_of)
    w = gl.zeros([ROWS], gl.float32, rows_of)
    tz = gl.zeros([ROWS], gl.float32, rows_of)
    zeros = gl.zeros([ROWS, BLOCK_V], gl.float32, mma)
    prev = zeros
    t = 0
    released = 0
    for tile in range(n_tiles):
        # the tile's first AHEAD steps go out without a wait ...
        acc = zeros
        for j in gl.static_range(AHEAD):
            slot = t % STAGES
            mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
            acc = warpgroup_mma(h_smem.index(2 * slot + ROW_HALF), w_smem.index(slot).permute((1, 0)), acc,
                                use_acc=j > 0, is_async=True)
            t += 1
        # (no wait: at most the AHEAD groups just issued are in flight; as in Triton's own pipelined
        # loops the value stays in flight, and only the next wgmma touches it until the drain)
        acc = warpgroup_mma_wait(num_outstanding=AHEAD, deps=(acc,))
        # ... and multiply while the previous tile (finished: drained below) is folded
        if tile > 0:
            m, s, w, tz = _fold(prev, m, s, w, tz, lo + (tile - 1) * BLOCK_V, hi, b_ptr, inv_temp, target, V_local,
                                vocab_start, real_vocab_size, mma, HAS_BIAS, HAS_TEMP, WITH_ENTROPY, LOG2_V)
        for _ in range(AHEAD, steps):
            slot = t % STAGES
            mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
            acc = warpgroup_mma(h_smem.index(2 * slot + ROW_HALF), w_smem.index(slot).permute((1, 0)), acc,
                                is_async=True)
            t += 1
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            for r in range(released, t - 1):  # every step but the newest has read its slot
                mbarrier.arrive(empty.index(r % STAGES), count=1)
            released = t - 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        for r in range(released, t):
            mbarrier.arrive(empty.index(r % STAGES), count=1)
        released = t
        prev = acc
    m, s, w, tz = _fold(prev, m, s, w, tz, lo + (n_tiles - 1) * BLOCK_V, hi, b_ptr, inv_temp, target, V_local,
                        vocab_start, real_vocab_size, mma, HAS_BIAS, HAS_TEMP, WITH_ENTROPY, LOG2_V)
    at = rows * n_chunks + chunk
    gl.store(m_ptr + at, m, mask=row_ok)
    gl.store(s_ptr + at, s, mask=row_ok)
    if WITH_ENTROPY:
        gl.store(ent_ptr + at, w, mask=row_ok)
    # one writer per row, as in logp._chunk_states_kernel
    local = (target >= 0) & (target < V_local)
    writes = gl.where(local, (target >= lo) & (target < hi), chunk == 0)
    gl.store(tz_ptr + rows, gl.where(local, tz, 0.0), mask=row_ok & writes)


# T and vocab_start are not specialised, as in logp._chunk_states_kernel.
@gluon.jit(do_not_specialize=["T", "vocab_start"])
def _chunk_states_ws_kernel(h_desc, w_desc, b_ptr, temp_ptr, tgt_ptr, m_ptr, s_ptr, ent_ptr, tz_ptr, T, H, V_local,
                            n_chunks, width, vocab_start, real_vocab_size, HAS_BIAS: gl.constexpr,
                            HAS_TEMP: gl.constexpr, WITH_ENTROPY: gl.constexpr, LOG2_V: gl.constexpr,
                            GROUP_T: gl.constexpr, STAGES: gl.constexpr, AHEAD: gl.constexpr):
    BLOCK_K: gl.constexpr = h_desc.block_type.shape[1]
    BLOCK_V: gl.constexpr = w_desc.block_type.shape[0]
    row_block, chunk = _program_tile(gl.cdiv(T, 2 * ROWS), n_chunks, GROUP_T)
    row0 = row_block * 2 * ROWS
    lo = chunk * width
    hi = gl.minimum(lo + width, V_local)
    n_tiles = gl.cdiv(hi - lo, BLOCK_V)
    steps = gl.cdiv(H, BLOCK_K)
    h_smem = gl.allocate_shared_memory(h_desc.dtype, [2 * STAGES, ROWS, BLOCK_K], h_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_V, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    # (the argument tuples are written out in the call: a tuple variable loses their constexprs)
    gl.warp_specialize([
        (_consumer, (h_smem, w_smem, ready, empty, b_ptr, temp_ptr, tgt_ptr, m_ptr, s_ptr, ent_ptr, tz_ptr, T, V_local,
                     n_chunks, vocab_start, real_vocab_size, row0, chunk, lo, hi, n_tiles, steps, 0, HAS_BIAS,
                     HAS_TEMP, WITH_ENTROPY, LOG2_V, STAGES, AHEAD, BLOCK_V)),
        (_consumer, (h_smem, w_smem, ready, empty, b_ptr, temp_ptr, tgt_ptr, m_ptr, s_ptr, ent_ptr, tz_ptr, T, V_local,
                     n_chunks, vocab_start, real_vocab_size, row0, chunk, lo, hi, n_tiles, steps, 1, HAS_BIAS,
                     HAS_TEMP, WITH_ENTROPY, LOG2_V, STAGES, AHEAD, BLOCK_V)),
        (_producer, (h_desc, w_desc, h_smem, w_smem, ready, empty, row0, lo, n_tiles * steps, steps, STAGES)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


def chunk_states_ws(hidden, weight, args: dict, **outputs) -> None:
    """Launch the kernel on logp._launch_args' arguments: one program per (128-row block, vocab
    chunk), in logp's grouped order. hidden [T, H] and weight [V_local, H] are 16-bit, row-major
    with 16-byte aligned rows; H must hold at least AHEAD K steps."""
    bk, bv = args["BLOCK_K"], args["BLOCK_V"]
    if -(-args["H"] // bk) < AHEAD:
        raise ValueError(f"linear_logp's warp-specialised kernel issues {AHEAD} K steps of {bk} ahead; "
                         f"H = {args['H']} holds fewer")
    grid = (-(-args["T"] // (2 * HALF)) * args["n_chunks"],)
    _chunk_states_ws_kernel[grid](
        gluon_descriptor(hidden, [HALF, bk]), gluon_descriptor(weight, [bv, bk]), args["b_ptr"], args["temp_ptr"],
        args["tgt_ptr"], outputs["m_ptr"], outputs["s_ptr"], outputs["ent_ptr"], outputs["tz_ptr"], args["T"],
        args["H"], args["V_local"], args["n_chunks"], args["width"], args["vocab_start"], args["real_vocab_size"],
        HAS_BIAS=args["HAS_BIAS"], HAS_TEMP=args["HAS_TEMP"], WITH_ENTROPY=args["WITH_ENTROPY"],
        LOG2_V=args["LOG2_V"], GROUP_T=args["GROUP_T"], STAGES=STAGES, AHEAD=AHEAD, num_warps=4)
