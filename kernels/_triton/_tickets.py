"""Buffers that the split kernels leave as they found them, one per (kind, device, stream), made once
instead of filled before every launch (a node of its own in every CUDA graph):

- ticket counters (the decode attention's chunk programs, the row-parallel tree's subtree
  programs): each program of a group adds to its group's counter after storing its partial result,
  and the one that completes the count combines the group's partials and sets the counter back to
  zero before it does;
- polled chunk states (the decode attention's polled merge): every word holds UNWRITTEN_BITS until
  a program stores a chunk state there, and the program that merges it sets it back.

Every word a launch touches is therefore as it was when the launch ends. A buffer is shared by every
launch on its stream, which runs them one after another; two graphs captured on one stream must not
be replayed concurrently on two streams. A buffer outgrown is kept, not freed: a captured graph may
still address it."""
from __future__ import annotations

from typing import Callable

import torch

_MIN_TICKETS = 1 << 16  # int32 counters a buffer starts with (256 KiB): every Qwen3 decode batch and tree
_MIN_STATES = 1 << 20  # float32 words of polled states a buffer starts with (4 MiB: batch 1 at 32k keys)
# the int32 bits of an unwritten polled state word: a NaN that no arithmetic writes (the GPU writes its
# canonical NaN, 0x7fffffff)
UNWRITTEN_BITS = -1
_BUFFERS: dict[tuple[str, torch.device, int], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


def _stream_buffer(kind: str, device: torch.device, n: int, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (kind, device, stream)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = _BUFFERS[key] = make(n)
    return buf


def zeroed_tickets(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 counters on `device`, each zero, for a launch on the current stream whose
    kernel leaves every counter it takes a ticket from at zero again."""
    return _stream_buffer("tickets", device, n,
                          lambda n: torch.zeros(max(n, _MIN_TICKETS), dtype=torch.int32, device=device))


def unwritten_states(device: torch.device, n: int) -> torch.Tensor:
    """At least n float32 words on `device`, each holding UNWRITTEN_BITS, for a launch on the current
    stream whose kernel sets every word it writes back to UNWRITTEN_BITS before it ends."""
    return _stream_buffer("states", device, n, lambda n: torch.full((max(n, _MIN_STATES),), UNWRITTEN_BITS,
                                                                      dtype=torch.int32, device=device).view(torch.float32))
