"""Batch-invariant GEMM: `matmul(a, b)` and `linear(x, weight, bias)`.

Invariance rule: the K reduction of a row never depends on M (no split-K chosen from M).
"""
from __future__ import annotations

from typing import Optional

import torch

from lockstep.kernels._backend import KernelOp
from lockstep.kernels._invariant import tiled_mm


def _reference_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return tiled_mm(a, b)


def _reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    out = tiled_mm(x.reshape(-1, x.shape[-1]), weight.t())
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


_matmul = KernelOp("matmul", _reference_matmul, "matmul:matmul",
                   fake=lambda a, b: a.new_empty(a.shape[0], b.shape[1]))
_linear = KernelOp("linear", _reference_linear, "matmul:linear",
                   fake=lambda x, weight, bias: x.new_empty(*x.shape[:-1], weight.shape[0]))


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N]."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul expects [M,K] @ [K,N], got {tuple(a.shape)} @ {tuple(b.shape)}")
    return _matmul(a, b)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias[N])."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x [..., {weight.shape[1] if weight.dim() == 2 else '?'}] expected "
                         f"for weight {tuple(weight.shape)}, got x {tuple(x.shape)}")
    return _linear(x, weight, bias)
