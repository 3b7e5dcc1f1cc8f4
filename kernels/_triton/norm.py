"""Batch-invariant Triton RMSNorm (Qwen3 semantics) and its deterministic backward.

Forward: `weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)`.
Why a row's result never depends on the batch: one program normalises one whole row, held in a
single block of BLOCK_H = next_pow2(H) lanes. `tl.sum` reduces in a tree fixed by the compiled
layout, which follows BLOCK_H, num_warps (both functions of H alone) and the pointers' alignment
class (operands are made 16-byte aligned, _alignment.py): one binary, one tree, for every row.

Backward: dx is per row again (the forward's statistics are recomputed by the same code, so they
are the same bits). The weight gradient sums over rows without atomics: a fixed grid of programs
each add their rows (a fixed strided set, in ascending order) into an fp32 partial; the partials
are then summed over programs by one torch reduction, whose order is fixed for a fixed shape.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lockstep.kernels._triton._alignment import aligned
from lockstep.kernels._triton._device import resident_programs

_MAX_H = 65536  # one row lives in registers across the block's warps
_BACKWARD_PROGRAMS_PER_SM = 4  # hide each row's load -> reduce -> store latency


@triton.jit
def _normalize(xf, H, eps):
    """(x * rstd, rstd) for one fp32 row whose padding lanes hold 0."""
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    return xf * rstd, rstd


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, eps, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0)
    normed, _ = _normalize(x.to(tl.float32), H, eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(x.dtype).to(tl.float32)
    tl.store(y_ptr + row * H + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rows", "num_programs"])
def _rms_norm_backward_kernel(dy_ptr, x_ptr, w_ptr, dx_ptr, dw_partial_ptr, rows, H, eps, num_programs,
                              BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    for row in range(pid.to(tl.int64), rows, num_programs):  # int64 row offsets
        offs = row * H + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        normed, rstd = _normalize(x.to(tl.float32), H, eps)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # y = w * cast(n) with the cast passed straight through: dn = dy * w, and
        # dx = rstd * (dn - n * mean(dn * n)) from n = x * rsqrt(mean(x^2) + eps).
        dn = dy * w
        dx = rstd * (dn - normed * (tl.sum(dn * normed, axis=0) / H))
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * normed.to(x.dtype).to(tl.float32)  # weight multiplied the cast value
    tl.store(dw_partial_ptr + pid.to(tl.int64) * H + cols, dw, mask=mask)


def _block_h(h: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps): both fixed by H, which fixes the reduction tree of every row."""
    block = triton.next_power_of_2(h)
    return block, min(16, max(1, block // 512))


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm expects x [..., H] and weight [H], got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if x.shape[-1] > _MAX_H:
        raise ValueError(f"rms_norm: H={x.shape[-1]} exceeds the supported {_MAX_H}")
    if not (x.dtype.is_floating_point and weight.dtype.is_floating_point) or x.device != weight.device:
        raise ValueError(f"rms_norm: x and weight must be floating point on one device, got "
                         f"{x.dtype} on {x.device} and {weight.dtype} on {weight.device}")


@torch.library.custom_op("lockstep::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, weight)
    h = x.shape[-1]
    x, weight = aligned(x.contiguous()), aligned(weight.contiguous())
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rows = x.numel() // h if h else 0
    if rows:
        block, warps = _block_h(h)
        _rms_norm_kernel[(rows,)](x, weight, y, h, eps, BLOCK_H=block, num_warps=warps)
    return y


@rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps):
    _check(x, weight)
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("lockstep::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, weight)
    h = x.shape[-1]
    x, grad, weight = aligned(x.contiguous()), aligned(grad.contiguous()), aligned(weight.contiguous())
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // h if h else 0
    if rows == 0:
        return dx, torch.zeros_like(weight)
    programs = min(rows, _BACKWARD_PROGRAMS_PER_SM * resident_programs(x.device))
    partial = torch.empty(programs, h, dtype=torch.float32, device=x.device)
    block, warps = _block_h(h)
    _rms_norm_backward_kernel[(programs,)](grad, x, weight, dx, partial, rows, h, eps, programs,
                                           BLOCK_H=block, num_warps=warps)
    return dx, partial.sum(0).to(weight.dtype)


@rms_norm_backward_op.register_fake
def _rms_norm_backward_fake(grad, x, weight, eps):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dw = rms_norm_backward_op(grad, x, weight, ctx.eps)
    return dx, dw, None


rms_norm_op.register_autograd(_backward, setup_context=_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton backend of lockstep.kernels.rms_norm."""
    return rms_norm_op(x.contiguous(), weight.contiguous(), float(eps))
