"""Lockstep's row-parallel GEMM on the GPU: the canonical K-chunk tree (kernels/rowlinear.py) in
one launch, its fp32 partials never leaving the chip at large M.

What is computed, for the CHUNKS = K_local / K_CHUNK chunks this rank owns: each chunk's product
x[:, chunk] @ w[:, chunk]^T accumulated in fp32 over the chunk's BLOCK_K-wide `tl.dot` steps in
ascending k (BLOCK_K fixed per dtype; a chunk of partial steps is zero-padded: exact zeros), the chunk
products summed in the balanced tree ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7)), and the
root rounded once to x's dtype (unsharded) or returned in fp32 (a TP rank's subtree root).

How, without an M-dependent order: SPLIT programs share an output tile, each computing one
subtree of CHUNKS / SPLIT consecutive chunks in registers. SPLIT = 1: the program holds the whole
tree and writes the tile. SPLIT > 1: every program writes its fp32 subtree root to a workspace and
takes a ticket from the tile's counter (_tickets.py); the last to arrive adds the SPLIT roots in the tree's own
order (they are its top levels) and writes the tile. Which program finishes a tile, and SPLIT
itself (chosen from the tile count to fill the SMs at small M), change only where a sum is done,
never which sums: every SPLIT gives the same bits, which is what lets decode-sized products use
more programs than tiles. The tile shape (ROW_CONFIGS) only decides which program computes an
element, as in matmul.py. The Gluon configs run the same tree in Gluon: the many-tile buckets in
splitk_ws.py (a producer warp and two consumer warpgroups, split 1), the decode bucket in swap_ws.py
(swapped subtrees, split to fill half the SMs: half_wave_split; the same ticketed join).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from lockstep.kernels._triton._alignment import ALIGN_BYTES, is_aligned
from lockstep.kernels._triton._device import INTERPRETING, resident_programs
from lockstep.kernels._triton._tickets import zeroed_tickets
from lockstep.kernels._triton._order import grouped_tile, tree_join, tree_root
from lockstep.kernels._triton.matmul_configs import GemmConfig, block_k, row_config_for, tile_rows, tl_tile
from lockstep.kernels._triton.splitk_ws import row_tree_ws
from lockstep.kernels._triton.swap_ws import gemm_swap_ws, swap_ws_fits


@triton.jit
def _step(x_desc, w_desc, off_m, off_n, kk, acc, WIDEN_OPERANDS: tl.constexpr, SWAP: tl.constexpr):
    """acc + x[off_m:, kk:kk + BLOCK_K] @ w[off_n:, kk:kk + BLOCK_K]^T, one BLOCK_K step; SWAP: its
    transpose, w[off_n:, kk:] @ x[off_m:, kk:]^T (the weight rows as the MMA's M side, as in
    matmul._gemm_swap_kernel: the same sums)."""
    if SWAP:
        a = w_desc.load([off_n, kk])
        b = x_desc.load([off_m, kk]).T
    else:
        a = x_desc.load([off_m, kk])
        b = w_desc.load([off_n, kk]).T
    if WIDEN_OPERANDS:  # the interpreter multiplies bf16 tiles as raw bits (see matmul.py)
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _subtree(x_desc, w_desc, off_m, off_n, K_CHUNK, K_PAD, first, COUNT: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WIDEN_OPERANDS: tl.constexpr, PER_CHUNK_LOOPS: tl.constexpr,
             SWAP: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32 ([BLOCK_N, BLOCK_M] with SWAP): the balanced tree over the products
    of the chunks first .. first + COUNT - 1 (COUNT 1, 2, 4 or 8; first a multiple of COUNT). Chunk c's columns start at
    c * K_PAD (K_PAD >= K_CHUNK, whole BLOCK_K steps; the padding holds zeros).

    Each chunk's product accumulates from zero over its BLOCK_K steps in ascending k, then joins
    the tree (_order.tree_join). Two loop structures, the same operations in the same order:
    - PER_CHUNK_LOOPS (a subtree of at most 4 chunks): one pipelined K loop per chunk, unrolled, so
      the MMAs stay asynchronous inside each (the tree joins between loops);
    - otherwise one pipelined loop over every chunk's steps, the join at each chunk's last step:
      no pipeline restarts, but the join reads the accumulator inside the loop, so each MMA is
      waited for (wgmma.wait_group 0). Eight unrolled loops (a whole tree) ran slower: the sweep
      (benchmarks/sweep_rowtree.py) found each structure faster where it is used."""
    steps = tl.cdiv(K_CHUNK, BLOCK_K)
    ROWS: tl.constexpr = BLOCK_N if SWAP else BLOCK_M
    COLS: tl.constexpr = BLOCK_M if SWAP else BLOCK_N
    h1 = tl.zeros((ROWS, COLS), dtype=tl.float32)  # a finished chunk waiting for its sibling
    h2 = tl.zeros((ROWS, COLS), dtype=tl.float32)  # a finished pair
    h4 = tl.zeros((ROWS, COLS), dtype=tl.float32)  # a finished quad
    root = tl.zeros((ROWS, COLS), dtype=tl.float32)
    if PER_CHUNK_LOOPS:
        for j in tl.static_range(0, COUNT):
            acc = tl.zeros((ROWS, COLS), dtype=tl.float32)
            for ki in range(0, steps):
                acc = _step(x_desc, w_desc, off_m, off_n, (first + j) * K_PAD + ki * BLOCK_K, acc, WIDEN_OPERANDS, SWAP)
            h1, h2, h4, root = tree_join(acc, j, h1, h2, h4, COUNT)
    else:
        acc = tl.zeros((ROWS, COLS), dtype=tl.float32)
        for i in range(0, COUNT * steps):
            j = i // steps
            ki = i - j * steps
            acc = _step(x_desc, w_desc, off_m, off_n, (first + j) * K_PAD + ki * BLOCK_K, acc, WIDEN_OPERANDS, SWAP)
            if ki == steps - 1:  # chunk j is complete: join the tree
                h1, h2, h4, root = tree_join(acc, j, h1, h2, h4, COUNT)
                acc = tl.zeros((ROWS, COLS), dtype=tl.float32)
    return root


@triton.jit(do_not_specialize=["M"])
def _row_tree_kernel(x_desc, w_desc, out_ptr, ws_ptr, ticket_ptr, M, N, K_CHUNK, K_PAD, stride_o,
                     CHUNKS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, WIDEN_OPERANDS: tl.constexpr,
                     PER_CHUNK_LOOPS: tl.constexpr, SWAP: tl.constexpr):
    """BLOCK_M rows of x by BLOCK_N rows of the weight per tile; SWAP: the tile is computed
    transposed (the weight rows as the MMA's M side: decode-sized x is not padded to 64 rows)."""
    tile = tl.program_id(0)
    s = tl.program_id(1)  # which subtree of this tile
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    PER: tl.constexpr = CHUNKS // SPLIT
    root = _subtree(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, K_CHUNK, K_PAD, s * PER, PER,
                    BLOCK_M, BLOCK_N, BLOCK_K, WIDEN_OPERANDS, PER_CHUNK_LOOPS, SWAP)
    if SWAP:  # root [BLOCK_N, BLOCK_M]: element (n, m) is out[m, n]
        row_m, col_n = offs_m[None, :], offs_n[:, None]
    else:
        row_m, col_n = offs_m[:, None], offs_n[None, :]
    inside = (row_m < M) & (col_n < N)
    out = out_ptr + row_m * stride_o + col_n
    if SPLIT == 1:
        tl.store(out, root.to(out_ptr.dtype.element_ty), mask=inside)
    else:
        # workspace [SPLIT, M, N] fp32: this subtree's root, then a ticket; the last one sums
        plane = M.to(tl.int64) * N
        ws = ws_ptr + row_m * N + col_n
        tl.store(ws + s * plane, root, mask=inside)
        tl.debug_barrier()  # every thread's stores precede the release
        ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:
            tl.atomic_xchg(ticket_ptr + tile, 0, sem="relaxed", scope="gpu")  # left at zero (_tickets.py)
            total = tree_root(ws, plane, inside, SPLIT)
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=inside)


def _chunk_operand(t: torch.Tensor, chunks: int, chunk: int, padded: int) -> torch.Tensor:
    """t [rows, chunks * chunk] as a TMA operand whose chunks start every `padded` columns. Every real
    Qwen3 width gives chunks of whole BLOCK_K steps (padded == chunk): t itself. Otherwise (small test
    models, unaligned views) a copy with each chunk zero-padded to whole steps and 16-byte aligned
    rows: the padding multiplies as exact zeros."""
    if padded != chunk or t.stride(1) != 1 or not is_aligned(t) or (t.stride(0) * t.element_size()) % ALIGN_BYTES:
        copy = t.new_zeros(t.shape[0], chunks, padded)
        copy[:, :, :chunk] = t.reshape(t.shape[0], chunks, chunk)
        t = copy.view(t.shape[0], chunks * padded)
    return t


def _descriptor(t: torch.Tensor, block_rows: int, bk: int) -> TensorDescriptor:
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [block_rows, bk])


def split_for(tiles: int, chunks: int, device: torch.device, target_programs_per_sm: int) -> int:
    """Programs per output tile: the smallest power of two that gives every SM
    target_programs_per_sm programs, at most one per chunk (any choice computes the same bits)."""
    want = resident_programs(device) * target_programs_per_sm
    split = 1
    while split < chunks and tiles * split < want:
        split *= 2
    return split


def half_wave_split(tiles: int, chunks: int, device: torch.device) -> int:
    """Programs per tile for the swapped Gluon subtrees, one program an SM (their ring fills it):
    the largest power of two, at most one per chunk, whose programs fill at most half the SMs (at
    least 1). Twentieth session (H200, 132 SMs, sweep_rowtree.py --swapped-only): at o_proj's and
    down's 64 tiles (M <= 64), one program a tile (the whole tree, 64 programs) read 1.08 / 1.15 /
    1.17 / 1.24 / 1.00x cuBLAS on o_proj at M = 1 / 8 / 16 / 32 / 64 against 1.01 / 1.08 / 1.12 /
    1.10 / 0.83 for two a tile (one wave: the subtree roots joined through a workspace by the
    tile's last program), and on down within 2% of it at 1-32 rows and 1.07 against 1.04 at 64.
    The rule keeps that count of programs for fewer tiles (a smaller model's): 32 tiles, 2 a tile."""
    split = 1
    while split * 2 <= chunks and tiles * split * 2 <= resident_programs(device) // 2:
        split *= 2
    return split


def _split(split: int, chunks: int) -> int:
    if split not in (1, 2, 4, 8) or split > chunks:
        raise ValueError(f"row_tree: split {split} must be 1, 2, 4 or 8 and at most the {chunks} chunks")
    return split


def _workspace(split: int, m: int, n: int, tiles: int, device: torch.device):
    """(ws, tickets) of a split launch: the [split, M, N] fp32 subtree roots and one zeroed ticket
    counter a tile, left at zero by each tile's last program; (None, None) at split 1."""
    if split == 1:
        return None, None
    return torch.empty(split, m, n, dtype=torch.float32, device=device), zeroed_tickets(device, tiles)


def row_tree(x: torch.Tensor, weight: torch.Tensor, chunk: int, out_dtype: torch.dtype,
             split: int | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K_local] @ weight[N, K_local]^T as the canonical tree over its K_local / chunk chunks
    -> [M, N] in out_dtype (x's dtype: the rounded result; fp32: the subtree root). `split` forces
    the programs per tile and `config` the tile (tests, sweeps: every choice gives the same bits);
    a split program's subtree runs one loop per chunk (_subtree)."""
    m, k = x.shape
    n = weight.shape[0]
    chunks = k // chunk
    if chunks not in (1, 2, 4, 8) or chunks * chunk != k:
        raise ValueError(f"row_tree: K_local = {k} must be 1, 2, 4 or 8 chunks of {chunk}")
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out.zero_()
    cfg = config or row_config_for(m, x.dtype)
    bk = block_k(x.dtype)
    padded = triton.cdiv(chunk, bk) * bk  # whole BLOCK_K steps per chunk (bk * element size: 16-byte aligned)
    x_op, w_op = _chunk_operand(x, chunks, chunk, padded), _chunk_operand(weight, chunks, chunk, padded)
    if cfg.gluon and cfg.swap_ab and (INTERPRETING or not swap_ws_fits(chunk, cfg, x.dtype)):
        cfg = tl_tile(cfg)  # the decode bucket's tile in the tl kernel: the same sums at every split
    if cfg.gluon and cfg.swap_ab:  # the decode bucket: swap_ws.py's subtrees, split to fill half the SMs
        rows = tile_rows(m, cfg)
        tiles = triton.cdiv(m, rows) * triton.cdiv(n, cfg.block_n)
        # at most two programs a tile of more than 64 rows of x: the last program's join of 4 or 8
        # subtree roots spills 528-2,440 bytes a thread there (compiled for sm_90a; split 1 136, 2 none)
        split = _split(split or half_wave_split(tiles, chunks if rows <= 64 else min(chunks, 2), x.device), chunks)
        ws, tickets = _workspace(split, m, n, tiles, x.device)
        gemm_swap_ws(x_op, w_op, out, cfg, chunks=chunks, chunk=chunk, padded=padded, split=split, ws=ws,
                     tickets=tickets)
        return out
    if cfg.warp_specialize:  # the many-tile buckets: one persistent program a tile, warp-specialised
        if not cfg.gluon:
            raise ValueError(f"row_tree: {cfg}: the tree's warp-specialised form is the Gluon kernel (gluon=True); "
                             "Triton's pass does not split its loop")
        if split not in (None, 1):
            raise ValueError(f"row_tree: {cfg} holds each tile's whole tree in one program; split {split} "
                             "needs a config without warp_specialize")
        if INTERPRETING:
            raise ValueError(f"row_tree: {cfg} runs a Gluon kernel (splitk_ws.py), which Triton's interpreter "
                             "cannot run; test the tree's sums with the tl kernel's configs")
        row_tree_ws(x_op, w_op, out, chunks, chunk, padded, bk, cfg)
        return out
    block_m = tile_rows(m, cfg)
    x_desc, w_desc = _descriptor(x_op, block_m, bk), _descriptor(w_op, cfg.block_n, bk)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, cfg.block_n)
    split = _split(split or split_for(tiles, chunks, x.device, cfg.programs_per_sm), chunks)
    ws, tickets = _workspace(split, m, n, tiles, x.device)
    if ws is None:
        ws = tickets = out
    _row_tree_kernel[(tiles, split)](
        x_desc, w_desc, out, ws, tickets, m, n, chunk, padded, out.stride(0),
        CHUNKS=chunks, SPLIT=split, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk,
        GROUP_M=cfg.group_m, WIDEN_OPERANDS=INTERPRETING and x.dtype == torch.bfloat16, PER_CHUNK_LOOPS=split > 1,
        SWAP=cfg.swap_ab, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


@torch.library.custom_op("lockstep::row_subtree", mutates_args=())
def row_subtree_op(x: torch.Tensor, weight: torch.Tensor, chunk: int) -> torch.Tensor:
    """The fp32 root of this rank's subtree: its chunk products summed in the canonical tree."""
    return row_tree(x, weight, chunk, torch.float32)


@row_subtree_op.register_fake
def _(x, weight, chunk):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


@torch.library.custom_op("lockstep::row_local", mutates_args=())
def row_local_op(x: torch.Tensor, weight: torch.Tensor, chunk: int) -> torch.Tensor:
    """Unsharded: the whole canonical tree, rounded once to x's dtype, in one launch."""
    return row_tree(x, weight, chunk, x.dtype)


@row_local_op.register_fake
def _(x, weight, chunk):
    return x.new_empty(x.shape[0], weight.shape[0])
