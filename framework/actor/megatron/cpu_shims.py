"""What megatron-core needs to run on a CPU (gloo) process: test support, never the GPU path.

megatron-core assumes CUDA in a few places that CPU CI reaches: `torch.cuda.current_device()` and
hard-coded `device="cuda"` when it allocates buffers (rotary, global memory buffer, DDP grad
buffers, optimizer flags), the CUDA RNG tracker's `fork`, and `tensor.type() ==
"torch.cuda.FloatTensor"` checks in the distributed optimizer. In a process with no CUDA at all,
each of those would fail, so `apply()` answers them for the CPU: CUDA device requests land on the
CPU, the RNG fork is a no-op (dropout is 0 everywhere), type names read as their CUDA twins, and
the stream waits megatron-core 0.19's grad sync issues (`torch.cuda.current_stream().wait_event`)
do nothing: a CPU process runs everything in order anyway.
`apply()` refuses to run where CUDA exists: on a GPU nothing here is ever touched.
"""
from __future__ import annotations

import contextlib
import functools

import torch

_applied = False
_FACTORIES = ("tensor", "as_tensor", "empty", "zeros", "ones", "full", "arange", "rand", "randn", "randint",
              "empty_like", "zeros_like", "ones_like", "full_like")


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    d = torch.device(device) if isinstance(device, str) else device
    return torch.device("cpu") if isinstance(d, torch.device) and d.type == "cuda" else device


def _redirect_device_kwarg(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)
    return wrapped


class _NoStream:
    def wait_event(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return None


def _patch_tensor_methods() -> None:
    to = torch.Tensor.to

    def to_cpu(self, *args, **kwargs):
        if args and isinstance(args[0], (str, torch.device, int)):
            args = (_cpu_device(args[0]),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return to(self, *args, **kwargs)

    type_name = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        name = type_name(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or ".cuda." in name:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.to = to_cpu
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.type = cuda_type_name


def apply() -> None:
    global _applied
    if _applied:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megatron CPU shims must never be applied in a process that has CUDA")
    for name in _FACTORIES:
        setattr(torch, name, _redirect_device_kwarg(getattr(torch, name)))
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    _patch_tensor_methods()
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()
    _applied = True
