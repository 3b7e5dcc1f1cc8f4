"""SwiGLU activation: silu(gate) * up, batch-invariant, with an analytic backward.

`torch.sigmoid`/`F.silu` on CPU give a different last bit in the vectorised tail than in the body,
so the sigmoid is built from `exp` and a division (both measured position-independent). The
backward is written out because autograd through `g / (1 + exp(-g))` turns exp overflow into NaN.
"""
from __future__ import annotations

import torch

from lockstep.kernels._backend import KernelOp


def _sigmoid(g: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-g))


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        sig = _sigmoid(gate)
        ctx.save_for_backward(gate, up, sig)
        return gate * sig * up

    @staticmethod
    def backward(ctx, grad):
        gate, up, sig = ctx.saved_tensors
        silu = gate * sig
        dsilu = sig * (1.0 + gate * (1.0 - sig))
        return grad * up * dsilu, grad * silu


def _reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SiluMul.apply(gate, up)


_silu_mul = KernelOp("silu_mul", _reference, "activation:silu_mul", fake=lambda gate, up: torch.empty_like(gate))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    return _silu_mul(gate, up)
