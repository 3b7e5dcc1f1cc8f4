"""Teacher-forced logprobs of a rollout's response tokens, for every actor backend.

An actor runs the forward of some samples (each from position 0) to their final hidden states;
`score_samples` then scores each response token with the side's logp op on the hidden state that
predicted it, with the rollout's temperature and top-p/top-k support: exactly the call the rollout
engine made, on exactly the same rows. The results land in [B, R] tensors over the whole batch
(`BatchLogp`), with a mask of the tokens this worker scored.
"""
from __future__ import annotations

from typing import Callable

import torch

from lockstep.framework.rollout.base import Rollout


class BatchLogp:
    """[B, R] logprobs (and entropies) of the tokens one worker scored, `owned` marking which."""

    def __init__(self, rollout: Rollout, device, with_entropy: bool):
        shape = rollout.logp.shape
        self.logp = torch.zeros(shape, device=device)
        self.entropy = torch.zeros(shape, device=device) if with_entropy else None
        self.owned = torch.zeros(shape, dtype=torch.bool, device=device)
        # 0 that depends on every hidden state scored from: added to a loss, it keeps the backward
        # running through every layer on every rank (collectives inside must meet) even where a
        # rank owns no token of a micro-batch
        self.anchor = torch.zeros((), device=device)

    def add(self, samples: torch.Tensor, positions: torch.Tensor, out) -> None:
        self.logp = self.logp.index_put((samples, positions), out.logp)
        self.owned = self.owned.index_put((samples, positions), torch.ones_like(positions, dtype=torch.bool))
        if self.entropy is not None:
            self.entropy = self.entropy.index_put((samples, positions), out.entropy.detach())


def score_samples(into: BatchLogp, hidden: torch.Tensor, rollout: Rollout, samples: torch.Tensor,
                  token_logp: Callable, positions: torch.Tensor | None = None) -> None:
    """hidden [b, s, h]: the final hidden states of rollout samples `samples` (row i = sample
    samples[i], its tokens from position 0). token_logp(hidden [n, h], targets [n], *, temperature,
    support_ids): the side's logp op (a vocab shard's included). positions [s]: the sequence
    positions hidden holds (context parallelism: this rank's share), default 0..s-1; a token is
    scored by the rank that holds the hidden state predicting it."""
    dev = hidden.device
    if hidden.requires_grad:
        into.anchor = into.anchor + hidden.sum() * 0.0
    mask = rollout.response_mask()[samples].to(dev)
    bi, ri = mask.nonzero(as_tuple=True)
    src = rollout.prompt_lens[samples].to(dev)[bi] + ri - 1  # the state at src predicts the token at src + 1
    row = src
    if positions is not None:
        positions = positions.to(dev)
        local = torch.full((int(positions.max()) + 1,), -1, dtype=torch.long, device=dev)
        local[positions] = torch.arange(positions.numel(), device=dev)
        row = local[src.clamp(max=local.numel() - 1)].masked_fill(src >= local.numel(), -1)
        mine = row >= 0
        bi, ri, src, row = bi[mine], ri[mine], src[mine], row[mine]
    targets = rollout.tokens[samples].to(dev)[bi, src + 1]
    support = rollout.support_ids[samples].to(dev)[bi, ri] if rollout.support_ids is not None else None
    out = token_logp(hidden[bi, row], targets, temperature=rollout.sampling.logp_temperature, support_ids=support)
    into.add(samples.to(dev)[bi], ri, out)


def model_logp(model, rollout: Rollout, samples: torch.Tensor, *, real_vocab_size: int,
               with_entropy: bool) -> BatchLogp:
    """The native Qwen3 model's teacher-forced logprobs of `samples` (the native actor's scoring, and
    the trainer side of `lockstep bisect`'s replay)."""
    dev = next(model.parameters()).device
    tokens = rollout.tokens[samples].to(dev)
    b, length = tokens.shape
    hidden = model(tokens, torch.arange(length, device=dev).expand(b, length))
    out = BatchLogp(rollout, dev, with_entropy)

    def token_logp(h, targets, **kw):
        return model.token_logp(h, targets, real_vocab_size=real_vocab_size, with_entropy=with_entropy, **kw)

    score_samples(out, hidden, rollout, samples, token_logp)
    return out


def warmup_lr(optim: dict, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warm-up over optim.warmup_steps."""
    return optim["lr"] * min(1.0, (step + 1) / max(1, int(optim.get("warmup_steps", 0))))
