"""Colocated runs: free a worker's GPU memory while another phase has the GPU, in place.

`DeviceOffload` copies the storages of a set of GPU tensors (parameters, gradients, optimizer state,
megatron's contiguous parameter/gradient buffers) to pinned host memory and resizes each storage to
zero, which returns its memory to the caching allocator; `reload` re-allocates and copies back.
Tensor objects and every view of a storage stay valid (a parameter inside megatron's flat buffer,
an optimizer state), so nothing else has to be rebuilt. A storage is handled once however many
tensors view it. `reload(restore=False)` only re-allocates: for weights that the next weight sync
rewrites whole.
"""
from __future__ import annotations

from typing import Iterable

import torch


def device_tensors(*objects, device_type: str = "cuda") -> list[torch.Tensor]:
    """The tensors on `device_type` reachable from modules, optimizers, tensors and (nested)
    containers: a module's parameters, buffers and their .grad / .main_grad; an optimizer's state
    and params. Collect them when offloading, not once: an optimizer creates its state (Adam's
    moments) at its first step, after a colocated run's first offload."""
    out, seen = [], set()

    def visit(o):
        if id(o) in seen:
            return
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.device.type == device_type:
                out.append(o)
            for attr in ("grad", "main_grad"):
                g = getattr(o, attr, None)
                if isinstance(g, torch.Tensor):
                    visit(g)
        elif isinstance(o, torch.nn.Module):  # nn.Module's own methods: megatron's DDP has a `buffers` list
            for t in list(torch.nn.Module.parameters(o)) + list(torch.nn.Module.buffers(o)):
                visit(t)
        elif isinstance(o, torch.optim.Optimizer):
            for group in o.param_groups:
                visit(group["params"])
            visit(list(o.state.values()))
        elif isinstance(o, dict):
            for v in o.values():
                visit(v)
        elif isinstance(o, (list, tuple, set)):
            for v in o:
                visit(v)

    for o in objects:
        visit(o)
    return out


class DeviceOffload:
    def __init__(self, tensors: Iterable[torch.Tensor]):
        storages = {}
        for t in tensors:
            s = t.untyped_storage()
            if s.nbytes():
                storages.setdefault((s.device, s.data_ptr()), s)
        self.storages = list(storages.values())
        self.nbytes = [s.nbytes() for s in self.storages]
        self.host: list[torch.Tensor] | None = None

    @property
    def total_gib(self) -> float:
        return sum(self.nbytes) / 2**30

    @property
    def offloaded(self) -> bool:
        return self.host is not None

    def offload(self, keep: bool = True) -> None:
        """keep=False drops the contents (the next reload must be restore=False, and something
        rewrites them)."""
        if self.offloaded or not self.storages:
            return
        host = []
        for s, n in zip(self.storages, self.nbytes):
            if keep:
                h = torch.empty(n, dtype=torch.uint8, pin_memory=s.device.type == "cuda")
                h.copy_(torch.empty(0, dtype=torch.uint8, device=s.device).set_(s), non_blocking=True)
                host.append(h)
            else:
                host.append(None)
        _sync(self.storages)
        for s in self.storages:
            s.resize_(0)
        self.host = host

    def reload(self, restore: bool = True) -> None:
        if not self.offloaded:
            return
        for s, n, h in zip(self.storages, self.nbytes, self.host):
            s.resize_(n)
            if restore:
                if h is None:
                    raise RuntimeError("offloaded without keeping the contents: reload(restore=False) and rewrite them")
                torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).copy_(h, non_blocking=True)
        _sync(self.storages)
        self.host = None


def _sync(storages) -> None:
    if any(s.device.type == "cuda" for s in storages):
        torch.cuda.synchronize()
