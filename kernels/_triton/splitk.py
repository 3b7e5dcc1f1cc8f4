"""Lockstep's row-parallel GEMM on the GPU: the canonical K-chunk tree (kernels/rowlinear.py) in
one launch, its fp32 partials never leaving the chip at large M.

What is computed, for the CHUNKS = K_local / K_CHUNK chunks this rank owns: each chunk's product
x[:, chunk] @ w[:, chunk]^T accumulated in fp32 over the chunk's BLOCK_K-wide `tl.dot` steps in
ascending k (BLOCK_K fixed per dtype, the chunk's tail TMA zero-fill: exact zeros), the chunk
products summed in the balanced tree ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7)), and the
root rounded once to x's dtype (unsharded) or returned in fp32 (a TP rank's subtree root).

How, without an M-dependent order: SPLIT programs share an output tile, each computing one
subtree of CHUNKS / SPLIT consecutive chunks in registers. SPLIT = 1: the program holds the whole
tree and writes the tile. SPLIT > 1: every program writes its fp32 subtree root to a workspace and
takes a ticket from the tile's counter; the last to arrive adds the SPLIT roots in the tree's own
order (they are its top levels) and writes the tile. Which program finishes a tile, and SPLIT
itself (chosen from the tile count to fill the SMs at small M), change only where a sum is done,
never which sums: every SPLIT gives the same bits, which is what lets decode-sized products use
more programs than tiles. The tile shape, from ROW_CONFIGS' M buckets, only decides which program
computes an element, as in matmul.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from lockstep.kernels._triton._alignment import ALIGN_BYTES, is_aligned
from lockstep.kernels._triton._device import INTERPRETING, resident_programs
from lockstep.kernels._triton.matmul_configs import block_k, row_config_for


@triton.jit
def _subtree(x_desc, w_desc, off_m, off_n, K_CHUNK, first, COUNT: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WIDEN_OPERANDS: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32: the balanced tree over the products of the chunks first ..
    first + COUNT - 1 (COUNT 1, 2, 4 or 8; first a multiple of COUNT).

    One software-pipelined loop walks the chunks' BLOCK_K steps in ascending k; each chunk's
    product accumulates from zero, and at its last step it joins the tree like a binary counter:
    chunk j (counted from first) is added to its left sibling when j is odd, the pair to its
    left pair when j % 4 == 3, the quad to its left quad when j % 8 == 7, so at most three
    finished subtrees wait (h1, h2, h4) and the last chunk's sum is the root. The operands are
    [rows, chunks, K_CHUNK] views: a step past a chunk's end reads TMA zero-fill (exact zeros)."""
    steps = tl.cdiv(K_CHUNK, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    h1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # a finished chunk waiting for its sibling
    h2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # a finished pair
    h4 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # a finished quad
    root = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, COUNT * steps):
        j = i // steps
        kk = (i - j * steps) * BLOCK_K
        a = tl.reshape(x_desc.load([off_m, first + j, kk]), (BLOCK_M, BLOCK_K))
        b = tl.reshape(w_desc.load([off_n, first + j, kk]), (BLOCK_N, BLOCK_K)).T
        if WIDEN_OPERANDS:  # the interpreter multiplies bf16 tiles as raw bits (see matmul.py)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
        if kk + BLOCK_K >= K_CHUNK:  # chunk j is complete: join the tree
            v = acc
            if COUNT > 1:  # (compile-time guards: a smaller subtree carries fewer holders)
                if j % 2 == 1:
                    v = h1 + v
            if COUNT > 2:
                if j % 4 == 3:
                    v = h2 + v
            if COUNT > 4:
                if j % 8 == 7:
                    v = h4 + v
            if COUNT > 1:
                if j % 2 == 0:
                    h1 = v
            if COUNT > 2:
                if j % 4 == 1:
                    h2 = v
            if COUNT > 4:
                if j % 8 == 3:
                    h4 = v
            root = v  # after the last chunk: the subtree's root
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return root


@triton.jit
def _l2(ptr):
    """A load of what other programs wrote: from L2 (.cg), never a stale L1 line."""
    return tl.load(ptr, cache_modifier=".cg")


@triton.jit
def _root(ws, step, S: tl.constexpr):
    """The balanced tree over the S subtree roots at ws, ws + step, ... (S 2, 4 or 8), fp32."""
    if S == 2:
        root = _l2(ws) + _l2(ws + step)
    elif S == 4:
        root = (_l2(ws) + _l2(ws + step)) + (_l2(ws + 2 * step) + _l2(ws + 3 * step))
    else:
        tl.static_assert(S == 8)
        root = (((_l2(ws) + _l2(ws + step)) + (_l2(ws + 2 * step) + _l2(ws + 3 * step)))
                + ((_l2(ws + 4 * step) + _l2(ws + 5 * step)) + (_l2(ws + 6 * step) + _l2(ws + 7 * step))))
    return root


@triton.jit(do_not_specialize=["M"])
def _row_tree_kernel(x_desc, w_desc, out_ptr, ws_ptr, ticket_ptr, M, N, K_CHUNK, stride_o,
                     CHUNKS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, WIDEN_OPERANDS: tl.constexpr):
    tile = tl.program_id(0)
    s = tl.program_id(1)  # which subtree of this tile
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile // tiles_per_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % tiles_per_group) % group_rows
    pid_n = (tile % tiles_per_group) // group_rows
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    PER: tl.constexpr = CHUNKS // SPLIT
    root = _subtree(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, K_CHUNK, s * PER, PER,
                    BLOCK_M, BLOCK_N, BLOCK_K, WIDEN_OPERANDS)
    inside = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out = out_ptr + offs_m[:, None] * stride_o + offs_n[None, :]
    if SPLIT == 1:
        tl.store(out, root.to(out_ptr.dtype.element_ty), mask=inside)
    else:
        # workspace [SPLIT, M, N] fp32: this subtree's root, then a ticket; the last one sums
        plane = M.to(tl.int64) * N
        ws = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws + s * plane, root, mask=inside)
        tl.debug_barrier()  # every thread's stores precede the release
        ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:
            total = _root(ws, plane, SPLIT)
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=inside)


def _chunk_descriptor(t: torch.Tensor, chunks: int, chunk: int, block_rows: int, bk: int) -> TensorDescriptor:
    """A host-built TMA descriptor of t [rows, chunks * chunk] as [rows, chunks, chunk]: a tile load
    past a chunk's end is zero-filled. TMA needs 16-byte aligned chunk and row strides; other
    shapes (small test models) get a copy whose chunks are padded to that (zeros never read)."""
    per = ALIGN_BYTES // t.element_size()
    padded = -(-chunk // per) * per
    if t.stride(1) != 1 or padded != chunk or not is_aligned(t) or (t.stride(0) * t.element_size()) % ALIGN_BYTES:
        copy = t.new_zeros(t.shape[0], chunks, padded)
        copy[:, :, :chunk] = t.reshape(t.shape[0], chunks, chunk)
        return TensorDescriptor(copy, [t.shape[0], chunks, chunk], [chunks * padded, padded, 1], [block_rows, 1, bk])
    return TensorDescriptor(t, [t.shape[0], chunks, chunk], [t.stride(0), chunk, 1], [block_rows, 1, bk])


def split_for(tiles: int, chunks: int, device: torch.device, target_programs_per_sm: int) -> int:
    """Programs per output tile: the smallest power of two that gives every SM
    target_programs_per_sm programs, at most one per chunk (any choice computes the same bits)."""
    want = resident_programs(device) * target_programs_per_sm
    split = 1
    while split < chunks and tiles * split < want:
        split *= 2
    return split


def row_tree(x: torch.Tensor, weight: torch.Tensor, chunk: int, out_dtype: torch.dtype,
             split: int | None = None) -> torch.Tensor:
    """x [M, K_local] @ weight[N, K_local]^T as the canonical tree over its K_local / chunk chunks
    -> [M, N] in out_dtype (x's dtype: the rounded result; fp32: the subtree root). `split` forces
    the programs per tile (tests: every split gives the same bits)."""
    m, k = x.shape
    n = weight.shape[0]
    chunks = k // chunk
    if chunks not in (1, 2, 4, 8) or chunks * chunk != k:
        raise ValueError(f"row_tree: K_local = {k} must be 1, 2, 4 or 8 chunks of {chunk}")
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out.zero_()
    cfg = row_config_for(m, x.dtype)
    bk = block_k(x.dtype)
    x_desc = _chunk_descriptor(x, chunks, chunk, cfg.block_m, bk)
    w_desc = _chunk_descriptor(weight, chunks, chunk, cfg.block_n, bk)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = split or split_for(tiles, chunks, x.device, cfg.programs_per_sm)
    if split not in (1, 2, 4, 8) or split > chunks:
        raise ValueError(f"row_tree: split {split} must be 1, 2, 4 or 8 and at most the {chunks} chunks")
    if split > 1:
        ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        tickets = torch.zeros(tiles, dtype=torch.int32, device=x.device)  # per call (a memset node in a CUDA graph)
    else:
        ws = tickets = out
    _row_tree_kernel[(tiles, split)](
        x_desc, w_desc, out, ws, tickets, m, n, chunk, out.stride(0),
        CHUNKS=chunks, SPLIT=split, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk,
        GROUP_M=cfg.group_m, WIDEN_OPERANDS=INTERPRETING and x.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
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
