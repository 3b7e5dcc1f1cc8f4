"""TMA tensor descriptors: the scratch allocator that device-side descriptors need, and operands
laid out the way TMA accepts them (16-byte aligned base and row stride, unit inner stride)."""
from __future__ import annotations

import torch
import triton

from lockstep.kernels._triton._alignment import ALIGN_BYTES, is_aligned


def install_descriptor_allocator(device: torch.device) -> None:
    """`tl.make_tensor_descriptor` writes its descriptors to global scratch that Triton requests
    from this allocator at launch. Triton keeps the allocator in a ContextVar, so it is set before
    every launch: autograd runs the backward in its own thread, which would not see one set once
    at import."""
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))


def _aligned(t: torch.Tensor, row_stride: int) -> bool:
    return is_aligned(t) and (row_stride * t.element_size()) % ALIGN_BYTES == 0


def _padded_columns(cols: int, element_size: int) -> int:
    per_row = ALIGN_BYTES // element_size
    return -(-cols // per_row) * per_row


def aligned_empty(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [rows, cols] view of a fresh buffer whose row stride is padded to 16 bytes."""
    padded = _padded_columns(cols, dtype.itemsize)
    return torch.empty(rows, padded, dtype=dtype, device=device)[:, :cols]


def tma_matrix(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(rows, transposed) for a 2-D `t`: `rows` is a row-major, TMA-ready matrix holding `t`
    (transposed=False) or `t.T` (transposed=True). Row- and column-major `t` (a transposed view,
    as the GEMM backward passes) are used in place; anything else is copied, values unchanged."""
    if t.stride(1) == 1 and _aligned(t, t.stride(0)):
        return t, False
    if t.stride(0) == 1 and _aligned(t, t.stride(1)):
        return t.t(), True
    copy = aligned_empty(t.shape[0], t.shape[1], t.dtype, t.device)
    copy.copy_(t)
    return copy, False
