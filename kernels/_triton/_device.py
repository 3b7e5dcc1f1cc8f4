"""Facts about where the Triton kernels run that decide the size of their launch grids."""
from __future__ import annotations

import functools
import os

import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

# The interpreter runs programs one after another on the CPU: a handful is enough to exercise a
# persistent loop (several tiles per program) without paying for a GPU-sized grid.
_INTERPRETER_PROGRAMS = 4


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def resident_programs(device: torch.device) -> int:
    """Programs of a persistent kernel: one per SM, so every program stays resident and loops over
    its share of the work (the interpreter: a few)."""
    if INTERPRETING or device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
