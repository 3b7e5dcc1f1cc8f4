"""Flattened weight buckets and their device-side checksum.

A bucket is a run of whole HF-named tensors packed into one flat uint8 buffer (offsets aligned to 16
bytes, so every tensor is a view of it): one transfer, one IPC handle, one checksum per bucket, never
one per tensor. Which tensors share a bucket is decided from shapes alone (`plan_buckets`), so every
rank of a sharded trainer cuts the same buckets without looking at the data.

The checksum is computed where the bytes are (the trainer's GPU at send, the engine's GPU after load):
per tensor, two integer sums over its 32-bit words, exact in int64 (wrap-around) arithmetic and
therefore independent of the reduction order and the device, combined on the host with the names,
dtypes and shapes. It detects changed, swapped, truncated and misplaced bytes; it is an integrity
check, not a cryptographic one.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable

import torch

ALIGN = 16
_CHUNK_WORDS = 1 << 24  # bounds the digest's temporaries to a few hundred MiB per tensor
_MIX = 0x5851F42D4C957F2D  # an odd 63-bit constant


def _words(t: torch.Tensor) -> torch.Tensor:
    """t's bytes (row-major) as int32 words, zero-padded to a whole word."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-b.numel()) % 4
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    return b.view(torch.int32)


def tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """[2] int64 on t's device: sum(w * (2i + 1)) and sum((w ^ MIX) * (w + i)) over its words w_i."""
    w = _words(t)
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    mix = torch.tensor(_MIX, dtype=torch.int64, device=t.device)
    for lo in range(0, w.numel(), _CHUNK_WORDS):
        x = w[lo:lo + _CHUNK_WORDS].to(torch.int64)
        i = torch.arange(lo, lo + x.numel(), dtype=torch.int64, device=t.device)
        out[0] += (x * (2 * i + 1)).sum()
        out[1] += ((x ^ mix) * (x + i)).sum()
    return out


def checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The checksum of HF-named tensors in the given order: one host transfer of their digests."""
    named = list(named_tensors)
    h = hashlib.blake2b(digest_size=16)
    for name, t in named:
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)};".encode())
    if named:
        dev = named[0][1].device
        h.update(torch.stack([tensor_digest(t).to(dev) for _, t in named]).cpu().numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class BucketLayout:
    """Where each tensor of a bucket lives in its flat buffer."""
    names: tuple[str, ...]
    dtypes: tuple[str, ...]  # torch dtype names, e.g. "bfloat16"
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]  # bytes
    nbytes: int

    @classmethod
    def of(cls, named: list[tuple[str, torch.Tensor]]) -> "BucketLayout":
        offsets, off = [], 0
        for _, t in named:
            offsets.append(off)
            off += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        return cls(tuple(n for n, _ in named), tuple(str(t.dtype).removeprefix("torch.") for _, t in named),
                   tuple(tuple(t.shape) for _, t in named), tuple(offsets), off)


def pack(named: list[tuple[str, torch.Tensor]], out: torch.Tensor | None = None) -> tuple[torch.Tensor, BucketLayout]:
    """Copy the tensors into one flat uint8 buffer (`out`, reused when large enough; else new, on
    the first tensor's device) -> (buffer[:nbytes], layout)."""
    layout = BucketLayout.of(named)
    if out is None or out.numel() < layout.nbytes:
        out = torch.empty(layout.nbytes, dtype=torch.uint8, device=named[0][1].device)
    flat = out[:layout.nbytes]
    for (_, t), off in zip(named, layout.offsets):
        b = t.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[off:off + b.numel()].copy_(b)
    return flat, layout


def unpack(flat: torch.Tensor, layout: BucketLayout) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a bucket, as views of its flat buffer."""
    out = []
    for name, dtype, shape, off in zip(layout.names, layout.dtypes, layout.shapes, layout.offsets):
        dt = getattr(torch, dtype)
        n = 1
        for s in shape:
            n *= s
        out.append((name, flat[off:off + n * dt.itemsize].view(dt).view(shape)))
    return out


def plan_buckets(group_bytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive groups (a layer's tensors, or the embeddings and norms) per bucket, each bucket
    filled up to bucket_bytes; a group larger than that travels alone."""
    buckets, cur, size = [], [], 0
    for i, n in enumerate(group_bytes):
        if cur and size + n > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        buckets.append(cur)
    return buckets
