"""Token sampling for the native engine: temperature, top-k, top-p, one generator per sample.

Each row is sampled with its own `torch.Generator` from 1-D ops on that row alone, so a sample's
tokens depend only on its seed and its own logits, never on the batch it shares. With top-k/top-p
the kept ids are returned as the row's support: the trainer scores the logprob over exactly them.
"""
from __future__ import annotations

import hashlib

import torch

from lockstep.framework.rollout.base import SamplingParams


def sample_row(logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator):
    """logits [V] fp32 (invalid columns -inf) -> (token id, support ids [k] or None)."""
    if sp.temperature == 0:
        return int(torch.argmax(logits)), None
    z = logits / sp.temperature
    support = None
    if sp.restricts_support:
        order = torch.argsort(z, descending=True, stable=True)
        keep = int(torch.isfinite(z).sum())
        if sp.top_k:
            keep = min(keep, sp.top_k)
        if sp.top_p < 1:
            cum = torch.cumsum(torch.softmax(z[order[:keep]], -1), -1)
            keep = min(keep, int((cum < sp.top_p).sum()) + 1)
        support = order[:keep]
        z = torch.full_like(z, float("-inf")).index_copy(0, support, z[support])
    token = int(torch.multinomial(torch.softmax(z, -1), 1, generator=gen))
    return token, support


def pad_supports(rows: list[torch.Tensor | None]) -> torch.Tensor:
    """Stack 1-D support id lists into [n, k_max], padding with -1."""
    width = max(r.numel() for r in rows)
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r.cpu()
    return out


def sample_seed(base_seed: int, step: int, prompt_id: int, sample: int) -> int:
    """A 63-bit seed that depends only on (run seed, step, prompt id, sample index): a sample is
    reproducible whatever batch it lands in."""
    digest = hashlib.blake2b(f"{base_seed}/{step}/{prompt_id}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
