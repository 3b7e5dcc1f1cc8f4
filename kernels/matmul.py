"""Batch-invariant GEMM: `matmul(a, b)`, `linear(x, weight, bias)` and `linear_rows`.

Invariance rule: the K reduction of a row never depends on M (no split-K chosen from M).
"""
from __future__ import annotations

from typing import Optional

import torch

from lockstep.kernels._backend import KernelOp, get_backend
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


def linear_rows(x: torch.Tensor, weight: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """x @ block^T for the consecutive row blocks of `weight` (a fused q/k/v or gate/up weight) with
    `sizes` rows each: bitwise what `linear(x, block)` gives for each block alone.

    The Triton GEMM computes every output element by the same fixed K steps whatever N is and
    wherever the element's column falls in its tile, so one launch over the fused weight serves
    every block (a decode-sized product of a 1,024-row k or v weight alone fills 8 of 132 SMs).
    The torch reference's library GEMM makes no such promise across N: one call per block."""
    if sum(sizes) != weight.shape[0]:
        raise ValueError(f"linear_rows: sizes {tuple(sizes)} do not add up to the weight's {weight.shape[0]} rows")
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    if get_backend() == "triton":  # views of one output (split: the backward is one cat, not a sum of pads)
        return linear(x, weight).split(list(sizes), -1)
    # slices, not Tensor.split: Dynamo cannot trace split on vLLM's parameter subclasses
    return tuple(linear(x, weight[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
