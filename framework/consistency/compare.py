"""Bitwise comparison of rollout and trainer logprobs, done every step before training.

Equality is on the bit pattern (int32 view of the fp32 value), not on `==`: -0.0 vs 0.0 or two
different NaN payloads are mismatches too.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


# A step where at least this share of the compared logprobs is exactly 0.0 on both sides gets a warning.
VACUOUS_CERTAIN_FRAC = 0.9


class LockstepMismatchError(RuntimeError):
    """Strict mode: the trainer's logprob of some token differs from the rollout's."""


@dataclass
class TokenDiff:
    sample: int
    position: int  # index within the response
    token: int
    rollout_logp: float
    train_logp: float

    @property
    def abs_diff(self) -> float:
        return abs(self.rollout_logp - self.train_logp)


@dataclass
class ConsistencyReport:
    numel: int
    mismatch_count: int
    max_abs_diff: float
    mean_abs_diff: float
    k3_kl: float
    first_mismatch: TokenDiff | None
    worst: list[TokenDiff] = field(default_factory=list)
    certain: int = 0  # compared logprobs exactly 0.0 on both sides (probability 1: they agree trivially)

    @property
    def mismatch_rate(self) -> float:
        return self.mismatch_count / max(1, self.numel)

    @property
    def certain_frac(self) -> float:
        return self.certain / max(1, self.numel)

    def vacuous(self) -> str | None:
        """Why this step's agreement says little, or None: a policy that is certain of nearly every
        token it samples (collapsed, e.g. by too large a learning rate) reports logprob 0.0 on both
        sides whatever their kernels do."""
        if self.numel and self.certain_frac >= VACUOUS_CERTAIN_FRAC:
            return (f"{self.certain} of {self.numel} compared logprobs are exactly 0.0 on both sides (the policy is "
                    f"certain of its tokens, e.g. collapsed by too large an actor.lr): their agreement checks nothing")
        return None

    def metrics(self) -> dict[str, float]:
        return {"consistency/mismatch_count": self.mismatch_count, "consistency/numel": self.numel,
                "consistency/max_abs_diff": self.max_abs_diff, "consistency/mean_abs_diff": self.mean_abs_diff,
                "consistency/mismatch_rate": self.mismatch_rate, "consistency/k3_kl": self.k3_kl,
                "consistency/certain_frac": self.certain_frac,
                # the same number under the name slime users chart
                "train/train_rollout_logprob_abs_diff": self.mean_abs_diff}


def compare_logp(rollout_logp: torch.Tensor, train_logp: torch.Tensor, mask: torch.Tensor,
                 tokens: torch.Tensor, worst_k: int = 8) -> ConsistencyReport:
    """All [B, R]; mask marks response tokens; tokens are the response ids (for the report)."""
    a, b = rollout_logp.float(), train_logp.float()
    differs = (a.view(torch.int32) != b.view(torch.int32)) & mask
    diff = (a - b).abs().masked_fill(~mask, 0.0).nan_to_num(nan=float("inf"))
    n = int(mask.sum())
    r = (b - a)[mask].double()
    k3 = float((torch.exp(r) - r - 1).mean()) if n else 0.0

    def token(bi, ri):
        return TokenDiff(bi, ri, int(tokens[bi, ri]), float(a[bi, ri]), float(b[bi, ri]))

    first = None
    if differs.any():
        bi, ri = differs.nonzero()[0].tolist()
        first = token(bi, ri)
    order = torch.argsort(diff.flatten(), descending=True, stable=True)[:worst_k]
    worst = [token(i // diff.shape[1], i % diff.shape[1]) for i in order.tolist()
             if mask.flatten()[i] and diff.flatten()[i] > 0]
    certain = int(((a == 0) & (b == 0) & mask).sum())
    return ConsistencyReport(n, int(differs.sum()), float(diff.max()) if n else 0.0,
                             float(diff[mask].mean()) if n else 0.0, k3, first, worst, certain)


def raise_on_mismatch(report: ConsistencyReport, step: int, hint: str = "") -> None:
    if report.mismatch_count:
        f = report.first_mismatch
        raise LockstepMismatchError(
            f"step {step}: {report.mismatch_count} of {report.numel} logprobs differ between rollout "
            f"and trainer (max |diff| {report.max_abs_diff:.3g}); first at sample {f.sample}, "
            f"response position {f.position} (token {f.token}): rollout {f.rollout_logp!r} vs "
            f"trainer {f.train_logp!r}. This mode stops on a mismatch; determinism.on_mismatch=report "
            f"only reports it.{hint}")


def check_importance_ratio(report: ConsistencyReport, train_metrics: dict, step: int) -> None:
    """A step whose logprobs all agreed must have trained with an importance ratio of exactly 1 on
    every token (the loss saw the very logprobs that were compared)."""
    differ = train_metrics.get("tis_differ", 0.0)
    if report.mismatch_count == 0 and differ:
        raise LockstepMismatchError(
            f"step {step}: every logprob agreed, yet the loss saw a rollout/trainer importance ratio other "
            f"than 1 on {differ:.3g} of its tokens: the logprobs handed to training are not the ones compared")
