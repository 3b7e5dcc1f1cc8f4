"""The actor ranks of a run, as one: every call goes to every rank (they run collectives together);
rank 0 answers for the group."""
from __future__ import annotations

import ray

from lockstep.framework.actor.base import LogpResult


class ActorGroup:
    def __init__(self, workers: list):
        self.workers = workers

    def _all(self, method: str, *args):
        return [getattr(w, method).remote(*args) for w in self.workers]

    def compute_logp(self, rollout) -> LogpResult:
        ref = ray.put(rollout)
        return ray.get(self._all("compute_logp", ref))[0]

    def train(self, rollout, rewards, group_ids, old_logp) -> dict:
        ref = ray.put(rollout)
        return ray.get(self._all("train", ref, rewards, group_ids, old_logp))[0]

    def weights_for_sync(self):
        """An ObjectRef to rank 0's payload (the other ranks take part in gathering it)."""
        refs = self._all("weights_for_sync")
        self._pending = refs[1:]
        return refs[0]

    def wait_sync(self) -> None:
        ray.get(getattr(self, "_pending", []))
        self._pending = []

    def save(self, path: str) -> None:
        ray.get(self._all("save", path))

    def write_readbacks(self, run_dir: str) -> None:
        ray.get(self._all("write_readback", run_dir))
