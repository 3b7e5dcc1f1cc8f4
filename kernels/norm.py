"""Batch-invariant RMSNorm (Qwen3 semantics: normalise in fp32, cast, then scale by weight)."""
from __future__ import annotations

import torch

from lockstep.kernels._backend import get_backend
from lockstep.kernels._invariant import tree_sum


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if get_backend() == "triton":
        from lockstep.kernels._triton.norm import rms_norm as triton_rms_norm

        return triton_rms_norm(x, weight, eps)
    xf = x.float()
    variance = tree_sum(xf * xf) / xf.shape[-1]
    y = xf * torch.rsqrt(variance + eps).unsqueeze(-1)
    return weight * y.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Fused residual add + RMSNorm: returns (rms_norm(x + residual), x + residual)."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed
