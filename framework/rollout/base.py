"""Rollout engine interface and the batch it returns."""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from lockstep.framework.weights.sync import Bucket


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (logprobs then use the raw logits)
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 16

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def restricts_support(self) -> bool:
        return self.temperature > 0 and (self.top_p < 1 or self.top_k > 0)

    @property
    def logp_temperature(self) -> float | None:
        return None if self.temperature in (0, 1) else self.temperature


@dataclass
class Rollout:
    """B sampled sequences, right-padded. Response token r of sample b sits at
    tokens[b, prompt_lens[b] + r]; its rollout log-probability is logp[b, r]."""

    tokens: torch.Tensor  # [B, L] int64, pad-filled
    prompt_lens: torch.Tensor  # [B]
    response_lens: torch.Tensor  # [B]
    logp: torch.Tensor  # [B, R] fp32 (0 past the response)
    support_ids: torch.Tensor | None  # [B, R, k] int64, -1 = unused (top-p / top-k replay)
    finished: torch.Tensor  # [B] bool: ended with EOS (else truncated at max_new_tokens)
    weights_version: int
    sampling: SamplingParams

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_lens(self) -> torch.Tensor:
        """[B] tokens of each sample, prompt and response."""
        return self.prompt_lens + self.response_lens

    def response_mask(self) -> torch.Tensor:
        r = self.logp.shape[1]
        return torch.arange(r)[None, :] < self.response_lens[:, None]

    def response_tokens(self) -> torch.Tensor:
        """[B, R] response token ids (pad past the response)."""
        r = self.logp.shape[1]
        idx = (self.prompt_lens[:, None] + torch.arange(r)[None, :]).clamp(max=self.tokens.shape[1] - 1)
        return torch.where(self.response_mask(), self.tokens.gather(1, idx), torch.zeros_like(idx))


class RolloutEngine(abc.ABC):
    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seeds: list[list[int]]) -> Rollout:
        """prompts: token ids per prompt; seeds[i][j]: the seed of sample j of prompt i
        (len(seeds[i]) samples are drawn). Samples are ordered prompt-major."""

    @abc.abstractmethod
    def receive_bucket(self, bucket: Bucket) -> dict:
        """One bucket of a weight sync (weights/sync.py: verified in the first pass, loaded in the
        second; stale versions and bad checksums refused); returns timings."""

    def sleep(self) -> str:
        """Colocated mode, after the rollout: release the engine's device memory (KV cache, weights)
        for training; says what it did."""
        return "sleep skipped: this engine keeps no device memory to release"

    def wake(self, what: str) -> str:
        """what: "weights" (before the weight sync, which rewrites them) or "kv_cache" (after it)."""
        return "wake skipped: this engine keeps no device memory to release"

    def memory(self) -> dict:
        return device_memory()


def device_memory() -> dict:
    """GiB in use on this process's GPU (all processes), allocated by this process now, and its peak
    allocation since the last call; {} without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return {"used_gib": (total - free) / 2**30, "allocated_gib": torch.cuda.memory_allocated() / 2**30, "peak_gib": peak}
