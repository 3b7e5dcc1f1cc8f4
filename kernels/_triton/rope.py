"""Triton rotary position embedding (HF `rotate_half` layout) and its backward.

out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1) for the halves x1, x2 of the
head dim; cos/sin (fp32, [..., T, D]) are first cast to x's dtype as in the reference, then the
arithmetic runs in fp32 and is rounded once. Elementwise per token, so batch invariance is
structural: a token's output depends on its own x, cos and sin only.

The backward applies the transposed rotation to the gradient, with the same kernel:
  forward  out1 = x1*c1 - x2*s1    out2 = x2*c2 + x1*s2
  backward dx1  = g1*c1 + g2*s2    dx2  = g2*c2 - g1*s1
cos/sin are treated as constants (they are a function of the positions): no gradient flows to them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, head_dim, TRANSPOSED: tl.constexpr,
                 BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One token (all its heads) per program; x and out are [tokens, heads, head_dim]."""
    token = tl.program_id(0).to(tl.int64)
    half = head_dim // 2
    h = tl.arange(0, BLOCK_HEADS)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < heads) & (d < half)
    x_offs = token * heads * head_dim + h * head_dim + d
    x1 = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + x_offs + half, mask=mask, other=0.0)
    dtype = x1.dtype
    angle_offs = token * head_dim + d
    angle_mask = d < half
    c1 = tl.load(cos_ptr + angle_offs, mask=angle_mask, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cos_ptr + angle_offs + half, mask=angle_mask, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + angle_offs, mask=angle_mask, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sin_ptr + angle_offs + half, mask=angle_mask, other=0.0).to(dtype).to(tl.float32)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if TRANSPOSED:
        out1 = x1 * c1 + x2 * s2
        out2 = x2 * c2 - x1 * s1
    else:
        out1 = x1 * c1 - x2 * s1
        out2 = x2 * c2 + x1 * s2
    tl.store(out_ptr + x_offs, out1.to(dtype), mask=mask)
    tl.store(out_ptr + x_offs + half, out2.to(dtype), mask=mask)


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() < 3 or x.shape[-1] % 2:
        raise ValueError(f"apply_rope expects x [..., T, H, D] with an even D, got {tuple(x.shape)}")
    want = (*x.shape[:-2], x.shape[-1])
    if cos.shape != sin.shape or cos.dim() < 2 or cos.shape[-1] != x.shape[-1]:
        raise ValueError(f"apply_rope expects cos and sin [..., T, {x.shape[-1]}], got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    try:
        broadcast = torch.broadcast_shapes(cos.shape, want)
    except RuntimeError:
        broadcast = None
    if broadcast != want:
        raise ValueError(f"apply_rope: cos/sin {tuple(cos.shape)} do not broadcast to {want} "
                         f"(x {tuple(x.shape)} without its head dim)")
    if not x.dtype.is_floating_point or cos.device != x.device or sin.device != x.device:
        raise ValueError(f"apply_rope: x must be floating point and on the device of cos/sin, got "
                         f"{x.dtype} on {x.device}, cos on {cos.device}, sin on {sin.device}")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transposed: bool) -> torch.Tensor:
    _check(x, cos, sin)
    *lead, heads, head_dim = x.shape
    x = x.contiguous()
    # one [head_dim] row of cos/sin per token (broadcast leading dims materialised)
    cos = cos.expand(*lead, head_dim).reshape(-1, head_dim).contiguous()
    sin = sin.expand(*lead, head_dim).reshape(-1, head_dim).contiguous()
    out = torch.empty_like(x)
    tokens = cos.shape[0]
    if x.numel():
        _rope_kernel[(tokens,)](x, cos, sin, out, heads, head_dim, TRANSPOSED=transposed,
                                BLOCK_HEADS=triton.next_power_of_2(heads),
                                BLOCK_HALF=triton.next_power_of_2(head_dim // 2))
    return out


@torch.library.custom_op("lockstep::apply_rope", mutates_args=())
def apply_rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _rotate(x, cos, sin, transposed=False)


@torch.library.custom_op("lockstep::apply_rope_backward", mutates_args=())
def apply_rope_backward_op(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _rotate(grad, cos, sin, transposed=True)


@apply_rope_op.register_fake
@apply_rope_backward_op.register_fake
def _apply_rope_fake(x, cos, sin):
    _check(x, cos, sin)
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output):
    _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    return apply_rope_backward_op(grad, cos, sin), None, None


apply_rope_op.register_autograd(_backward, setup_context=_setup)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The Triton backend of lockstep.kernels.apply_rope."""
    return apply_rope_op(x.contiguous(), cos.contiguous(), sin.contiguous())
