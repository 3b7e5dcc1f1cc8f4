"""Start the actor and the rollout engine as Ray actors on their placement bundles, picking the
backend classes by config name."""
from __future__ import annotations

import ray
from omegaconf import DictConfig, OmegaConf

from lockstep.framework.placement import Placement, Resources
from lockstep.framework.registry import BackendRegistry

ACTORS = BackendRegistry("actor", {"native": "lockstep.framework.actor.native:NativeActor"})
ROLLOUTS = BackendRegistry("rollout", {"native": "lockstep.framework.rollout.native:NativeRolloutEngine"})


def spawn_actor(cfg: DictConfig, placement: Placement, model_config: dict, tokenizer):
    cls = ACTORS.get(cfg.actor.backend)
    a = cfg.actor
    optim = {k: a[k] for k in ("lr", "betas", "eps", "weight_decay", "warmup_steps", "grad_clip")}
    algo = {k: v for k, v in OmegaConf.to_container(cfg.algo, resolve=True).items() if k != "name"}
    return ray.remote(cls).options(**placement.options(placement.actor_bundle, Resources(a.num_cpus))).remote(
        model_config, determinism=_determinism(cfg), real_vocab_size=tokenizer.vocab_size,
        optim=OmegaConf.to_container(OmegaConf.create(optim), resolve=True), algo=algo, seed=cfg.seed,
        init_from=cfg.model.init_from, num_threads=a.num_cpus)


def spawn_rollout(cfg: DictConfig, placement: Placement, model_config: dict, tokenizer):
    cls = ROLLOUTS.get(cfg.rollout.backend)
    r = cfg.rollout
    return ray.remote(cls).options(**placement.options(placement.rollout_bundle, Resources(r.num_cpus))).remote(
        model_config, determinism=_determinism(cfg), real_vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, num_threads=r.num_cpus)


def _determinism(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg.determinism, resolve=True)
