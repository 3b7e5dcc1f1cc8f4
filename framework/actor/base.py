"""Actor interface: teacher-forced logprobs, a training step, weights for sync, checkpoints."""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from lockstep.framework.rollout.base import Rollout
from lockstep.framework.weights.sync import WeightPayload


@dataclass
class LogpResult:
    logp: torch.Tensor  # [B, R] fp32, 0 past each response
    weights_version: int


class Actor(abc.ABC):
    @abc.abstractmethod
    def compute_logp(self, rollout: Rollout) -> LogpResult: ...

    @abc.abstractmethod
    def train(self, rollout: Rollout, rewards: torch.Tensor, group_ids: torch.Tensor,
              old_logp: torch.Tensor) -> dict: ...

    @abc.abstractmethod
    def weights_for_sync(self) -> WeightPayload: ...

    @abc.abstractmethod
    def save(self, path: str) -> None: ...

    @abc.abstractmethod
    def load(self, path: str) -> None: ...
