"""GRPO: group-normalised advantages, clipped policy loss, k3 KL to a frozen reference, and an
optional token-level truncated importance-sampling (TIS) correction for rollouts whose logprobs are
not the trainer's."""
from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean")


@dataclass(frozen=True)
class GRPOConfig:
    clip_low: float = 0.2  # ratio is clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    kl_coef: float = 0.0  # weight of the k3 KL to the frozen initial policy (0 = no reference model)
    norm_adv_by_std: bool = True  # divide by the group's std (Dr. GRPO sets this False)
    adv_eps: float = 1e-6
    loss_agg: str = "token_mean"
    num_minibatches: int = 1  # optimizer steps per rollout batch
    # TIS: each token's policy-gradient term times min(exp(trainer old logp - rollout logp), tis_cap);
    # 0 = off. For determinism off/auto, where the engine's logprobs are not the trainer's; in strict
    # the ratio is exactly 1 on every token (the driver checks train/tis_differ == 0)
    tis_cap: float = 0.0

    def __post_init__(self):
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"unknown loss_agg {self.loss_agg!r}; valid: {', '.join(LOSS_AGGREGATIONS)}")
        if self.clip_low < 0 or self.clip_high < 0 or self.kl_coef < 0:
            raise ValueError("clip_low, clip_high and kl_coef must be >= 0")
        if self.tis_cap != 0 and self.tis_cap < 1:
            raise ValueError(f"algo.tis_cap must be 0 (off) or >= 1, got {self.tis_cap}")
        if self.num_minibatches < 1:
            raise ValueError(f"num_minibatches must be >= 1, got {self.num_minibatches}")


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """(r - mean_group) / (std_group + eps), std unbiased; one advantage per sample."""
    adv = torch.empty_like(rewards, dtype=torch.float32)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        if int(idx.sum()) < 2:
            raise ValueError(f"group {int(g)} has one sample: GRPO needs n_samples >= 2")
        r = rewards[idx].float()
        centred = r - r.mean()
        adv[idx] = centred / (r.std() + eps) if norm_by_std else centred
    return adv


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def token_weights(mask: torch.Tensor, how: str) -> torch.Tensor:
    """[B, R] weights, summing to 1 over the batch, that turn per-token terms into the loss.
    token_mean: every token alike; seq_mean_token_mean: every sequence alike, its tokens alike.
    A worker holding only some tokens sums its own tokens' weighted terms: the parts add up to the
    same loss whatever the split."""
    m = mask.float()
    if how == "token_mean":
        return m / m.sum().clamp(min=1)
    lengths = m.sum(1, keepdim=True)
    return m / lengths.clamp(min=1) / (lengths > 0).sum().clamp(min=1)


def grpo_token_terms(logp, old_logp, advantages, cfg: GRPOConfig, ref_logp=None) -> dict[str, torch.Tensor]:
    """Per-token [B, R] terms: the clipped policy loss, the k3 KL, clip indicator and ratio."""
    adv = advantages[:, None].expand_as(logp)
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv
    terms = {"pg": -torch.minimum(unclipped, clipped), "ratio": ratio.detach(),
             # the clip is active where the clipped objective is the smaller one (verl's pg_clipfrac)
             "clipped": (clipped < unclipped).float().detach()}
    terms["kl"] = k3_kl(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)
    return terms


LOSS_STATS = ("pg_loss", "kl_loss", "clipfrac", "ratio_mean", "entropy", "tis_ratio_mean", "tis_capped", "tis_differ")


def grpo_loss(logp, old_logp, advantages, mask, cfg: GRPOConfig, ref_logp=None, *, rows=None, owned=None,
              entropy=None, rollout_logp=None):
    """One optimizer step's GRPO loss, or the share of it that one worker's tokens carry.

    logp, old_logp, ref_logp, entropy, mask, owned: [B, R] over the whole rollout batch;
    advantages [B]; rows: the minibatch's samples (default all); owned: the tokens this worker
    scored (default all). Token weights come from the minibatch's mask (cfg.loss_agg) and are zero
    outside `owned`, so the workers' shares add up to the minibatch loss whatever the split.
    rollout_logp [B, R]: the engine's logprobs of the tokens (default: old_logp, the trainer's), for
    the importance ratio exp(old_logp - rollout_logp) that TIS (cfg.tis_cap) caps and weights by.
    Returns (loss, stats): stats are this worker's shares (0-d tensors) of LOSS_STATS (clipfrac,
    ratio, entropy and the tis_* stats are token means; tis_differ is the share of tokens whose
    two logprobs differ in any bit)."""
    if rows is not None:
        in_rows = torch.zeros_like(mask)
        in_rows[rows.to(mask.device)] = True
        mask = mask & in_rows
    w, tok = token_weights(mask, cfg.loss_agg), token_weights(mask, "token_mean")
    if owned is not None:
        w, tok = w * owned, tok * owned
        # tokens another worker (or micro-batch) scores hold 0 here: give them ratio 1 and KL 0, so
        # an old logprob below -88 cannot make exp() inf and the zero-weighted term NaN
        logp = torch.where(owned, logp, old_logp)
        ref_logp = torch.where(owned, ref_logp, old_logp) if ref_logp is not None else None
    t = grpo_token_terms(logp, old_logp, advantages, cfg, ref_logp)
    behaviour = old_logp if rollout_logp is None else torch.where(mask, rollout_logp, old_logp)
    is_ratio = torch.exp(old_logp - behaviour)  # 1 wherever the two logprobs are equal
    pg_terms = t["pg"] * is_ratio.clamp(max=cfg.tis_cap) if cfg.tis_cap else t["pg"]
    pg, kl = (pg_terms * w).sum(), (t["kl"] * w).sum()
    stats = {"pg_loss": pg.detach(), "kl_loss": kl.detach(), "clipfrac": (t["clipped"] * tok).sum(),
             "ratio_mean": (t["ratio"] * tok).sum(),
             "entropy": (entropy.detach() * tok).sum() if entropy is not None else torch.zeros_like(pg),
             "tis_ratio_mean": (is_ratio * tok).sum(),
             "tis_capped": ((is_ratio > cfg.tis_cap).float() * tok).sum() if cfg.tis_cap else torch.zeros_like(pg),
             "tis_differ": ((old_logp != behaviour).float() * tok).sum()}
    return pg + cfg.kl_coef * kl, stats
