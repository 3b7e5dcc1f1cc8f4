"""The row-parallel GEMM on a canonical partition of K: the same bits at every tensor-parallel size.

`row_parallel_linear(x, weight, group)`: x [..., K_local] @ weight[N, K_local]^T summed over the TP
ranks of `group` (the o_proj / down_proj of a layer), where K = K_local * tp. Numerics, identical for
TP 1, 2, 4 and 8:
- K is cut into NUM_K_CHUNKS = 8 fixed chunks of K / 8 columns, whatever the TP size; each chunk's
  product is accumulated in fp32 (the GEMM's own fixed order) and kept in fp32;
- the 8 chunk partials are summed in one balanced tree over the chunk index,
  ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7)), in fp32, then rounded once to x's dtype;
- a TP rank holds 8 / tp consecutive chunks, i.e. whole subtrees of that tree: it reduces them
  locally, the ranks exchange their fp32 subtree roots (an all-gather: never NCCL's all-reduce,
  whose order follows message size and channels) and every rank finishes the same tree.
TP 1 thus runs a fixed 8-way split-K (one launch on the GPU: kernels/_triton/splitk.py), which also
gives small-M products more programs than a plain GEMM. The backward is the plain one: dx = g @ w,
dw = g^T @ x (the gradient is replicated over TP, so nothing is reduced).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from lockstep.kernels._backend import KernelOp
from lockstep.kernels._invariant import tiled_mm
from lockstep.kernels.collectives import tree_sum_ranks

NUM_K_CHUNKS = 8


def _reference_subtree(x: torch.Tensor, weight: torch.Tensor, chunk: int) -> torch.Tensor:
    """[M, N] fp32: one fp32 GEMM per local K chunk (the reference's fixed row tiles), summed in
    the canonical tree."""
    xf, wf = x.float(), weight.float()
    return tree_sum_ranks([tiled_mm(xf[:, lo:lo + chunk], wf[:, lo:lo + chunk].t()) for lo in range(0, x.shape[1], chunk)])


def _reference_local(x: torch.Tensor, weight: torch.Tensor, chunk: int) -> torch.Tensor:
    return _reference_subtree(x, weight, chunk).to(x.dtype)


_subtree = KernelOp("row_subtree", _reference_subtree, "splitk:row_subtree_op",
                    fake=lambda x, weight, chunk: x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32))
# Unsharded, the whole tree and the rounding to x's dtype are one op: a compiled graph (vLLM's) must
# not fuse the rounding away into the residual add that follows (Inductor skips such casts).
_local = KernelOp("row_local", _reference_local, "splitk:row_local_op",
                  fake=lambda x, weight, chunk: x.new_empty(x.shape[0], weight.shape[0]))


def _reduce(x2d: torch.Tensor, weight: torch.Tensor, group, chunk: int) -> torch.Tensor:
    tp, _ = _tp(group)
    if tp == 1:
        return _local(x2d, weight, chunk)
    root = _subtree(x2d, weight, chunk)  # this rank's subtree root, fp32
    parts = [torch.empty_like(root) for _ in range(tp)]
    dist.all_gather(parts, root.contiguous(), group=group)
    return tree_sum_ranks(parts).to(x2d.dtype)


def _tp(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def check_partition(k_local: int, tp: int) -> int:
    """The chunk width for a rank holding k_local of K = k_local * tp columns."""
    if NUM_K_CHUNKS % tp:
        raise ValueError(f"row_parallel_linear: tensor parallel size {tp} must divide {NUM_K_CHUNKS} "
                         f"(the canonical K partition); valid: 1, 2, 4, 8")
    k = k_local * tp
    if k % NUM_K_CHUNKS:
        raise ValueError(f"row_parallel_linear: K = {k} is not a multiple of {NUM_K_CHUNKS} (the canonical K chunks)")
    return k // NUM_K_CHUNKS


class _RowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, group, chunk):
        ctx.save_for_backward(x2d, weight)
        return _reduce(x2d, weight, group, chunk)

    @staticmethod
    def backward(ctx, grad):
        from lockstep.kernels.matmul import matmul

        x2d, weight = ctx.saved_tensors
        g = grad.contiguous()
        dx = matmul(g, weight) if ctx.needs_input_grad[0] else None
        dw = matmul(g.t().contiguous(), x2d) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def _forward(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    tp, _ = _tp(group)
    chunk = check_partition(weight.shape[1], tp)
    x2d = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        out = _RowParallel.apply(x2d, weight, group, chunk)
    else:  # inference (and vLLM's compiled graphs): no autograd node
        out = _reduce(x2d, weight, group, chunk)
    return out.reshape(*x.shape[:-1], weight.shape[0])


_row_parallel = KernelOp("row_parallel_linear", _forward)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, group=None) -> torch.Tensor:
    """x [..., K_local] @ weight[N, K_local]^T, summed over `group` (None: unsharded) on the
    canonical partition of K (module docstring)."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"row_parallel_linear: x [..., {weight.shape[1] if weight.dim() == 2 else '?'}] expected "
                         f"for weight {tuple(weight.shape)}, got x {tuple(x.shape)}")
    return _row_parallel(x, weight, group)
