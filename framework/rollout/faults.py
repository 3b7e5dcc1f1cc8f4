"""Faults a rollout engine can inject (`determinism.inject_fault`): negative controls proving that
the bitwise check fires. A fault changes the rollout's logprobs on every sampling route (the full
vocabulary, a top-p or top-k support) and leaves the sampled tokens alone.

  rollout_logp_reversed_vocab  the rollout scores its tokens with stock ops (F.linear, logsumexp)
                               over the kept ids listed in reverse: the same math as lockstep's
                               fixed chunk tree, in another order, so other roundings
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FAULTS = ("none", "rollout_logp_reversed_vocab")


def check_fault(name: str) -> str:
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; valid: {', '.join(FAULTS)}")
    return name


def faulty_logp(name: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature=None,
                real_vocab_size: int, support_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The logprob [T] of `targets` as the fault `name` computes it (hidden [T, H], weight [V, H])."""
    check_fault(name)
    z = F.linear(hidden, weight).float()[:, :real_vocab_size]
    if temperature is not None:
        z = z / (temperature.float()[:, None] if isinstance(temperature, torch.Tensor) else float(temperature))
    if support_ids is None:
        kept = torch.arange(real_vocab_size, device=z.device).expand_as(z)
    else:
        kept = support_ids
    kept = kept.flip(-1)
    zk = z.gather(1, kept.clamp(min=0)).masked_fill(kept < 0, float("-inf"))
    return z.gather(1, targets[:, None])[:, 0] - torch.logsumexp(zk, -1)
