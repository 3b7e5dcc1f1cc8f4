"""GRPO: group-normalised advantages, clipped policy loss, k3 KL to a frozen reference."""
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

    def __post_init__(self):
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"unknown loss_agg {self.loss_agg!r}; valid: {', '.join(LOSS_AGGREGATIONS)}")
        if self.clip_low < 0 or self.clip_high < 0 or self.kl_coef < 0:
            raise ValueError("clip_low, clip_high and kl_coef must be >= 0")
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


def aggregate(x: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    m = mask.float()
    if how == "token_mean":
        return (x * m).sum() / m.sum().clamp(min=1)
    per_seq = (x * m).sum(1) / m.sum(1).clamp(min=1)
    return per_seq[mask.any(1)].mean()


def grpo_loss(logp, old_logp, advantages, mask, cfg: GRPOConfig, ref_logp=None):
    """logp, old_logp, ref_logp [B, R]; advantages [B]; mask [B, R] -> (loss, metrics)."""
    adv = advantages[:, None].expand_as(logp)
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv
    pg = -torch.minimum(unclipped, clipped)
    pg_loss = aggregate(pg, mask, cfg.loss_agg)
    kl_loss = aggregate(k3_kl(logp, ref_logp), mask, cfg.loss_agg) if ref_logp is not None else logp.new_zeros(())
    loss = pg_loss + cfg.kl_coef * kl_loss
    with torch.no_grad():
        # the clip is active where the clipped objective is the smaller one (verl's pg_clipfrac)
        clipfrac = aggregate((clipped < unclipped).float(), mask, "token_mean")
        ratio_mean = aggregate(ratio, mask, "token_mean")
    return loss, {"pg_loss": pg_loss.item(), "kl_loss": kl_loss.item(), "clipfrac": clipfrac.item(),
                  "ratio_mean": ratio_mean.item()}
