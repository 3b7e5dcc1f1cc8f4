"""Decode-sized products with swapped operands (x @ weight^T, few rows of x), warp-specialised in
Gluon: `linear`'s swapped buckets that set gluon (matmul_configs.py), and the row-parallel tree's
decode bucket (splitk.py, kernels/rowlinear.py), which is the same schedule over K chunks.

The same sums as the tl kernels: C^T = W @ X^T, 64 weight rows a program (GemmConfig.block_n; 128: two
wgmmas a step on the same rows of x) as the wgmma's M side and the rows of x (16-128, zero-filled past
M by TMA) as its N side. `linear` (one chunk: matmul._gemm_swap_kernel's sums): each element
accumulated in fp32 over the BLOCK_K steps in ascending k, one wgmma group a step, the first step
from zero. The tree (splitk._row_tree_kernel's sums at the same split): each chunk's
product so, the chunk products of a program's subtree joined in the canonical tree (_order.tree_join),
and with SPLIT > 1 programs a tile, the subtree roots summed in the tree's top levels by the tile's last
program to take a ticket (_order.tree_root, _tickets.py). Which warps issue the loads, how many steps
share a barrier, and which program finishes a tile never change a sum.

Why: at decode sizes a program does little per step (a 64 x 16 x 64 product), yet the tl kernel
waits on a barrier and a wgmma every step; its rate did not move with its stage count (8-14), so the
loads in flight were not what it waited for (qkv's 96 programs leave 36 SMs idle: each program's
rate is the product's rate). This schedule, which waits once every STEPS steps, ran 1.03x cuBLAS
on qkv at M = 1 and 8 where the tl kernel ran 0.86-0.89x (matmul_configs.py, benchmarks/RESULTS.md).
Here a producer warp issues the TMA loads of STEPS K steps into each slot of a STAGES-deep ring, and one
consumer warpgroup waits once a slot, issues its STEPS wgmma groups, leaves them in flight while it
frees the previous slot and awaits the next. Over K chunks the consumer alternates two accumulators:
a chunk's first slot is issued before the previous chunk is waited for and joined, so the tensor
cores do not drain at chunk ends (the tl tree restarts its pipeline at each). A slot holds whole
steps of one chunk: a chunk's steps must be a multiple of STEPS (GemmConfig.steps_per_stage), which
every Qwen3 width is; the launcher says so otherwise.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma_wait

from lockstep.kernels._triton._order import tree_join, tree_root
from lockstep.kernels._triton.matmul_configs import GemmConfig, block_k, tile_rows
from lockstep.kernels._triton.splitk_ws import (PRODUCER_REGISTERS, SHARED_BYTES, continue_chunk, gluon_descriptor,
                                                invalidate_ring, open_chunk, ring_barriers)

@gluon.jit
def _producer(x_desc, w_desc, x_smem, w_smem, ready, empty, pid_w, pid_x, first, slots, K_PAD, PER: gl.constexpr,
              STAGES: gl.constexpr, STEPS: gl.constexpr):
    """The loads of chunks first .. first + PER - 1, `slots` slots of STEPS K steps each (chunk c's
    columns start at c * K_PAD)."""
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_W: gl.constexpr = w_desc.block_type.shape[0]
    NBYTES: gl.constexpr = STEPS * (x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    for t in range(PER * slots):
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)  # the slot's first use passes at once
        bar = ready.index(s)
        mbarrier.expect(bar, NBYTES)
        chunk = t // slots
        for i in gl.static_range(STEPS):
            k = (first + chunk) * K_PAD + ((t - chunk * slots) * STEPS + i) * BLOCK_K
            tma.async_copy_global_to_shared(w_desc, [pid_w * BLOCK_W, k], bar, w_smem.index(s * STEPS + i))
            tma.async_copy_global_to_shared(x_desc, [pid_x * x_desc.block_type.shape[0], k], bar,
                                            x_smem.index(s * STEPS + i))


@gluon.jit
def _chunk(x_smem, w_smem, ready, empty, acc, prev, h1, h2, h4, t, slots, j: gl.constexpr, PER: gl.constexpr,
           STAGES: gl.constexpr, STEPS: gl.constexpr):
    """Chunk j of the program's subtree into acc (the weight rows as the wgmma's M side); chunk j - 1
    (in prev) joins the tree while acc's first slot runs (splitk_ws.open_chunk)."""
    acc, prev, t = open_chunk(w_smem, x_smem, ready, empty, acc, prev, t, j > 0, STAGES, STEPS)
    if j > 0:
        h1, h2, h4, prev = tree_join(prev, j - 1, h1, h2, h4, PER)
    acc, t = continue_chunk(w_smem, x_smem, ready, empty, acc, t, slots, STAGES, STEPS)
    return acc, prev, h1, h2, h4, t


@gluon.jit
def _consumer(x_smem, w_smem, ready, empty, slots, PER: gl.constexpr, STAGES: gl.constexpr, STEPS: gl.constexpr,
              BLOCK_X: gl.constexpr, BLOCK_W: gl.constexpr):
    """The root of the program's subtree of PER chunks, [BLOCK_W, BLOCK_X] fp32 (element (n, m) is
    out[m, n]); chunks alternate between two accumulators."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_X, 16])
    acc = gl.zeros([BLOCK_W, BLOCK_X], gl.float32, mma)
    other = gl.zeros([BLOCK_W, BLOCK_X], gl.float32, mma)
    h1 = gl.zeros([BLOCK_W, BLOCK_X], gl.float32, mma)  # tree_join's pending subtrees
    h2 = gl.zeros([BLOCK_W, BLOCK_X], gl.float32, mma)
    h4 = gl.zeros([BLOCK_W, BLOCK_X], gl.float32, mma)
    t = 0
    if PER == 1:
        other, acc, h1, h2, h4, t = _chunk(x_smem, w_smem, ready, empty, other, acc, h1, h2, h4, t, slots, 0, PER,
                                           STAGES, STEPS)
    else:
        for jp in gl.static_range(PER // 2):
            acc, other, h1, h2, h4, t = _chunk(x_smem, w_smem, ready, empty, acc, other, h1, h2, h4, t, slots, 2 * jp,
                                               PER, STAGES, STEPS)
            other, acc, h1, h2, h4, t = _chunk(x_smem, w_smem, ready, empty, other, acc, h1, h2, h4, t, slots,
                                               2 * jp + 1, PER, STAGES, STEPS)
    # the last chunk is in `other`; its last slot needs no freeing (the producer is done)
    other = warpgroup_mma_wait(num_outstanding=0, deps=(other,))
    h1, h2, h4, root = tree_join(other, PER - 1, h1, h2, h4, PER)
    return (root,)  # (the default partition's results: a tuple)


@gluon.jit(do_not_specialize=["M"])  # one binary for every batch size, as the tl kernels
def _gemm_swap_ws_kernel(x_desc, w_desc, out_ptr, ws_ptr, ticket_ptr, M, N, K_CHUNK, K_PAD, stride_o,
                         CHUNKS: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr, STEPS: gl.constexpr):
    """Program (w tile, x tile, s): subtree s of the tile, chunks s * PER .. (s + 1) * PER - 1 of
    K_CHUNK columns each (starting every K_PAD columns). CHUNKS = SPLIT = 1: `linear`'s product over
    K = K_CHUNK (ws_ptr and ticket_ptr unused)."""
    BLOCK_X: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_W: gl.constexpr = w_desc.block_type.shape[0]
    PER: gl.constexpr = CHUNKS // SPLIT
    pid_w = gl.program_id(0)
    pid_x = gl.program_id(1)
    sub = gl.program_id(2)
    slots = gl.cdiv(K_CHUNK, BLOCK_K) // STEPS
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES * STEPS, BLOCK_X, BLOCK_K], x_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES * STEPS, BLOCK_W, BLOCK_K], w_desc.layout)
    ready, empty = ring_barriers(STAGES, 1)
    root, = gl.warp_specialize([
        (_consumer, (x_smem, w_smem, ready, empty, slots, PER, STAGES, STEPS, BLOCK_X, BLOCK_W)),
        (_producer, (x_desc, w_desc, x_smem, w_smem, ready, empty, pid_w, pid_x, sub * PER, slots, K_PAD, PER,
                     STAGES, STEPS)),
    ], [1], [PRODUCER_REGISTERS])
    invalidate_ring(ready, empty, STAGES)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_X, 16])
    offs_n = pid_w * BLOCK_W + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, mma))
    offs_m = pid_x * BLOCK_X + gl.arange(0, BLOCK_X, layout=gl.SliceLayout(0, mma))
    row_m = offs_m.to(gl.int64)[None, :]
    inside = (offs_m < M)[None, :] & (offs_n < N)[:, None]
    out = out_ptr + row_m * stride_o + offs_n[:, None]
    if SPLIT == 1:
        gl.store(out, root.to(out_ptr.dtype.element_ty), mask=inside)
    else:  # workspace [SPLIT, M, N] fp32: this subtree's root, then a ticket; the tile's last program sums
        plane = M.to(gl.int64) * N
        ws = ws_ptr + row_m * N + offs_n[:, None]
        gl.store(ws + sub * plane, root, mask=inside)
        gl.thread_barrier()  # every thread's stores precede the release
        tile = pid_x * gl.num_programs(0) + pid_w
        ticket = gl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:
            gl.atomic_xchg(ticket_ptr + tile, 0, sem="relaxed", scope="gpu")  # left at zero (_tickets.py)
            total = tree_root(ws, plane, inside, SPLIT)
            gl.store(out, total.to(out_ptr.dtype.element_ty), mask=inside)


def swap_ws_fits(k_chunk: int, cfg: GemmConfig, dtype: torch.dtype) -> bool:
    """Whether the Gluon kernel takes chunks of k_chunk columns (`linear`: K) under cfg: whole slots
    of K steps (the tl kernels run the same sums otherwise)."""
    return triton.cdiv(k_chunk, block_k(dtype)) % cfg.steps_per_stage == 0


def gemm_swap_ws(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cfg: GemmConfig, *, chunks: int = 1,
                 chunk: int | None = None, padded: int | None = None, split: int = 1,
                 ws: torch.Tensor | None = None, tickets: torch.Tensor | None = None) -> None:
    """out [M, N] = x [M, K] @ weight [N, K]^T, both row-major with 16-byte aligned rows (16-bit).
    With chunks > 1 (the row-parallel tree, splitk.row_tree): K is `chunks` chunks of `chunk` columns
    starting every `padded` columns, summed in the canonical tree by `split` programs a tile (split > 1:
    ws [split, M, N] fp32 and zeroed tickets, one a tile)."""
    if not (cfg.gluon and cfg.swap_ab):  # (GemmConfig holds such a tile to 64 or 128 weight rows)
        raise ValueError(f"{cfg}: the swapped Gluon kernel takes gluon=True and swap_ab=True")
    chunk = chunk or x.shape[1]
    if not swap_ws_fits(chunk, cfg, x.dtype):
        raise ValueError(f"{cfg}: K chunks of {chunk} columns are not whole slots of {cfg.steps_per_stage} K steps; "
                         "run the tl kernel (the same sums)")
    if split not in (1, 2, 4, 8) or split > chunks or (split > 1 and (ws is None or tickets is None)):
        raise ValueError(f"{cfg}: split {split} must be 1, 2, 4 or 8, at most the {chunks} chunks, and a split "
                         "needs its workspace and tickets")
    m, n = out.shape
    bk = block_k(x.dtype)
    rows = tile_rows(m, cfg)
    shared = cfg.num_stages * cfg.steps_per_stage * (rows + cfg.block_n) * bk * x.element_size()
    if shared > SHARED_BYTES:
        raise ValueError(f"{cfg}: {cfg.num_stages} stages of {cfg.steps_per_stage} K steps of {rows} x rows and "
                         f"{cfg.block_n} weight rows take {shared} bytes of shared memory, more than {SHARED_BYTES}")
    _gemm_swap_ws_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, rows), split)](
        gluon_descriptor(x, [rows, bk]), gluon_descriptor(weight, [cfg.block_n, bk]), out,
        out if ws is None else ws, out if tickets is None else tickets, m, n, chunk, padded or chunk, out.stride(0),
        CHUNKS=chunks, SPLIT=split, STAGES=cfg.num_stages, STEPS=cfg.steps_per_stage, num_warps=cfg.num_warps)
