"""Triton SwiGLU activation `silu(gate) * up` with its analytic backward.

Elementwise, so batch invariance is structural: each element is computed from its own gate and
up values only, by the same instructions wherever it sits (a misaligned pointer may change how
many elements one load fetches, never the arithmetic on an element). Arithmetic is fp32, rounded once to the
input dtype. sigmoid is `1 / (1 + exp(-g))`: for g < -88, exp(-g) overflows to inf and sigmoid is
exactly 0, and the backward below never multiplies that inf by 0, so no NaN appears.

gate and up may be row views of one fused [rows, 2 * cols] GEMM output (kernels.linear_rows):
the kernels read them with their row strides instead of copying them; outputs are contiguous.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _sigmoid(g):
    return 1.0 / (1.0 + tl.exp(-g))


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, cols, stride_g, stride_u, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    g = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    out = g * _sigmoid(g) * u
    tl.store(out_ptr + row * cols + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_backward_kernel(grad_ptr, gate_ptr, up_ptr, d_gate_ptr, d_up_ptr, cols, stride_g, stride_u,
                              BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    grad = tl.load(grad_ptr + row * cols + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    sig = _sigmoid(g)
    d_gate = grad * u * sig * (1.0 + g * (1.0 - sig))
    d_up = grad * g * sig
    tl.store(d_gate_ptr + row * cols + offs, d_gate.to(d_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(d_up_ptr + row * cols + offs, d_up.to(d_up_ptr.dtype.element_ty), mask=mask)


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    if gate.dtype != up.dtype or gate.device != up.device or not gate.dtype.is_floating_point:
        raise ValueError(f"silu_mul: gate and up must share a floating dtype and device, got "
                         f"{gate.dtype} on {gate.device} and {up.dtype} on {up.device}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as a [rows, cols] matrix with unit column stride: a view where its layout allows it (a
    row slice of a wider matrix among them), else a contiguous copy."""
    t2 = t.reshape(1, -1) if t.dim() < 2 else t.flatten(0, -2)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _grid(x: torch.Tensor) -> tuple[int, int]:
    return (x.shape[0], triton.cdiv(x.shape[1], _BLOCK))


@torch.library.custom_op("lockstep::silu_mul", mutates_args=())
def silu_mul_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check(gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel():
        g, u = _rows(gate), _rows(up)
        _silu_mul_kernel[_grid(g)](g, u, out, g.shape[1], g.stride(0), u.stride(0), BLOCK=_BLOCK)
    return out


@silu_mul_op.register_fake
def _silu_mul_fake(gate, up):
    _check(gate, up)
    return gate.new_empty(gate.shape)


@torch.library.custom_op("lockstep::silu_mul_backward", mutates_args=())
def silu_mul_backward_op(grad: torch.Tensor, gate: torch.Tensor,
                         up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(gate, up)
    grad = grad.contiguous()
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    if gate.numel():
        g, u = _rows(gate), _rows(up)
        _silu_mul_backward_kernel[_grid(g)](grad, g, u, d_gate, d_up, g.shape[1], g.stride(0), u.stride(0),
                                            BLOCK=_BLOCK)
    return d_gate, d_up


@silu_mul_backward_op.register_fake
def _silu_mul_backward_fake(grad, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    gate, up = ctx.saved_tensors
    return silu_mul_backward_op(grad, gate, up)


silu_mul_op.register_autograd(_backward, setup_context=_setup)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The Triton backend of lockstep.kernels.silu_mul."""
    return silu_mul_op(gate, up)
