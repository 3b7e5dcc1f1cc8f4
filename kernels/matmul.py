"""Batch-invariant GEMM: `matmul(a, b)` and `linear(x, weight, bias)`.

Invariance rule: the K reduction of a row never depends on M (no split-K chosen from M).
"""
from __future__ import annotations

import torch

from lockstep.kernels._backend import get_backend
from lockstep.kernels._invariant import tiled_mm


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N]."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul expects [M,K] @ [K,N], got {tuple(a.shape)} @ {tuple(b.shape)}")
    if get_backend() == "triton":
        from lockstep.kernels._triton.matmul import matmul as triton_matmul

        return triton_matmul(a, b)
    return tiled_mm(a, b)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias[N])."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x [..., {weight.shape[1] if weight.dim() == 2 else '?'}] expected "
                         f"for weight {tuple(weight.shape)}, got x {tuple(x.shape)}")
    if get_backend() == "triton":
        from lockstep.kernels._triton.matmul import linear as triton_linear

        return triton_linear(x, weight, bias)
    lead = x.shape[:-1]
    out = tiled_mm(x.reshape(-1, x.shape[-1]), weight.t())
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])
