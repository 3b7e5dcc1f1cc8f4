"""Teacher-forced logprobs of a rollout's response tokens, for every actor backend.

An actor runs the forward of some samples (each from position 0) to their final hidden states;
`score_samples` then scores each response token with the side's logp op on the hidden state that
predicted it, with the rollout's temperature and top-p/top-k support: exactly the call the rollout
engine made, on exactly the same rows. The results land in [B, R] tensors over the whole batch
(`BatchLogp`), with a mask of the tokens this worker scored.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

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


def micro_batches(lengths: list[int], max_tokens: int, packed: bool = False) -> list[list[int]]:
    """Greedy contiguous groups of sample indices whose size fits max_tokens: count x longest
    (padded), or the sum of the lengths (packed); a sample longer than max_tokens travels alone."""
    groups, cur, longest, total = [], [], 0, 0
    for i, n in enumerate(lengths):
        size = total + n if packed else (len(cur) + 1) * max(longest, n)
        if cur and size > max_tokens:
            groups.append(cur)
            cur, longest, total = [], 0, 0
        cur.append(i)
        longest, total = max(longest, n), total + n
    if cur:
        groups.append(cur)
    return groups


def sample_groups(rollout: Rollout, samples: torch.Tensor, max_tokens: int | None,
                  packed: bool = False) -> list[torch.Tensor]:
    """`samples` as micro-batches of at most max_tokens tokens (prompt + response; padded to each
    micro-batch's longest sample, or packed end to end); None: one micro-batch. An actor runs one
    forward per micro-batch, and in training one backward per micro-batch (gradients accumulate),
    so actor.max_tokens_per_gpu bounds the activations alive at once, whatever the batch."""
    if max_tokens is None:
        return [samples] if samples.numel() else []
    lengths = rollout.seq_lens[samples].tolist()
    return [samples[g] for g in micro_batches(lengths, max_tokens, packed)]


class Packed(NamedTuple):
    """Samples `idx` of a rollout end to end in one row: token n is sample rows[n]'s position cols[n]."""
    tokens: torch.Tensor  # [1, N]
    positions: torch.Tensor  # [1, N], from 0 in every sample
    cu_seqlens: torch.Tensor  # [len(idx) + 1] int32
    rows: torch.Tensor  # [N]
    cols: torch.Tensor  # [N]
    width: int  # the longest sample

    @classmethod
    def of(cls, rollout: Rollout, idx: torch.Tensor, device) -> "Packed":
        lens = rollout.seq_lens[idx]
        rows = torch.repeat_interleave(torch.arange(len(idx)), lens)
        ends = lens.cumsum(0)
        cols = torch.arange(int(ends[-1])) - (ends - lens)[rows]
        tokens = rollout.tokens[idx][rows, cols]
        cu = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
        return cls(tokens[None].to(device), cols[None].to(device), cu.to(device), rows.to(device), cols.to(device),
                   int(lens.max()))

    def unpack(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, N, h] packed hidden states -> [len(idx), width, h], each sample from position 0 (zeros
        past its end): the layout score_samples reads."""
        out = hidden.new_zeros(int(self.cu_seqlens.numel()) - 1, self.width, hidden.shape[-1])
        return out.index_put((self.rows, self.cols), hidden[0])


def model_logp(model, rollout: Rollout, samples: torch.Tensor, *, real_vocab_size: int,
               with_entropy: bool, max_tokens: int | None = None, pack: bool = False) -> BatchLogp:
    """The native Qwen3 model's teacher-forced logprobs of `samples`, one forward per micro-batch of
    at most max_tokens tokens, padded or packed (the native actor's scoring, and the trainer side of
    `lockstep bisect`'s replay)."""
    dev = next(model.parameters()).device
    out = BatchLogp(rollout, dev, with_entropy)

    def token_logp(h, targets, **kw):
        return model.token_logp(h, targets, real_vocab_size=real_vocab_size, with_entropy=with_entropy, **kw)

    for idx in sample_groups(rollout, samples, max_tokens, pack):
        if pack:
            p = Packed.of(rollout, idx, dev)
            hidden = p.unpack(model(p.tokens, p.positions, cu_seqlens=p.cu_seqlens, max_seqlen=p.width))
        else:
            width = int(rollout.seq_lens[idx].max())
            tokens = rollout.tokens[idx, :width].to(dev)
            b, length = tokens.shape
            hidden = model(tokens, torch.arange(length, device=dev).expand(b, length))
        score_samples(out, hidden, rollout, idx, token_logp)
    return out


def warmup_lr(optim: dict, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warm-up over optim.warmup_steps."""
    return optim["lr"] * min(1.0, (step + 1) / max(1, int(optim.get("warmup_steps", 0))))
