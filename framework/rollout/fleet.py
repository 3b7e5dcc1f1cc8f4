"""The rollout engines of a run, as one: prompts dealt round-robin, results merged in prompt order."""
from __future__ import annotations

import ray
import torch
import torch.nn.functional as F

from lockstep.framework.rollout.base import Rollout, SamplingParams


def merge_rollouts(parts: list[Rollout], rows_of_part: list[list[int]], pad_id: int) -> Rollout:
    """Concatenate engine results (padding to the widest) and put row r of part p at global row
    rows_of_part[p][r]."""
    if len({p.weights_version for p in parts}) != 1:
        raise RuntimeError(f"engines generated with different weight versions: {[p.weights_version for p in parts]}")
    length = max(p.tokens.shape[1] for p in parts)
    width = max(p.logp.shape[1] for p in parts)

    def pad_to(t, size, dim, value):
        return F.pad(t, [0, 0] * (t.dim() - 1 - dim) + [0, size - t.shape[dim]], value=value)

    order = torch.tensor([g for rows in rows_of_part for g in rows]).argsort()
    tokens = torch.cat([pad_to(p.tokens, length, 1, pad_id) for p in parts])[order]
    logp = torch.cat([pad_to(p.logp, width, 1, 0.0) for p in parts])[order]
    support = None
    if parts[0].support_ids is not None:
        k = max(p.support_ids.shape[2] for p in parts)
        support = torch.cat([pad_to(pad_to(p.support_ids, k, 2, -1), width, 1, -1) for p in parts])[order]
    cat = lambda name: torch.cat([getattr(p, name) for p in parts])[order]  # noqa: E731
    return Rollout(tokens, cat("prompt_lens"), cat("response_lens"), logp, support, cat("finished"),
                   parts[0].weights_version, parts[0].sampling)


class RolloutFleet:
    """engines[e]: the Ray actors of engine e, one per rank (a tensor-parallel native engine has
    several: every call goes to all of them, rank 0 answers)."""

    def __init__(self, engines: list[list], pad_id: int):
        self.engines, self.pad_id = engines, pad_id

    def _all(self, method: str, *args) -> list:
        """method on every rank of every engine -> rank 0's answer per engine."""
        refs = [[getattr(w, method).remote(*args) for w in ranks] for ranks in self.engines]
        return [ray.get(r)[0] for r in refs]

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seeds: list[list[int]]) -> Rollout:
        n = len(self.engines)
        dealt = [list(range(e, len(prompts), n)) for e in range(n)]
        dealt = [d for d in dealt if d]
        calls = [[w.generate.remote([prompts[i] for i in d], sampling, [seeds[i] for i in d]) for w in self.engines[e]]
                 for e, d in enumerate(dealt)]
        refs = [c[0] for c in calls]
        ray.get([r for c in calls for r in c[1:]])
        # global row of each sample: prompt-major, len(seeds[i]) samples per prompt
        first = [0]
        for s in seeds:
            first.append(first[-1] + len(s))
        rows = [[first[i] + j for i in d for j in range(len(seeds[i]))] for d in dealt]
        return merge_rollouts(ray.get(refs), rows, self.pad_id)

    def receive_bucket(self, bucket_ref) -> list[dict]:
        """Every rank of every engine takes one bucket of a weight sync (weights/sync.py); the timings."""
        return ray.get([w.receive_bucket.remote(bucket_ref) for ranks in self.engines for w in ranks])

    def sleep(self) -> list[str]:
        """Colocated mode: release the engines' device memory (KV cache, weights) for training."""
        return self._all("sleep")

    def wake(self, what: str) -> list[str]:
        return self._all("wake", what)

    def memory(self) -> dict:
        """The GPU memory of the engines (the largest)."""
        found = [m for m in self._all("memory") if m]
        return {k: max(m[k] for m in found) for k in found[0]} if found else {}

    def write_readbacks(self, run_dir: str) -> None:
        ray.get([w.write_readback.remote(run_dir) for ranks in self.engines for w in ranks])
