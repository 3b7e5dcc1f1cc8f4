"""Ticket counters of the split kernels (the decode attention's chunk programs, the row-parallel
tree's subtree programs): each program of a group adds to its group's counter after storing its
partial result, and the one that completes the count combines the group's partials and sets the
counter back to zero before it does. Every counter a launch touches is therefore zero again when
it ends, so the counters live in one buffer per (device, stream) that is zeroed once, when made,
instead of a memset before every launch (a node of its own in every CUDA graph).

The buffer is shared by every launch on its stream, which runs them one after another; two graphs
captured on one stream must not be replayed concurrently on two streams. A buffer outgrown is kept,
not freed: a captured graph may still address it."""
from __future__ import annotations

import torch

_MIN_TICKETS = 1 << 16  # int32 counters a buffer starts with (256 KiB): every Qwen3 decode batch and tree
_BUFFERS: dict[tuple[torch.device, int], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


def zeroed_tickets(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 counters on `device`, each zero, for a launch on the current stream whose
    kernel leaves every counter it takes a ticket from at zero again."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = _BUFFERS[key] = torch.zeros(max(n, _MIN_TICKETS), dtype=torch.int32, device=device)
    return buf
