"""Start the actor and the rollout engines as Ray actors on their placement bundles, picking the
backend classes by config name (an unknown or unavailable backend lists every valid one)."""
from __future__ import annotations

import ray
from omegaconf import DictConfig, OmegaConf

from lockstep.framework.actor.group import ActorGroup
from lockstep.framework.placement import Placement, Resources
from lockstep.framework.registry import BackendRegistry
from lockstep.framework.rollout.fleet import RolloutFleet
from lockstep.framework.weights.transport import choose

ACTORS = BackendRegistry("actor", {"native": "lockstep.framework.actor.native:NativeActor",
                                   "megatron": "lockstep.framework.actor.megatron.worker:MegatronActor"})
ROLLOUTS = BackendRegistry("rollout", {"native": "lockstep.framework.rollout.native:NativeRolloutEngine",
                                       "vllm": "lockstep.framework.rollout.vllm_engine:VllmRolloutEngine"})


def _determinism(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg.determinism, resolve=True)


def actor_world_size(cfg: DictConfig) -> int:
    p = cfg.parallel
    return p.tp * p.cp * p.pp * p.dp


def spawn_actor(cfg: DictConfig, placement: Placement, model_config: dict, tokenizer) -> ActorGroup:
    cls = ACTORS.get(cfg.actor.backend)
    a = cfg.actor
    optim = {k: a[k] for k in ("lr", "betas", "eps", "weight_decay", "warmup_steps", "grad_clip")}
    weights = {"bucket_mb": cfg.weights.bucket_mb,
               "transport": choose(cfg.weights.transport, cfg.parallel.device, cfg.parallel.colocate)}
    common = dict(determinism=_determinism(cfg), real_vocab_size=tokenizer.vocab_size, weights=weights,
                  optim=OmegaConf.to_container(OmegaConf.create(optim), resolve=True),
                  algo={k: v for k, v in OmegaConf.to_container(cfg.algo, resolve=True).items() if k != "name"},
                  seed=cfg.seed, init_from=cfg.model.init_from, num_threads=a.num_threads, dtype=cfg.model.dtype,
                  max_tokens_per_gpu=a.max_tokens_per_gpu, pack_sequences=a.pack_sequences)
    resources = placement.options(placement.actor_bundle, Resources(a.num_cpus, a.num_gpus))
    if a.backend == "native":
        return ActorGroup([ray.remote(cls).options(**resources).remote(model_config, device=cfg.parallel.device, **common)])
    world = actor_world_size(cfg)
    parallel = OmegaConf.to_container(cfg.parallel, resolve=True)
    workers = [ray.remote(cls).options(**resources).remote(
        model_config, parallel=parallel, rank=r, world_size=world, **common)
        for r in range(world)]
    address, port = ray.get(workers[0].rendezvous.remote())  # rank 0 hosts the process-group rendezvous
    ray.get([w.setup.remote(address, port) for w in workers])
    return ActorGroup(workers)


def engine_ranks(cfg: DictConfig) -> int:
    """Ray actors per engine: a native engine runs one per tensor-parallel rank (vLLM spawns its own)."""
    return cfg.rollout.tensor_parallel_size if cfg.rollout.backend == "native" else 1


def _engine_kwargs(cfg: DictConfig, index: int) -> dict:
    r = cfg.rollout
    if r.backend == "native":
        return {"engine_index": index, "device": cfg.parallel.device, "dtype": cfg.model.dtype,
                "tensor_parallel_size": r.tensor_parallel_size}
    per_engine = -(-r.prompts_per_step // r.num_engines) * r.n_samples
    return {"engine_index": index, "tensor_parallel_size": r.tensor_parallel_size, "max_support": r.max_support,
            "max_batch": per_engine, "gpu_memory_utilization": r.gpu_memory_utilization,
            "kv_cache_gib": r.kv_cache_gib, "seed": cfg.seed, "dtype": cfg.model.dtype,
            "enforce_eager": r.enforce_eager}


def spawn_rollouts(cfg: DictConfig, placement: Placement, model_config: dict, tokenizer) -> RolloutFleet:
    cls = ROLLOUTS.get(cfg.rollout.backend)
    r, ranks = cfg.rollout, engine_ranks(cfg)
    engines = []
    for i, bundle in enumerate(placement.rollout_bundles):
        workers = [ray.remote(cls).options(**placement.options(bundle, Resources(r.num_cpus, r.num_gpus))).remote(
            model_config, determinism=_determinism(cfg), real_vocab_size=tokenizer.vocab_size,
            eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id, num_threads=r.num_threads,
            **_engine_kwargs(cfg, i), **({"rank": k} if r.backend == "native" else {})) for k in range(ranks)]
        if ranks > 1:  # rank 0 hosts the engine's process-group rendezvous
            address, port = ray.get(workers[0].rendezvous.remote())
            ray.get([w.setup.remote(address, port) for w in workers])
        engines.append(workers)
    return RolloutFleet(engines, tokenizer.pad_id)
