"""Ray placement: one placement group holding the actor and the rollout engines.

colocate=true puts them all on one bundle (they time-share its CPUs/GPUs, as in production where
engines sleep while actors train); colocate=false gives the actor and each engine its own bundle.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

PLACEMENT_TIMEOUT_S = 60


def rendezvous_address() -> tuple[str, int]:
    """This host's address and a free port: where the ranks of a process group (an actor's, a
    tensor-parallel engine's) meet; asked of rank 0, then every rank joins."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return socket.gethostbyname(socket.gethostname()), port


@dataclass(frozen=True)
class Resources:
    num_cpus: float  # a Ray scheduling resource (fractions pack several workers on one core); the
    num_gpus: float = 0.0  # torch thread count of a worker is its own knob (num_threads)


@dataclass(frozen=True)
class Placement:
    group: object
    actor_bundle: int
    rollout_bundles: tuple[int, ...]

    def options(self, bundle: int, res: Resources) -> dict:
        return {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle)}


@contextmanager
def placed(actor: Resources, rollout: Resources, colocate: bool, num_engines: int = 1, actor_workers: int = 1,
           engine_workers: int = 1):
    """actor: resources of one actor rank (actor_workers of them); rollout: of one engine rank
    (engine_workers per engine)."""
    per_engine = {"CPU": engine_workers * rollout.num_cpus, "GPU": engine_workers * rollout.num_gpus}
    if colocate:
        bundles = [{"CPU": actor_workers * actor.num_cpus + num_engines * per_engine["CPU"],
                    "GPU": actor_workers * actor.num_gpus + num_engines * per_engine["GPU"]}]
    else:
        bundles = [{"CPU": actor_workers * actor.num_cpus, "GPU": actor_workers * actor.num_gpus}] + \
                  [per_engine] * num_engines
    bundles = [{k: v for k, v in b.items() if v} for b in bundles]
    group = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(f"placement group {bundles} could not be placed within {PLACEMENT_TIMEOUT_S} s; "
                           f"the Ray cluster has {ray.cluster_resources()}")
    try:
        yield Placement(group, 0, tuple([0] * num_engines if colocate else range(1, num_engines + 1)))
    finally:
        remove_placement_group(group)
