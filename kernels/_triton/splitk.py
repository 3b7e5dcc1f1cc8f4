"""The chunk partials of lockstep's row-parallel GEMM on the GPU: one launch computes, for every
K chunk this rank owns, the fp32 product x[:, chunk] @ w[:, chunk]^T.

Batch invariance as in matmul.py: within a chunk every output element is the fp32 sum of the
chunk's BLOCK_K-wide `tl.dot` steps in ascending k (BLOCK_K fixed per dtype, the chunk's tail
zero-masked: exact zeros), whatever M is; the tile shape, from matmul_configs' M buckets, only
decides which program computes an element. Chunks are fixed by K alone (kernels/rowlinear.py), so
this is a split-K whose split never depends on M, and it gives a small-M GEMM chunks x tiles
programs to spread over the SMs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep.kernels._triton._device import INTERPRETING
from lockstep.kernels._triton.matmul_configs import block_k, config_for


@triton.jit(do_not_specialize=["M"])
def _chunk_partials_kernel(x_ptr, w_ptr, out_ptr, M, N, K_CHUNK, stride_x, stride_w, stride_om, chunk_stride,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, WIDEN_OPERANDS: tl.constexpr):
    """out[c] = x[:, kc] @ w[:, kc]^T in fp32 for the local chunk c (kc: its columns of x's local K)."""
    tile = tl.program_id(0)
    c = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile // tiles_per_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % tiles_per_group) % group_rows
    pid_n = (tile % tiles_per_group) // group_rows
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k0 = c * K_CHUNK
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, K_CHUNK, BLOCK_K):  # ascending k, the same steps for every M
        offs_k = kk + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K_CHUNK
        a = tl.load(x_ptr + offs_m[:, None] * stride_x + (k0 + offs_k)[None, :],
                    mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + offs_n[None, :] * stride_w + (k0 + offs_k)[:, None],
                    mask=(offs_n[None, :] < N) & k_ok[:, None], other=0.0)
        if WIDEN_OPERANDS:  # the interpreter multiplies bf16 tiles as raw bits (see matmul.py)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    out = out_ptr + c * chunk_stride + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def chunk_partials(x: torch.Tensor, weight: torch.Tensor, chunk: int) -> torch.Tensor:
    """x [M, K_local] @ weight[N, K_local]^T cut into K_local / chunk chunks -> [chunks, M, N] fp32."""
    m, k = x.shape
    n = weight.shape[0]
    chunks = k // chunk
    out = torch.empty(chunks, m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out.zero_()
    x, weight = x.contiguous(), weight.contiguous()
    cfg = config_for(m, x.dtype)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    _chunk_partials_kernel[(tiles, chunks)](
        x, weight, out, m, n, chunk, x.stride(0), weight.stride(0), out.stride(1), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k(x.dtype), GROUP_M=cfg.group_m,
        WIDEN_OPERANDS=INTERPRETING and x.dtype == torch.bfloat16, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out


@torch.library.custom_op("lockstep::row_subtree", mutates_args=())
def row_subtree_op(x: torch.Tensor, weight: torch.Tensor, chunk: int) -> torch.Tensor:
    """The fp32 root of this rank's subtree: its chunk partials summed in the canonical tree."""
    from lockstep.kernels.collectives import tree_sum_ranks

    return tree_sum_ranks(list(chunk_partials(x, weight, chunk).unbind(0)))


@row_subtree_op.register_fake
def _(x, weight, chunk):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


@torch.library.custom_op("lockstep::row_local", mutates_args=())
def row_local_op(x: torch.Tensor, weight: torch.Tensor, chunk: int) -> torch.Tensor:
    """Unsharded: the whole canonical tree, rounded to x's dtype, in one op."""
    return row_subtree_op(x, weight, chunk).to(x.dtype)


@row_local_op.register_fake
def _(x, weight, chunk):
    return x.new_empty(x.shape[0], weight.shape[0])
