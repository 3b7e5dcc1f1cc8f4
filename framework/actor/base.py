"""Actor interface: teacher-forced logprobs, a training step, weights for sync, checkpoints."""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass

import torch

from lockstep.framework.rollout.base import Rollout
from lockstep.framework.weights.sync import Bucket


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
    def sync_plan(self) -> int:
        """The number of buckets a weight sync streams (weights/sync.py)."""

    @abc.abstractmethod
    def sync_bucket(self, phase: str, index: int) -> Bucket | None:
        """Bucket `index` of a sync, stamped with the actor's version (None on ranks that only help)."""

    @abc.abstractmethod
    def sync_done(self) -> None: ...

    def offload_tensors(self) -> list[torch.Tensor]:
        """The tensors on its device a colocated actor releases while the engines generate."""
        return []

    def offload(self) -> dict:
        """Colocated mode, after the weight sync: params, grads and optimizer state to the host. The
        tensors are collected at every offload: the optimizer's state appears at its first step."""
        from lockstep.framework.actor.offload import DeviceOffload

        if getattr(self, "_offloader", None) is not None and self._offloader.offloaded:
            return {}
        tensors = self.offload_tensors()
        if not tensors:
            return {}
        t0 = time.perf_counter()
        self._offloader = DeviceOffload(tensors)
        self._offloader.offload()
        return {"offload_s": time.perf_counter() - t0, "offloaded_gib": self._offloader.total_gib}

    def reload(self) -> dict:
        off = getattr(self, "_offloader", None)
        if off is None or not off.offloaded:
            return {}
        t0 = time.perf_counter()
        off.reload()
        return {"reload_s": time.perf_counter() - t0}

    def memory(self) -> dict:
        from lockstep.framework.rollout.base import device_memory

        return device_memory()

    @abc.abstractmethod
    def save(self, path: str) -> None: ...

    @abc.abstractmethod
    def save_weights(self, path: str) -> None:
        """The model alone as an HF directory (no optimizer state): `lockstep bisect`'s record."""

    @abc.abstractmethod
    def load(self, path: str) -> None: ...
