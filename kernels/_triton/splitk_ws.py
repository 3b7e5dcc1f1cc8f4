"""The row-parallel GEMM's canonical K-chunk tree (kernels/rowlinear.py, splitk.py) warp-specialised
in Gluon, for the many-tile shapes (GemmConfig.gluon in ROW_CONFIGS_16BIT); with one chunk it is a
plain GEMM, `linear`'s forward for the configs of its table that set gluon (matmul.py).

The same sums as splitk._row_tree_kernel at split 1: each chunk's product accumulated in fp32 from
zero over its BLOCK_K steps in ascending k (one wgmma group per step), the products joined in the
balanced tree ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7)) as they finish, the root rounded
once to the output dtype (or kept in fp32: a TP rank's subtree root).

Why Gluon: in Triton's `tl` the tree's join reads the accumulator inside the pipelined loop, so
the compiled loop waits for every MMA and restarts no loads across a join, and Triton 3.6's
automatic warp specialisation does not split that loop (benchmarks/RESULTS.md). Here the schedule
is explicit, as in Triton's warp-specialised Hopper GEMM:
- a producer warp walks every (tile, chunk, step) of its persistent program and issues the TMA
  loads of x (two 64-row halves) and the weight into a STAGES-deep ring, waiting only for a free
  slot, so loads keep flowing across the joins and from one tile into the next;
- two consumer warpgroups, each owning 64 of the tile's 128 rows with its own accumulator and
  pending subtrees (c_{j-1} and the pair in registers, the quad in shared memory), wait for a
  slot, issue the step's wgmma, free the previous step's slot once its wgmma is done (one left in
  flight: GemmConfig.wgmma_in_flight), and join at each chunk's end. They synchronise with nobody
  but the producer, so one multiplies while the other joins.
A tile's width (block_n) is a power of two, or one plus a smaller one (96 = 64 + 32, 192 = 128 + 64):
then each step is two wgmmas into two accumulators, so that tiles of qkv's 6,144 columns fill the
132 SMs. Which warpgroup, product or program computes an element never changes its sums; nor does
the tile order.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lockstep.kernels._triton._alignment import ALIGN_BYTES, is_aligned
from lockstep.kernels._triton._device import resident_programs
from lockstep.kernels._triton._order import grouped_tile, tree_join
from lockstep.kernels._triton.matmul_configs import GemmConfig

HALF = 64  # rows of a tile per consumer warpgroup (one wgmma M side)
SHARED_BYTES = 227 * 1024  # per block on H100 / H200
# registers a thread, set per partition (setmaxnreg): the producer issues loads, the consumers hold
# an accumulator and two pending subtrees (3 x 64 fp32 a thread)
PRODUCER_REGISTERS = gl.constexpr(40)
CONSUMER_REGISTERS = gl.constexpr(232)


@gluon.jit
def ring_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr = 2):
    """The (ready, empty) mbarriers of a STAGES-slot ring between one producer and CONSUMERS consumer
    warpgroups: a slot is ready once the producer's loads land, empty once every consumer freed it."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)  # one arrival per consumer warpgroup
    return ready, empty


@gluon.jit
def invalidate_ring(ready, empty, STAGES: gl.constexpr):
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


@gluon.jit
def _load_step(x_desc, w_desc, wt_desc, x0_smem, x1_smem, w_smem, wt_smem, ready, empty, t, pid_m, pid_n, k,
               STAGES: gl.constexpr, TAIL: gl.constexpr):
    """Slot t's loads: K columns k.. of the tile's two 64-row halves of x and its weight rows."""
    ROWS: gl.constexpr = x_desc.block_type.shape[0]
    HEAD: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = HEAD + TAIL
    NBYTES: gl.constexpr = 2 * x_desc.block_type.nbytes + w_desc.block_type.nbytes + (
        wt_desc.block_type.nbytes if TAIL > 0 else 0)
    s = t % STAGES
    # a slot is free once both consumers released it (its first use passes at once)
    mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
    bar = ready.index(s)
    mbarrier.expect(bar, NBYTES)
    tma.async_copy_global_to_shared(x_desc, [pid_m * 2 * ROWS, k], bar, x0_smem.index(s))
    tma.async_copy_global_to_shared(x_desc, [pid_m * 2 * ROWS + ROWS, k], bar, x1_smem.index(s))
    tma.async_copy_global_to_shared(w_desc, [pid_n * BLOCK_N, k], bar, w_smem.index(s))
    if TAIL > 0:
        tma.async_copy_global_to_shared(wt_desc, [pid_n * BLOCK_N + HEAD, k], bar, wt_smem.index(s))
    return t + 1


@gluon.jit
def _producer(x_desc, w_desc, wt_desc, x0_smem, x1_smem, w_smem, wt_smem, ready, empty, my_tiles, pid, num_programs,
              steps, num_pid_m, num_pid_n, K_PAD, CHUNKS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
              TAIL: gl.constexpr, SIBLINGS: gl.constexpr):
    """Every (tile, chunk, step) in the consumers' order: chunk after chunk, or with SIBLINGS chunks
    2i and 2i + 1 step by step, alternately. Chunk j's columns start at j * K_PAD (zero padding: exact)."""
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    t = 0
    for local in range(my_tiles):
        pid_m, pid_n = grouped_tile(pid + local * num_programs, num_pid_m, num_pid_n, GROUP_M)
        if SIBLINGS:
            for jp in range(CHUNKS // 2):
                for ki in range(steps):
                    for c in gl.static_range(2):
                        t = _load_step(x_desc, w_desc, wt_desc, x0_smem, x1_smem, w_smem, wt_smem, ready, empty, t,
                                       pid_m, pid_n, (2 * jp + c) * K_PAD + ki * BLOCK_K, STAGES, TAIL)
        else:
            for j in range(CHUNKS):
                for ki in range(steps):
                    t = _load_step(x_desc, w_desc, wt_desc, x0_smem, x1_smem, w_smem, wt_smem, ready, empty, t, pid_m,
                                   pid_n, j * K_PAD + ki * BLOCK_K, STAGES, TAIL)


@gluon.jit
def _join(v, j, h1, h2, quad_smem, layout: gl.constexpr, CHUNKS: gl.constexpr):
    """Chunk j's finished product v joins the tree (_order.tree_join): the pairs in registers, the
    quad waiting in quad_smem instead of a third register holder. Returns the holders and the newest
    subtree (after the last chunk: the root)."""
    PAIRS: gl.constexpr = 4 if CHUNKS > 4 else CHUNKS
    h1, h2, _, v = tree_join(v, j, h1, h2, h2, PAIRS)  # (its quad holder unused below 8 chunks)
    if CHUNKS > 4:  # the quad's join, after the pair's, as in tree_join
        if j % 8 == 7:
            v = quad_smem.load(layout) + v  # each thread reads back only what it stored
        if j % 8 == 3:
            quad_smem.store(v)
    return h1, h2, v


@gluon.jit
def issue_slot(a_smem, b_smem, ready, acc, t, first_from_zero: gl.constexpr, STAGES: gl.constexpr,
               STEPS: gl.constexpr):
    """Once slot t's loads landed, its STEPS wgmma groups acc += a @ b^T (STEPS buffers a slot in
    a_smem and b_smem), ascending k, left in flight; first_from_zero: the first starts from zero."""
    s = t % STAGES
    mbarrier.wait(ready.index(s), (t // STAGES) & 1)
    for i in gl.static_range(STEPS):
        acc = warpgroup_mma(a_smem.index(s * STEPS + i), b_smem.index(s * STEPS + i).permute((1, 0)), acc,
                            use_acc=i > 0 or not first_from_zero, is_async=True)
    return acc


@gluon.jit
def open_chunk(a_smem, b_smem, ready, empty, acc, prev, t, JOIN_PREV: gl.constexpr, STAGES: gl.constexpr,
               STEPS: gl.constexpr):
    """A K chunk's first slot into acc, from zero, with two accumulators alternating over the chunks
    (GemmConfig.accumulators; swap_ws.py always). JOIN_PREV: the previous chunk is in prev with its
    last slot's groups in flight; once acc's are issued they are waited for (wgmma groups complete in
    issue order) and their slot freed, so the caller joins prev into the tree while acc's groups run.
    Returns acc, prev and the next slot."""
    acc = issue_slot(a_smem, b_smem, ready, acc, t, True, STAGES, STEPS)
    if JOIN_PREV:
        prev, acc = warpgroup_mma_wait(num_outstanding=STEPS, deps=(prev, acc))
        mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), count=1)
    else:  # nothing older in flight: the wait only hands acc on (as a tensor), its groups still running
        acc = warpgroup_mma_wait(num_outstanding=STEPS, deps=(acc,))
    return acc, prev, t + 1


@gluon.jit
def continue_chunk(a_smem, b_smem, ready, empty, acc, t, slots, STAGES: gl.constexpr, STEPS: gl.constexpr):
    """The chunk's slots after its first (open_chunk), each freeing the one before it once that one's
    groups are done. Returns acc and the next slot."""
    for _ in range(1, slots):
        acc = issue_slot(a_smem, b_smem, ready, acc, t, False, STAGES, STEPS)
        acc = warpgroup_mma_wait(num_outstanding=STEPS, deps=(acc,))
        mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), count=1)
        t += 1
    return acc, t


@gluon.jit
def _alternating_chunk(x_smem, w_smem, ready, empty, quad_smem, acc, prev, h1, h2, t, steps, j: gl.constexpr,
                       layout: gl.constexpr, CHUNKS: gl.constexpr, STAGES: gl.constexpr):
    """Chunk j of a tile into acc, one K step a slot; chunk j - 1 (in prev) joins the tree while
    acc's first wgmma runs."""
    acc, prev, t = open_chunk(x_smem, w_smem, ready, empty, acc, prev, t, j > 0, STAGES, 1)
    if j > 0:
        h1, h2, prev = _join(prev, j - 1, h1, h2, quad_smem, layout, CHUNKS)
    acc, t = continue_chunk(x_smem, w_smem, ready, empty, acc, t, steps, STAGES, 1)
    return acc, prev, h1, h2, t


@gluon.jit
def _sibling_step(x_smem, w_smem, ready, empty, acc, sibling, t, ki, SECOND: gl.constexpr, STAGES: gl.constexpr):
    """Step ki (slot t) of a chunk into acc, left in flight, from zero at ki 0. Then the sibling's step
    issued before it is done (wgmma groups complete in issue order) and its slot freed; the first
    chunk's first step has none in flight (the pair before was drained, its last slot freed).
    SECOND: acc is the pair's second chunk. Returns acc, the sibling and the next slot."""
    s = t % STAGES
    mbarrier.wait(ready.index(s), (t // STAGES) & 1)
    acc = warpgroup_mma(x_smem.index(s), w_smem.index(s).permute((1, 0)), acc, use_acc=ki > 0, is_async=True)
    acc, sibling = warpgroup_mma_wait(num_outstanding=1, deps=(acc, sibling))
    if SECOND:
        mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), count=1)
    else:
        mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), count=1, pred=ki > 0)
    return acc, sibling, t + 1


@gluon.jit
def _store_tma(acc, o_desc, c_smem, row0, col0):
    """acc to out[row0:, col0:] through shared memory and a TMA store left in flight, so the next
    tile's wgmmas overlap it (GemmConfig.tma_store); the previous tile's store has read the buffer
    first. The TMA clips what lies past M and N."""
    tma.store_wait(0)
    c_smem.store(acc.to(o_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row0, col0], c_smem)


@gluon.jit
def _store(acc, out_ptr, row0, col0, M, N, stride_o, layout: gl.constexpr):
    offs_m = row0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    offs_n = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    ptrs = out_ptr + offs_m.to(gl.int64)[:, None] * stride_o + offs_n[None, :]
    gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@gluon.jit
def _consumer(x_smem, w_smem, wt_smem, ready, empty, quad_smem, quadt_smem, out_ptr, o_desc, ot_desc, c_smem, ct_smem,
              M, N, stride_o, my_tiles, pid, num_programs, steps, num_pid_m, num_pid_n, ROW_HALF: gl.constexpr,
              CHUNKS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr, HEAD: gl.constexpr,
              TAIL: gl.constexpr, IN_FLIGHT: gl.constexpr, ALTERNATE: gl.constexpr, SIBLINGS: gl.constexpr,
              TMA_STORE: gl.constexpr):
    """Rows ROW_HALF * ROWS .. + ROWS of every tile: multiply, free the slot, join at chunk ends
    (the quads waiting in quad_smem, quadt_smem), write the root. A tile of HEAD + TAIL columns
    (TAIL > 0: a width that is no power of two) is two products, HEAD and TAIL columns wide, each
    element the same sum."""
    BLOCK_N: gl.constexpr = HEAD + TAIL
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD, 16])
    mma_t: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, TAIL if TAIL > 0 else 8, 16])
    # the wgmma groups a step leaves in flight: its one or two products
    PENDING: gl.constexpr = IN_FLIGHT * (2 if TAIL > 0 else 1)
    acc = gl.zeros([ROWS, HEAD], gl.float32, mma)
    h1 = gl.zeros([ROWS, HEAD], gl.float32, mma)  # a finished chunk waiting for its sibling
    h2 = gl.zeros([ROWS, HEAD], gl.float32, mma)  # a finished pair
    if TAIL > 0:
        acc_t = gl.zeros([ROWS, TAIL], gl.float32, mma_t)
        h1_t = gl.zeros([ROWS, TAIL], gl.float32, mma_t)
        h2_t = gl.zeros([ROWS, TAIL], gl.float32, mma_t)
    if ALTERNATE or SIBLINGS:  # a second accumulator (GemmConfig.accumulators = 2 or siblings; CHUNKS even, TAIL 0)
        gl.static_assert(CHUNKS % 2 == 0 and TAIL == 0, "the two-accumulator schedules take chunks in pairs and "
                         "a power-of-two block_n: row_tree_ws passes ALTERNATE / SIBLINGS only at 2, 4 or 8 chunks")
        other = gl.zeros([ROWS, HEAD], gl.float32, mma)
    t = 0
    for local in range(my_tiles):
        pid_m, pid_n = grouped_tile(pid + local * num_programs, num_pid_m, num_pid_n, GROUP_M)
        if ALTERNATE:
            for jp in gl.static_range(CHUNKS // 2):
                acc, other, h1, h2, t = _alternating_chunk(x_smem, w_smem, ready, empty, quad_smem, acc, other, h1,
                                                           h2, t, steps, 2 * jp, mma, CHUNKS, STAGES)
                other, acc, h1, h2, t = _alternating_chunk(x_smem, w_smem, ready, empty, quad_smem, other, acc, h1,
                                                           h2, t, steps, 2 * jp + 1, mma, CHUNKS, STAGES)
            # the tile's last chunk: drained (one wait a tile), its slot freed, joined
            other = warpgroup_mma_wait(num_outstanding=0, deps=(other,))
            mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), count=1)
            h1, h2, acc = _join(other, CHUNKS - 1, h1, h2, quad_smem, mma, CHUNKS)
        elif SIBLINGS:  # sibling chunks step by step into acc and other (GemmConfig.siblings; CHUNKS even, TAIL 0)
            for jp in gl.static_range(CHUNKS // 2):
                for ki in range(steps):  # ascending k in each; a chunk's first step starts from zero
                    acc, other, t = _sibling_step(x_smem, w_smem, ready, empty, acc, other, t, ki, False, STAGES)
                    other, acc, t = _sibling_step(x_smem, w_smem, ready, empty, other, acc, t, ki, True, STAGES)
                # the pair drained (one wait every two chunks), its last slot freed, joined: chunk 2jp + 1
                # joins its sibling (acc, as the pair's left holder), then the tree above
                acc, other = warpgroup_mma_wait(num_outstanding=0, deps=(acc, other))
                mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), count=1)
                _, h2, acc = _join(other, 2 * jp + 1, acc, h2, quad_smem, mma, CHUNKS)
        else:
            for j in range(CHUNKS):
                for ki in range(steps):  # ascending k; the chunk's first step starts from zero
                    s = t % STAGES
                    mbarrier.wait(ready.index(s), (t // STAGES) & 1)
                    acc = warpgroup_mma(x_smem.index(s), w_smem.index(s).permute((1, 0)), acc, use_acc=ki > 0,
                                        is_async=True)
                    if TAIL > 0:
                        acc_t = warpgroup_mma(x_smem.index(s), wt_smem.index(s).permute((1, 0)), acc_t, use_acc=ki > 0,
                                              is_async=True)
                        acc, acc_t = warpgroup_mma_wait(num_outstanding=PENDING, deps=(acc, acc_t))
                    else:
                        acc = warpgroup_mma_wait(num_outstanding=PENDING, deps=(acc,))
                    # IN_FLIGHT 1: step ki's MMAs stay in flight while step ki - 1's slot is freed and the
                    # next slot awaited (the MMAs of one accumulator run in issue order either way)
                    mbarrier.arrive(empty.index((t + STAGES - IN_FLIGHT) % STAGES), count=1, pred=ki >= IN_FLIGHT)
                    t += 1
                if IN_FLIGHT > 0:  # the chunk's last MMAs, before its product joins the tree
                    if TAIL > 0:
                        acc, acc_t = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_t))
                    else:
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), count=1)
                h1, h2, acc = _join(acc, j, h1, h2, quad_smem, mma, CHUNKS)
                if TAIL > 0:
                    h1_t, h2_t, acc_t = _join(acc_t, j, h1_t, h2_t, quadt_smem, mma_t, CHUNKS)
        row0 = pid_m * 2 * ROWS + ROW_HALF * ROWS
        if TMA_STORE:
            _store_tma(acc, o_desc, c_smem, row0, pid_n * BLOCK_N)
            if TAIL > 0:
                _store_tma(acc_t, ot_desc, ct_smem, row0, pid_n * BLOCK_N + HEAD)
        else:
            _store(acc, out_ptr, row0, pid_n * BLOCK_N, M, N, stride_o, mma)
            if TAIL > 0:
                _store(acc_t, out_ptr, row0, pid_n * BLOCK_N + HEAD, M, N, stride_o, mma_t)
    if TMA_STORE:  # the last tile's stores have left shared memory
        tma.store_wait(0)


@gluon.jit
def _quad(ROWS: gl.constexpr, COLS: gl.constexpr, CHUNKS: gl.constexpr):
    """A consumer's pending quad of ROWS x COLS fp32, for a tree of 8 chunks (a token 16 x 16 block
    otherwise, never read)."""
    QUAD_ROWS: gl.constexpr = ROWS if CHUNKS > 4 and COLS > 0 else 16
    QUAD_COLS: gl.constexpr = COLS if CHUNKS > 4 and COLS > 0 else 16
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([QUAD_ROWS, QUAD_COLS], gl.float32)
    return gl.allocate_shared_memory(gl.float32, [QUAD_ROWS, QUAD_COLS], layout)


# M is not specialised (one binary for every batch size), as in splitk._row_tree_kernel.
@gluon.jit(do_not_specialize=["M"])
def _row_tree_ws_kernel(x_desc, w_desc, wt_desc, o_desc, ot_desc, out_ptr, M, N, K_CHUNK, K_PAD, stride_o,
                        num_programs, CHUNKS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                        TAIL: gl.constexpr, IN_FLIGHT: gl.constexpr, ALTERNATE: gl.constexpr, TMA_STORE: gl.constexpr,
                        SIBLINGS: gl.constexpr):
    """TAIL > 0: a tile's weight rows are w_desc's block (a power of two) and wt_desc's TAIL more;
    TAIL = 0: w_desc's block alone (wt_desc unused). TMA_STORE: the tile leaves through o_desc's
    (and ot_desc's) blocks of out; otherwise through out_ptr (the descriptors unused)."""
    ROWS: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    HEAD: gl.constexpr = w_desc.block_type.shape[0]
    pid = gl.program_id(0)
    num_pid_m = gl.cdiv(M, 2 * ROWS)
    num_pid_n = gl.cdiv(N, HEAD + TAIL)
    my_tiles = (num_pid_m * num_pid_n - pid + num_programs - 1) // num_programs
    steps = gl.cdiv(K_CHUNK, BLOCK_K)
    x0_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, ROWS, BLOCK_K], x_desc.layout)
    x1_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, ROWS, BLOCK_K], x_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, HEAD, BLOCK_K], w_desc.layout)
    if TAIL > 0:
        wt_smem = gl.allocate_shared_memory(wt_desc.dtype, [STAGES, TAIL, BLOCK_K], wt_desc.layout)
    else:
        wt_smem = w_smem
    ready, empty = ring_barriers(STAGES)
    quad0 = _quad(ROWS, HEAD, CHUNKS)
    quad1 = _quad(ROWS, HEAD, CHUNKS)
    quadt0 = _quad(ROWS, TAIL, CHUNKS)
    quadt1 = _quad(ROWS, TAIL, CHUNKS)
    if TMA_STORE:  # each consumer's tile on its way out
        c0 = gl.allocate_shared_memory(o_desc.dtype, [ROWS, HEAD], o_desc.layout)
        c1 = gl.allocate_shared_memory(o_desc.dtype, [ROWS, HEAD], o_desc.layout)
        if TAIL > 0:
            ct0 = gl.allocate_shared_memory(ot_desc.dtype, [ROWS, TAIL], ot_desc.layout)
            ct1 = gl.allocate_shared_memory(ot_desc.dtype, [ROWS, TAIL], ot_desc.layout)
        else:
            ct0, ct1 = c0, c1
    else:  # (unused)
        c0, c1, ct0, ct1 = quad0, quad1, quadt0, quadt1
    # (the argument tuples are written out in the call: a tuple variable loses their constexprs)
    gl.warp_specialize([
        (_consumer, (x0_smem, w_smem, wt_smem, ready, empty, quad0, quadt0, out_ptr, o_desc, ot_desc, c0, ct0, M, N,
                     stride_o, my_tiles, pid, num_programs, steps, num_pid_m, num_pid_n, 0, CHUNKS, GROUP_M, STAGES,
                     ROWS, HEAD, TAIL, IN_FLIGHT, ALTERNATE, SIBLINGS, TMA_STORE)),
        (_consumer, (x1_smem, w_smem, wt_smem, ready, empty, quad1, quadt1, out_ptr, o_desc, ot_desc, c1, ct1, M, N,
                     stride_o, my_tiles, pid, num_programs, steps, num_pid_m, num_pid_n, 1, CHUNKS, GROUP_M, STAGES,
                     ROWS, HEAD, TAIL, IN_FLIGHT, ALTERNATE, SIBLINGS, TMA_STORE)),
        (_producer, (x_desc, w_desc, wt_desc, x0_smem, x1_smem, w_smem, wt_smem, ready, empty, my_tiles, pid,
                     num_programs, steps, num_pid_m, num_pid_n, K_PAD, CHUNKS, GROUP_M, STAGES, TAIL, SIBLINGS)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])
    invalidate_ring(ready, empty, STAGES)


def split_width(block_n: int) -> tuple[int, int]:
    """A Gluon tile's weight rows as (head, tail): the largest power of two and what is left, itself
    a power of two or 0 (96 = 64 + 32: a consumer's two wgmmas)."""
    head = 1 << (block_n.bit_length() - 1)
    tail = block_n - head
    if head < 16 or (tail and (tail < 16 or tail & (tail - 1))):
        raise ValueError(f"a Gluon tile's block_n = {block_n} must be a power of two from 16, or one plus a "
                         "smaller one from 16 (e.g. 96 = 64 + 32)")
    return head, tail


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


def gluon_layout(block: list[int], dtype: torch.dtype = torch.bfloat16) -> gl.NVMMASharedLayout:
    """The shared layout of a TMA block of a matrix (16-bit: the wgmma operand swizzle; fp32: a
    tree's subtree roots on their way out)."""
    return gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[dtype])


def gluon_descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A Gluon TMA descriptor of the row-major matrix t (16-bit), in blocks of `block`."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, gluon_layout(block, t.dtype))


def _ring_and_quads(cfg: GemmConfig, chunks: int, bk: int, operand_bytes: int) -> int:
    """Shared bytes of the ring's x and weight tiles and, for 8 chunks, the two consumers' pending quads."""
    quads = 2 * HALF * cfg.block_n * 4 if chunks > 4 else 0
    return cfg.num_stages * (2 * HALF + cfg.block_n) * bk * operand_bytes + quads


def tma_store_fits(cfg: GemmConfig, chunks: int, bk: int, operand_bytes: int, out_bytes: int) -> bool:
    """Whether cfg's tiles leave by TMA store (GemmConfig.tma_store): the two consumers' output tiles
    fit in shared memory beside the ring and the quads."""
    return cfg.tma_store and (_ring_and_quads(cfg, chunks, bk, operand_bytes) + 2 * HALF * cfg.block_n * out_bytes
                              <= SHARED_BYTES)


def row_tree_ws(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, chunks: int, chunk: int, padded: int,
                bk: int, cfg: GemmConfig) -> None:
    """out [M, N] = the canonical tree over the `chunks` chunks of x [M, chunks * padded] @ weight^T
    (chunk c's columns start at c * padded; `chunk` real columns each), one persistent program per
    SM. x and weight are row-major with 16-byte aligned rows (splitk._chunk_operand's operands).
    One chunk of K columns (padded = chunk = K): `linear`'s product, its K tail TMA zero-fill."""
    if not cfg.gluon:
        raise ValueError(f"{cfg}: not a Gluon config (gluon=False)")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"row_tree: {cfg}: the warp-specialised tree multiplies 16-bit operands (wgmma), got {x.dtype}")
    if cfg.block_m != 2 * HALF or cfg.num_warps != 4:
        raise ValueError(f"row_tree: {cfg}: the warp-specialised tree takes block_m={2 * HALF} (two consumer "
                         f"warpgroups of {HALF} rows) and num_warps=4 (each consumer's warps)")
    head, tail = split_width(cfg.block_n)
    shared = _ring_and_quads(cfg, chunks, bk, x.element_size())
    if shared > SHARED_BYTES:
        raise ValueError(f"row_tree: {cfg}: {cfg.num_stages} stages of x and weight tiles plus the two pending quads "
                         f"take {shared} bytes of shared memory, more than the {SHARED_BYTES} of a Hopper SM")
    m, n = out.shape
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    programs = min(tiles, resident_programs(x.device))
    w_desc = gluon_descriptor(weight, [head, bk])
    # GemmConfig.tma_store: where both consumers' tiles fit beside the ring and the quads and out is a
    # TMA operand (a TP rank's fp32 roots may not fit: they leave from registers, the same values)
    tma_store = (tma_store_fits(cfg, chunks, bk, x.element_size(), out.element_size())
                 and is_aligned(out) and (out.stride(0) * out.element_size()) % ALIGN_BYTES == 0)
    o_desc = gluon_descriptor(out, [HALF, head]) if tma_store else w_desc
    ot_desc = gluon_descriptor(out, [HALF, tail]) if tma_store and tail else o_desc
    _row_tree_ws_kernel[(programs,)](
        gluon_descriptor(x, [HALF, bk]), w_desc, gluon_descriptor(weight, [tail, bk]) if tail else w_desc, o_desc,
        ot_desc, out, m, n, chunk, padded, out.stride(0), programs, CHUNKS=chunks, GROUP_M=cfg.group_m,
        STAGES=cfg.num_stages, TAIL=tail, IN_FLIGHT=cfg.wgmma_in_flight, ALTERNATE=cfg.accumulators == 2 and chunks > 1,
        TMA_STORE=tma_store, SIBLINGS=cfg.siblings and chunks > 1, num_warps=cfg.num_warps)
