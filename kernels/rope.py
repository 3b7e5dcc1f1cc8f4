"""Rotary position embedding (HF `rotate_half` layout, as in Qwen3).

cos/sin are a pure function of the absolute position, computed elementwise in fp32, so a token
gets the same rotation in training, prefill and decode.
"""
from __future__ import annotations

import torch

from lockstep.kernels._backend import get_backend


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """positions [...] (int) -> cos, sin [..., head_dim] in fp32."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, H, D]; cos/sin [..., T, D] (broadcast over heads)."""
    if get_backend() == "triton":
        from lockstep.kernels._triton.rope import apply_rope as triton_apply_rope

        return triton_apply_rope(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    return x * cos + rotated * sin
