"""Weight sync from the actor to rollout engines: versioned, checksummed payloads.

Ordering rules (each enforced by a check, never assumed):
1. The actor stamps every payload with its policy version; an engine accepts only the version
   right after the one it holds (-1 before the first sync), so a stale, repeated or skipped update
   is refused rather than silently generating with the wrong weights.
2. The checksum covers names, dtypes, shapes and bytes in name order. The engine verifies it
   *before* loading (a corrupted payload never touches the live weights) and again on its own
   parameters *after* loading (a load that converted or dropped a tensor is caught).
3. Rollouts carry the version they were generated with; the driver refuses to score a rollout
   against an actor whose version differs.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Iterable

import torch


class WeightSyncError(RuntimeError):
    pass


class WeightVersionError(WeightSyncError):
    pass


class WeightChecksumError(WeightSyncError):
    pass


def checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(named_tensors, key=lambda kv: kv[0]):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@dataclass
class WeightPayload:
    version: int
    tensors: dict[str, torch.Tensor]
    checksum: str
    timings: dict[str, float] = field(default_factory=dict)

    @classmethod
    def pack(cls, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> "WeightPayload":
        t0 = time.perf_counter()
        # Staged on the host: the payload crosses processes through Ray's object store.
        tensors = {name: t.detach().to("cpu", copy=True) for name, t in named_tensors}
        digest = checksum(tensors.items())
        return cls(version, tensors, digest, {"pack_s": time.perf_counter() - t0})


def verify_incoming(payload: WeightPayload, current_version: int) -> None:
    """Refuse a payload that is not the next version or whose bytes do not match its checksum."""
    if payload.version != current_version + 1:
        raise WeightVersionError(f"weight update refused: engine holds version {current_version}, "
                                 f"payload has version {payload.version} (expected {current_version + 1})")
    actual = checksum(payload.tensors.items())
    if actual != payload.checksum:
        raise WeightChecksumError(f"weight update refused: payload version {payload.version} checksum "
                                  f"{actual} != stamped {payload.checksum} (corrupted in transit)")


def verify_loaded(named_tensors: Iterable[tuple[str, torch.Tensor]], payload: WeightPayload) -> None:
    actual = checksum(named_tensors)
    if actual != payload.checksum:
        raise WeightChecksumError(f"weights after loading version {payload.version} hash to {actual}, "
                                  f"not {payload.checksum}: the engine's load changed them")
