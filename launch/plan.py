"""`lockstep plan RECIPE [--gpu-gib G] [KEY=VALUE ...]`: check a run's topology before it starts, and
print where every rank goes and what each GPU will hold. Needs no GPU (and no Ray).

Checks (each error names the knob): the actor's tp x cp x pp x dp ranks fill the node's GPUs
(recipe.gpus); engines x engine TP fill them too; on a colocated GPU the actor's and the engine's
fractions fit in one; tensor-parallel sizes divide the attention heads, the KV heads, the
intermediate size, lockstep's 8 canonical K chunks (row-parallel GEMMs) and 64 vocab chunks (the
logprob); pp is 1 (the megatron actor runs no pipeline parallelism). The memory estimate is per GPU:
actor parameters, fp32 gradients and the distributed optimizer's fp32 master weights and Adam moments
(sharded over dp x cp), activations at actor.max_tokens_per_gpu (34 bytes x hidden per token and
layer, Korthikanti et al. without recomputation or attention scores, split by tp and cp), and the
engine's weights and the KV cache its rollout batch needs at full length.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from omegaconf import DictConfig

from lockstep.kernels.logp import NUM_VOCAB_CHUNKS
from lockstep.kernels.rowlinear import NUM_K_CHUNKS

GIB = 2**30
PROMPT_TOKENS = 512  # the prompt length the estimates assume (the math prompts are shorter)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


class PlanError(ValueError):
    pass


@dataclass
class Plan:
    gpus: int
    placement: list[str]  # per GPU: what runs there
    memory: list[tuple[str, float]]  # (what, GiB per GPU)
    notes: list[str]


def compose(recipe: str, overrides: list[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from lockstep.launch.recipes import SEARCHPATH_OVERRIDE

    with initialize_config_module("lockstep.recipes", version_base="1.3"):
        return hydra_compose(recipe, overrides=[SEARCHPATH_OVERRIDE, *overrides])


def _shape(cfg: DictConfig) -> dict:
    from lockstep.framework import settings

    vocab = cfg.model.vocab_size
    shape = settings.model_config(cfg, vocab if isinstance(vocab, int) else 1024)
    return shape


def params_of(s: dict) -> int:
    h, i, L, d = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["head_dim"]
    attn = h * (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * d + s["num_attention_heads"] * d * h + 2 * d
    layer = attn + 3 * h * i + 2 * h
    return L * layer + s["vocab_size"] * h * (1 if s["tie_word_embeddings"] else 2) + h


def _divides(tp: int, knob: str, s: dict) -> list[str]:
    out = []
    for what, n in (("attention heads", s["num_attention_heads"]), ("KV heads", s["num_key_value_heads"]),
                    ("intermediate size", s["intermediate_size"]), ("canonical K chunks", NUM_K_CHUNKS),
                    ("vocab chunks", NUM_VOCAB_CHUNKS)):
        if n % tp:
            out.append(f"{knob}={tp} must divide the {what} ({n})")
    return out


def plan(cfg: DictConfig, gpu_gib: float) -> Plan:
    s = _shape(cfg)
    p, a, r = cfg.parallel, cfg.actor, cfg.rollout
    errors, notes = [], []
    on_gpu = p.device == "cuda"
    gpus = int((cfg.get("recipe") or {}).get("gpus", 1)) if on_gpu else 0
    actor_ranks = p.tp * p.cp * p.pp * p.dp
    if p.pp != 1:
        errors.append(f"parallel.pp={p.pp}: the megatron actor runs without pipeline parallelism (parallel.pp=1)")
    if a.backend == "native" and actor_ranks != 1:
        errors.append(f"parallel.tp x cp x pp x dp = {actor_ranks}: the native actor runs one rank (actor=megatron shards)")
    errors += _divides(p.tp, "parallel.tp", s)
    e_tp, engines = r.tensor_parallel_size, r.num_engines
    errors += _divides(e_tp, "rollout.tensor_parallel_size", s)
    if on_gpu:
        if actor_ranks * a.num_gpus > gpus + 1e-9 or (p.colocate and actor_ranks != gpus):
            errors.append(f"the actor's parallel.tp x cp x pp x dp = {p.tp} x {p.cp} x {p.pp} x {p.dp} = {actor_ranks} ranks "
                          f"do not fill the node's recipe.gpus={gpus} GPUs (one rank per GPU when colocated)")
        if engines * e_tp != gpus:
            errors.append(f"rollout.num_engines x rollout.tensor_parallel_size = {engines} x {e_tp} = {engines * e_tp} "
                          f"engine ranks, but the node has recipe.gpus={gpus} GPUs")
        per_rank = r.num_gpus / e_tp
        if p.colocate and a.num_gpus + per_rank > 1 + 1e-9:
            errors.append(f"a colocated GPU holds actor.num_gpus={a.num_gpus} + rollout.num_gpus/tensor_parallel_size="
                          f"{per_rank:g}: more than one GPU")
    if errors:
        raise PlanError("; ".join(errors))
    if r.backend == "vllm" and e_tp > 1:
        notes.append("NOT RUNNABLE YET: lockstep kernels inside vLLM need rollout.tensor_parallel_size=1 (`lockstep run` "
                     "refuses a vLLM engine of TP > 1 in lockstep modes); rollout=native runs TP engines today")
    placement = []
    for g in range(max(gpus, 1)):
        tp_r, rest = g % p.tp, g // p.tp
        cp_r, dp_r = rest % p.cp, rest // p.cp
        actor = f"actor rank {g} (tp {tp_r}, cp {cp_r}, dp {dp_r})" if g < actor_ranks else "-"
        engine = f"engine {g // e_tp} rank {g % e_tp}" if g < engines * e_tp else "-"
        placement.append(f"GPU {g}: {actor}; {engine}" if on_gpu else f"CPU: {actor}; {engine}")
    n = params_of(s)
    w = DTYPE_BYTES[cfg.model.dtype]
    shard = n / p.tp
    opt_shard = p.dp * p.cp
    batch_tokens = r.prompts_per_step * r.n_samples * (r.max_new_tokens + PROMPT_TOKENS) / cfg.algo.num_minibatches
    # both actors cut micro-batches at max_tokens_per_gpu, one backward each
    budget = min(a.max_tokens_per_gpu, batch_tokens)
    tokens = budget / p.cp
    act = 34 * tokens * s["hidden_size"] * s["num_hidden_layers"] / p.tp
    per_engine_tokens = -(-r.prompts_per_step // engines) * r.n_samples * (r.max_new_tokens + PROMPT_TOKENS)
    kv = per_engine_tokens * 2 * (s["num_key_value_heads"] // e_tp) * s["head_dim"] * s["num_hidden_layers"] * w
    memory = [("actor parameters", shard * w / GIB), ("actor gradients (fp32)", shard * 4 / GIB),
              ("optimizer: fp32 master + Adam moments (sharded over dp x cp)", shard * 12 / opt_shard / GIB),
              (f"activations at {int(budget)} tokens per GPU", act / GIB),
              ("engine weights", n / e_tp * w / GIB), ("engine KV cache for the rollout batch at full length", kv / GIB)]
    notes.append(f"{n / 1e9:.2f}B parameters; a colocated GPU holds the engine while the actor is offloaded "
                 f"(actor.offload) and the actor while the engine sleeps")
    if on_gpu:
        train = sum(m for k, m in memory[:4])
        rollout = memory[4][1] + memory[5][1] + (memory[0][1] if not p.colocate else 0)
        notes.append(f"per GPU: training {train:.1f} GiB, rollout {rollout:.1f} GiB of {gpu_gib:g} GiB "
                     f"(vLLM takes rollout.gpu_memory_utilization={r.get('gpu_memory_utilization', 'n/a')} of it)")
        if max(train, rollout) > gpu_gib:
            notes.append("DOES NOT FIT: lower actor.max_tokens_per_gpu, raise parallel.tp/cp, or shorten the rollout")
    return Plan(gpus, placement, memory, notes)


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="lockstep plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU (default 80: H100; 141: H200)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    from lockstep.launch.overrides import BadOverride, check_overrides
    from lockstep.launch.recipes import UnknownRecipe, check_recipe

    try:
        check_recipe(args.recipe)
        check_overrides(args.recipe, args.overrides)
        cfg = compose(args.recipe, args.overrides)
        result = plan(cfg, args.gpu_gib)
    except (UnknownRecipe, BadOverride, PlanError, ValueError) as e:
        print(f"lockstep plan: {e}", file=sys.stderr)
        return 2
    print(f"{args.recipe}: {result.gpus} GPU(s)" if result.gpus else f"{args.recipe}: CPU")
    print("\nplacement:")
    print("\n".join(f"  {line}" for line in result.placement))
    print("\nmemory per GPU (GiB):" if result.gpus else "\nmemory (GiB):")
    print("\n".join(f"  {gib:8.2f}  {what}" for what, gib in result.memory))
    print("\n" + "\n".join(result.notes))
    return 0
