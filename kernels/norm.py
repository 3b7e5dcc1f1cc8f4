"""Batch-invariant RMSNorm (Qwen3 semantics: normalise in fp32, cast, then scale by weight)."""
from __future__ import annotations

import torch

from lockstep.kernels._backend import KernelOp
from lockstep.kernels._invariant import tree_sum


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    variance = tree_sum(xf * xf) / xf.shape[-1]
    y = xf * torch.rsqrt(variance + eps).unsqueeze(-1)
    return weight * y.to(x.dtype)


_rms_norm = KernelOp("rms_norm", _reference, "norm:rms_norm",
                     fake=lambda x, weight, eps: torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, weight, float(eps))
