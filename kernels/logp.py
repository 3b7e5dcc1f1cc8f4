"""Fused LM-head projection + log-softmax + gather: `linear_logp` (torch reference).

Numerics (identical on every side and every vocab sharding):
- logits are produced per fixed-width vocab chunk (VOCAB_CHUNK columns; the last may be shorter,
  which sums identically because the tree sum pads with exact zeros);
- temperature divides the fp32 logits at exactly one point;
- columns at or beyond `real_vocab_size` (padding) are -inf;
- each chunk yields (max, sum exp, sum exp*z); chunk states merge in a fixed balanced tree over the
  chunk index, so the order never depends on T or on which rows share the batch;
- with `support_ids` [T, k] (-1 = unused slot) the softmax runs over those ids only (top-p replay),
  taken as a set: rows are sorted before reducing, so the listing order never matters.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from lockstep.kernels._invariant import tiled_mm, tree_sum

VOCAB_CHUNK = 4096
_NEG_INF = float("-inf")


class LinearLogpOutput(NamedTuple):
    logp: torch.Tensor  # [T] fp32
    lse: torch.Tensor  # [T] fp32
    entropy: torch.Tensor | None  # [T] fp32 when requested


def _safe(m: torch.Tensor) -> torch.Tensor:
    """A max of -inf (all entries masked) becomes 0 so that exp(-inf - 0) = 0 instead of NaN."""
    return torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)


def _chunk_state(z: torch.Tensor, with_entropy: bool):
    """z [T, C] fp32 (masked entries -inf) -> (max, sum exp(z - max), sum exp(z - max) * z)."""
    m = z.detach().amax(-1)
    p = torch.exp(z - _safe(m).unsqueeze(-1))
    s = tree_sum(p)
    w = tree_sum(p * torch.where(torch.isinf(z), torch.zeros_like(z), z)) if with_entropy else None
    return m, s, w


def _merge_tree(m: torch.Tensor, s: torch.Tensor, w: torch.Tensor | None):
    """Merge [T, n] chunk states pairwise over a balanced tree padded with the identity."""
    n = m.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        m = F.pad(m, (0, width - n), value=_NEG_INF)
        s = F.pad(s, (0, width - n))
        w = F.pad(w, (0, width - n)) if w is not None else None
    while width > 1:
        width //= 2
        m1, m2 = m[..., :width], m[..., width:]
        mm = torch.maximum(m1, m2)
        a1 = torch.exp(m1 - _safe(mm))
        a2 = torch.exp(m2 - _safe(mm))
        s = s[..., :width] * a1 + s[..., width:] * a2
        if w is not None:
            w = w[..., :width] * a1 + w[..., width:] * a2
        m = mm
    return m[..., 0], s[..., 0], (w[..., 0] if w is not None else None)


def _scale(z: torch.Tensor, temperature) -> torch.Tensor:
    if temperature is None:
        return z
    if isinstance(temperature, torch.Tensor):
        return z / temperature.float().reshape(-1, *([1] * (z.dim() - 1)))
    return z / float(temperature)


def _validate(hidden, weight, targets, real_vocab_size, support_ids):
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_logp: hidden [T,H] and weight [V,H] expected, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"linear_logp: targets {tuple(targets.shape)} != [T]={hidden.shape[0]}")
    if real_vocab_size is not None and not 0 < real_vocab_size <= weight.shape[0]:
        raise ValueError(f"linear_logp: real_vocab_size {real_vocab_size} outside (0, {weight.shape[0]}]")
    if support_ids is not None and (support_ids.dim() != 2 or support_ids.shape[0] != hidden.shape[0]):
        raise ValueError(f"linear_logp: support_ids must be [T, k], got {tuple(support_ids.shape)}")


def linear_logp(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                bias: torch.Tensor | None = None, temperature=None, real_vocab_size: int | None = None,
                with_entropy: bool = False, support_ids: torch.Tensor | None = None) -> LinearLogpOutput:
    """log softmax(hidden @ weight^T + bias)[targets] without materialising [T, V] logits at once.

    hidden [T, H], weight [V, H], targets [T] (int), temperature float | [T] | None.
    """
    _validate(hidden, weight, targets, real_vocab_size, support_ids)
    if support_ids is not None:
        return _support_logp(hidden, weight, targets, bias, temperature, with_entropy, support_ids)
    vocab = weight.shape[0] if real_vocab_size is None else real_vocab_size
    if int(targets.min()) < 0 or int(targets.max()) >= vocab:
        raise ValueError(f"linear_logp: target ids must lie in [0, {vocab})")
    states, target_z = [], torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for lo in range(0, weight.shape[0], VOCAB_CHUNK):
        hi = min(lo + VOCAB_CHUNK, weight.shape[0])
        z = tiled_mm(hidden, weight[lo:hi].t())
        if bias is not None:
            z = z + bias[lo:hi]
        z = _scale(z.float(), temperature)
        cols = torch.arange(lo, hi, device=z.device)
        z = z.masked_fill(cols >= vocab, _NEG_INF)
        in_chunk = (targets >= lo) & (targets < hi)
        picked = z.gather(1, (targets - lo).clamp(0, hi - lo - 1).unsqueeze(1)).squeeze(1)
        target_z = torch.where(in_chunk, picked, target_z)
        states.append(_chunk_state(z, with_entropy))
    m = torch.stack([st[0] for st in states], -1)
    s = torch.stack([st[1] for st in states], -1)
    w = torch.stack([st[2] for st in states], -1) if with_entropy else None
    return _finish(target_z, *_merge_tree(m, s, w))


def _finish(target_z, m, s, w) -> LinearLogpOutput:
    lse = m + torch.log(s)
    entropy = lse - w / s if w is not None else None
    return LinearLogpOutput(target_z - lse, lse, entropy)


def canonical_support(support_ids: torch.Tensor) -> torch.Tensor:
    """A support is a set: sort each row's ids ascending (unused -1 slots last), so the reduction
    order never depends on the order in which an engine happened to list them."""
    big = torch.iinfo(support_ids.dtype).max
    ordered = torch.where(support_ids >= 0, support_ids, big).sort(-1).values
    return torch.where(ordered == big, -1, ordered)


def _support_logp(hidden, weight, targets, bias, temperature, with_entropy, support_ids):
    support_ids = canonical_support(support_ids)
    valid = support_ids >= 0
    hit = (support_ids == targets.unsqueeze(1)) & valid
    if not bool(hit.any(1).all()):
        row = int((~hit.any(1)).nonzero()[0])
        raise ValueError(f"linear_logp: target {int(targets[row])} of row {row} is not in its support ids")
    ids = support_ids.clamp(min=0)
    # Each support logit is its own dot product (tree-summed), so the width k never matters.
    z = tree_sum(hidden.unsqueeze(1) * weight[ids], -1)
    if bias is not None:
        z = z + bias[ids]
    z = _scale(z.float(), temperature).masked_fill(~valid, _NEG_INF)
    target_z = (z.masked_fill(~hit, 0.0)).sum(-1)  # exactly one hit per row: sum of one value and zeros
    m, s, w = _chunk_state(z, with_entropy)
    return _finish(target_z, m, s, w)
