"""The op set a model instance runs on: lockstep kernels (R) or stock torch ops (P).

`determinism.mode=off` runs the production set on both sides (what other frameworks do); every
other mode runs the lockstep set. The model code only ever calls `ops.<name>`, so which code
computed a logprob is decided in exactly one place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import lockstep.kernels as K


@dataclass(frozen=True)
class ModelOps:
    name: str
    linear: Callable  # (x, weight, bias=None) -> y
    rms_norm: Callable  # (x, weight, eps) -> y
    silu_mul: Callable  # (gate, up) -> y
    attention: Callable  # (q [B,Tq,H,D], k, v [B,S,Hkv,D], q_pos [B,Tq], scale) -> [B,Tq,H,D]
    linear_logp: Callable  # lockstep.kernels.linear_logp signature


def _torch_rms_norm(x, weight, eps):
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _torch_silu_mul(gate, up):
    return F.silu(gate) * up


def _sdpa_attention(q, k, v, q_pos, scale=None):
    tq, s_len = q.shape[1], k.shape[1]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    causal_full = tq == s_len and bool((q_pos == torch.arange(tq, device=q.device)).all())
    if causal_full:  # training / whole-sequence prefill: the flash-style causal path
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:  # decode / prefill against a cache
        mask = torch.arange(s_len, device=q.device)[None, None, None, :] <= q_pos[:, None, :, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def _naive_linear_logp(hidden, weight, targets, *, bias=None, temperature=None, real_vocab_size=None,
                       with_entropy=False, support_ids=None):
    """The usual path: materialise [T, V] logits, log_softmax, gather."""
    logits = F.linear(hidden, weight, bias).float()
    if temperature is not None:
        t = temperature.float().unsqueeze(-1) if isinstance(temperature, torch.Tensor) else float(temperature)
        logits = logits / t
    if real_vocab_size is not None and real_vocab_size < logits.shape[-1]:
        logits[:, real_vocab_size:] = float("-inf")
    if support_ids is not None:
        valid = support_ids >= 0
        logits = logits.gather(1, support_ids.clamp(min=0)).masked_fill(~valid, float("-inf"))
        targets = ((support_ids == targets[:, None]) & valid).float().argmax(1)
    lse = torch.logsumexp(logits, -1)
    logp = logits.gather(1, targets[:, None])[:, 0] - lse
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, -1)
        entropy = lse - (probs * logits.nan_to_num(neginf=0.0)).sum(-1)
    return K.LinearLogpOutput(logp, lse, entropy)


LOCKSTEP_OPS = ModelOps("lockstep", K.linear, K.rms_norm, K.silu_mul, K.causal_attention, K.linear_logp)
PRODUCTION_OPS = ModelOps("production", F.linear, _torch_rms_norm, _torch_silu_mul, _sdpa_attention,
                          _naive_linear_logp)


def ops_for_mode(mode: str) -> ModelOps:
    return PRODUCTION_OPS if mode == "off" else LOCKSTEP_OPS


__all__ = ["ModelOps", "LOCKSTEP_OPS", "PRODUCTION_OPS", "ops_for_mode"]
