"""Ticket counters of the split kernels (the decode attention's chunk programs, the row-parallel
tree's subtree programs): each program of a group adds to its group's counter after storing its
partial result, and the one that completes the count combines the group's partials and sets the
counter back to zero before it does. Every counter a launch touches is therefore zero again when
it ends, so the counters live in one buffer per (device, stream) that is zeroed once, when made,
instead of a memset before every launch (a node of its own in every CUDA graph).

The buffer is shared by every launch on its stream, which runs them one after another; two graphs
captured on one stream must not be replayed concurrently on two streams. A buffer outgrown is kept,
not freed: a captured graph may still address it.

A buffer first made while a CUDA graph is being captured on its stream is zeroed only by a node of
that graph: until that graph replays, its counters hold whatever the memory held, and a launch
outside it (another graph captured later on the stream and replayed first, or an eager call) would
count from garbage: its merge would never run, or run before every partial was stored. So such a
buffer is zeroed again before each launch captured on that stream (a memset node per launch, warned
once), until an eager call on the stream zeroes it in stream order. One eager call on the capture
stream before capturing (vLLM's warm-up makes one) keeps the graphs free of memsets."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

_MIN_TICKETS = 1 << 16  # int32 counters a buffer starts with (256 KiB): every Qwen3 decode batch and tree
_BUFFERS: dict[tuple[torch.device, int], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []
_ZEROED_IN_GRAPH: set[tuple[torch.device, int]] = set()  # buffers whose only zeroing so far is a graph's node


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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
        if _capturing(device):
            if key not in _ZEROED_IN_GRAPH:
                log.warning("lockstep split kernels: their ticket counters for stream %#x were first made inside a "
                            "CUDA-graph capture; every launch captured on that stream now zeroes them (a memset node "
                            "each) until an eager call runs there. Make one eager call on the capture stream before "
                            "capturing to keep the graphs free of them (kernels/_triton/_tickets.py).", stream)
            _ZEROED_IN_GRAPH.add(key)
        else:
            _ZEROED_IN_GRAPH.discard(key)
        return buf
    if _ZEROED_IN_GRAPH and key in _ZEROED_IN_GRAPH:  # (usually empty: the launch asks nothing more of the host)
        if _capturing(device):
            buf[:n].zero_()  # a node of this graph: its launch counts from zero whichever graph replays first
        else:
            buf.zero_()  # in stream order: every later launch on the stream finds zeros
            _ZEROED_IN_GRAPH.discard(key)
    return buf
