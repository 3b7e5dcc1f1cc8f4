"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start while
the kernel before it on the stream is still finishing, so its launch and the placement of its
programs overlap that kernel's tail instead of following it (the gap between two kernels of a CUDA
graph). Every lockstep kernel that takes it opens with `enter` / `gl_enter`, in this order:

1. `griddepcontrol.wait`: nothing after it runs until the kernel before has completed and its
   writes are visible. It comes before the kernel's first load, so a kernel reads nothing that the
   one before is still writing (its inputs, the split kernels' workspaces and tickets), whatever
   that kernel is.
2. `griddepcontrol.launch_dependents`: the next kernel may launch once every program of this one
   has passed 1., i.e. is placed on an SM and past the wait: a later kernel's programs never take
   an SM slot that one of this kernel's programs still waits for.

Only the schedule: every load still reads what it read without PDL, so no bit moves. A kernel
launched without PDL, or one after a kernel that does not take it, runs as before (the wait then
returns at once).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from lockstep.kernels._triton._device import INTERPRETING

# Knob: launch the kernels that take it with PDL where the GPU has it (compute capability >= 9).
# False: launched as before, the `enter` calls compiled out.
ENABLED = True


def pdl(device: torch.device) -> bool:
    """Whether a launch on `device` takes PDL: ENABLED, a CUDA device of compute capability 9 or
    later, outside Triton's interpreter (which runs no PTX)."""
    return (ENABLED and not INTERPRETING and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


@triton.jit
def enter(PDL: tl.constexpr):
    """A tl kernel's first statement (the module docstring's 1. and 2.); nothing without PDL."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@gluon.jit
def gl_enter(PDL: gl.constexpr):
    """`enter` for a Gluon kernel."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
