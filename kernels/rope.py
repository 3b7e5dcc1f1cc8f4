"""Rotary position embedding (HF `rotate_half` layout, as in Qwen3).

cos/sin are a pure function of the absolute position, computed elementwise in fp32, so a token
gets the same rotation in training, prefill and decode.
"""
from __future__ import annotations

import torch

from lockstep.kernels._backend import KernelOp


def _reference_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _fake_cos_sin(positions, head_dim, theta):
    out = positions.new_empty(*positions.shape, head_dim, dtype=torch.float32)
    return out, torch.empty_like(out)


def _reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    return x * cos + rotated * sin


# cos/sin are one implementation for both backends (elementwise fp32).
_rope_cos_sin = KernelOp("rope_cos_sin", _reference_cos_sin, fake=_fake_cos_sin)
_apply_rope = KernelOp("apply_rope", _reference_rope, "rope:apply_rope", fake=lambda x, cos, sin: torch.empty_like(x))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """positions [...] (int) -> cos, sin [..., head_dim] in fp32."""
    return _rope_cos_sin(positions, int(head_dim), float(theta))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, H, D]; cos/sin [..., T, D] (broadcast over heads)."""
    return _apply_rope(x, cos, sin)
