"""The linear-logp provider ABI: plain frozen structures that validate themselves on construction.

A provider is any callable `provider(request) -> result-like` where the result exposes `logp`,
`entropy`, `backend_id`, `contract_id`, `provenance`. Provider packages need not import lockstep:
they read the request's attributes and return any object with those attributes, and they signal
"cannot run here" by raising an exception whose class has `linear_logp_provider_unavailable = True`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lockstep.kernels import value_checks_enabled

LAYOUTS = ("single", "zigzag", "allgather")


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(frozen=True)
class TokenLayout:
    """How the rows of this request are spread over context-parallel ranks (row ownership)."""
    world_size: int = 1
    rank: int = 0
    layout: str = "single"

    def __post_init__(self):
        _need(self.world_size >= 1 and 0 <= self.rank < self.world_size,
              f"TokenLayout: rank {self.rank} not in [0, {self.world_size})")
        _need(self.layout in LAYOUTS, f"TokenLayout: layout {self.layout!r} not in {LAYOUTS}")


@dataclass(frozen=True)
class VocabPartition:
    """This rank's slice [local_start, local_start + local_size) of a padded vocab of padded_size,
    of which the first real_size ids are real (the rest are masked to -inf)."""
    local_start: int
    local_size: int
    real_size: int
    padded_size: int

    def __post_init__(self):
        _need(0 < self.real_size <= self.padded_size, f"VocabPartition: real_size {self.real_size} not in (0, {self.padded_size}]")
        _need(self.local_size > 0 and 0 <= self.local_start and self.local_start + self.local_size <= self.padded_size,
              f"VocabPartition: local [{self.local_start}, {self.local_start + self.local_size}) outside [0, {self.padded_size})")

    @classmethod
    def whole(cls, padded_size: int, real_size: int | None = None) -> "VocabPartition":
        return cls(0, padded_size, real_size or padded_size, padded_size)


@dataclass(frozen=True)
class LinearProjection:
    weight: torch.Tensor  # [V_local, H]
    bias: torch.Tensor | None = None  # [V_local]

    def __post_init__(self):
        _need(self.weight.dim() == 2, f"LinearProjection: weight must be [V_local, H], got {tuple(self.weight.shape)}")
        if self.bias is not None:
            _need(self.bias.shape == self.weight.shape[:1], f"LinearProjection: bias {tuple(self.bias.shape)} != [V_local]")
            _need(self.bias.device == self.weight.device, "LinearProjection: bias and weight on different devices")


@dataclass(frozen=True)
class LinearLogpContext:
    hidden: torch.Tensor  # [T, H]
    projection: LinearProjection
    vocab: VocabPartition
    # [T, V_local] fp32 products hidden @ weight^T as lockstep.kernels.lm_head_logits gave them (the
    # engine sampled from them), or None. A provider may fold them instead of multiplying again; its
    # result must not change either way (lockstep's does so bit for bit; others may ignore them).
    logits: torch.Tensor | None = None

    def __post_init__(self):
        w = self.projection.weight
        _need(self.hidden.dim() == 2, f"LinearLogpContext: hidden must be [T, H], got {tuple(self.hidden.shape)}")
        _need(self.hidden.shape[1] == w.shape[1], f"LinearLogpContext: hidden H={self.hidden.shape[1]} != weight H={w.shape[1]}")
        _need(self.hidden.dtype == w.dtype, f"LinearLogpContext: hidden {self.hidden.dtype} != weight {w.dtype}")
        _need(self.hidden.device == w.device, f"LinearLogpContext: hidden on {self.hidden.device}, weight on {w.device}")
        _need(w.shape[0] == self.vocab.local_size, f"LinearLogpContext: weight rows {w.shape[0]} != vocab.local_size {self.vocab.local_size}")
        if self.logits is not None:
            _need(self.logits.shape == (self.hidden.shape[0], w.shape[0]) and self.logits.dtype == torch.float32
                  and self.logits.device == w.device,
                  f"LinearLogpContext: logits must be [T, V_local] = [{self.hidden.shape[0]}, {w.shape[0]}] fp32 on "
                  f"{w.device}, got {tuple(self.logits.shape)} {self.logits.dtype} on {self.logits.device}")


@dataclass(frozen=True)
class LinearLogpRequest:
    context: LinearLogpContext
    target_ids: torch.Tensor  # [T] global vocab ids
    temperature: float | torch.Tensor | None = None  # applied once, in fp32
    with_entropy: bool = False
    support_ids: torch.Tensor | None = None  # [T, k] global ids, -1 = unused (top-p replay)
    token_layout: TokenLayout = TokenLayout()
    tp_group: Any = None  # process group over which the vocab is sharded (None = unsharded)
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        h, t = self.context.hidden, self.target_ids
        _need(t.dim() == 1 and t.shape[0] == h.shape[0], f"LinearLogpRequest: target_ids must be [T={h.shape[0]}], got {tuple(t.shape)}")
        _need(not t.is_floating_point(), f"LinearLogpRequest: target_ids must be integer, got {t.dtype}")
        _need(t.device == h.device, f"LinearLogpRequest: target_ids on {t.device}, hidden on {h.device}")
        checks = value_checks_enabled()  # the checks on device values stop the host until the device catches up
        if t.numel() and checks:
            _need(int(t.min()) >= 0 and int(t.max()) < self.context.vocab.real_size,
                  f"LinearLogpRequest: target ids outside [0, {self.context.vocab.real_size})")
        if isinstance(self.temperature, torch.Tensor):
            _need(self.temperature.shape == t.shape, f"LinearLogpRequest: temperature tensor must be [T], got {tuple(self.temperature.shape)}")
            _need(not checks or bool((self.temperature > 0).all()), "LinearLogpRequest: temperatures must be > 0")
        elif self.temperature is not None:
            _need(self.temperature > 0, f"LinearLogpRequest: temperature must be > 0, got {self.temperature}")
        if self.support_ids is not None:
            s = self.support_ids
            _need(s.dim() == 2 and s.shape[0] == h.shape[0], f"LinearLogpRequest: support_ids must be [T, k], got {tuple(s.shape)}")
            _need(s.device == h.device, "LinearLogpRequest: support_ids on another device")

    @property
    def num_tokens(self) -> int:
        return self.target_ids.shape[0]


@dataclass(frozen=True)
class LinearLogpResult:
    logp: torch.Tensor  # [T] fp32
    entropy: torch.Tensor | None  # [T] fp32 when requested
    backend_id: str
    contract_id: str
    provenance: dict = field(default_factory=dict)


class LinearLogpProviderUnavailable(RuntimeError):
    """Raised by a provider that cannot run here (no GPU, missing build): `auto` falls back."""
    linear_logp_provider_unavailable = True


def is_unavailable_signal(exc: BaseException) -> bool:
    return bool(getattr(type(exc), "linear_logp_provider_unavailable", False))
