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

    def sync_plan(self) -> int:
        return ray.get(self._all("sync_plan"))[0]

    def sync_bucket(self, phase: str, index: int):
        """An ObjectRef to rank 0's bucket, resolved by the engines (never fetched here); the other
        ranks have done their part (gathering shards) when this returns."""
        refs = self._all("sync_bucket", phase, index)
        ray.get(refs[1:])
        return refs[0]

    def sync_done(self) -> None:
        ray.get(self._all("sync_done"))

    def offload(self) -> dict:
        return ray.get(self._all("offload"))[0]

    def reload(self) -> dict:
        return ray.get(self._all("reload"))[0]

    def memory(self) -> dict:
        return ray.get(self.workers[0].memory.remote())

    def save(self, path: str) -> None:
        ray.get(self._all("save", path))

    def load(self, path: str) -> None:
        ray.get(self._all("load", path))

    def save_weights(self, path: str) -> None:
        ray.get(self._all("save_weights", path))

    def write_readbacks(self, run_dir: str) -> None:
        ray.get(self._all("write_readback", run_dir))
