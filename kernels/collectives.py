"""Deterministic tensor-parallel reductions.

NCCL's all-reduce chunks a message and its reduction order changes with message size, ring/tree
choice and channel count, so the same partial sums can add up to different bits. `tree_all_reduce`
gathers every rank's partial and adds them in one balanced tree over the rank index,
((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)): the order depends on nothing but the TP size,
and TP sizes 1/2/4/8 use nested prefixes of the same tree.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from lockstep.kernels._backend import KernelOp


def tree_sum_ranks(parts: list[torch.Tensor]) -> torch.Tensor:
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


class _TreeAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return tree_sum_ranks(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # the sum's gradient reaches every rank's partial unchanged


def _tree_all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return t
    return _TreeAllReduce.apply(t, group)


_op = KernelOp("tree_all_reduce", _tree_all_reduce)


def tree_all_reduce(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum of `t` over the ranks of `group`, in a fixed balanced tree (differentiable)."""
    return _op(t, group)
