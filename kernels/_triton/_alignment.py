"""16-byte alignment of kernel operands.

Triton compiles one binary per pointer alignment class (16-byte aligned or not), and the two can
load with different vector widths, which changes how a row is spread over threads and so the
tree `tl.sum` reduces it in. A row sliced out of a batch at an odd offset must not switch
binaries: operands of reducing kernels are copied to an aligned buffer when misaligned.
"""
from __future__ import annotations

import torch

ALIGN_BYTES = 16


def is_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGN_BYTES == 0


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself when its data starts 16-byte aligned, else an aligned copy (same values)."""
    return t if is_aligned(t) else t.clone()
