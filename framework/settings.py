"""Checks on a composed run config that Hydra's schema cannot express, with errors that name the
valid choices, and the derived values (model shape from the tokenizer) both workers need."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

ON_MISMATCH = ("auto", "stop", "report")
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    pass


def _choice(value, valid, key: str):
    if value not in valid:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(map(str, valid))}")


def _check_stock_ops(cfg: DictConfig) -> None:
    from lockstep.framework.models.ops import SIDES, Selection

    stock = cfg.determinism.get("stock_ops") or {}
    extra = sorted(set(stock) - set(SIDES))
    if extra:
        raise ConfigError(f"determinism.stock_ops.{extra[0]}: not a side; valid: {', '.join(SIDES)}")
    for side in SIDES:
        try:
            Selection.for_side(OmegaConf.to_container(cfg.determinism, resolve=True), side)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.rollout.backend == "vllm" and "attention.attention" in (stock.get("rollout") or ()):
        raise ConfigError("determinism.stock_ops.rollout=[attention.attention] with rollout=vllm: vLLM's attention "
                          "core is its attention backend (the paged op); determinism.attention=0 picks vLLM's own")


def validate(cfg: DictConfig) -> None:
    from lockstep.framework.models.ops import CASES
    from lockstep.framework.provider.route import MODES
    from lockstep.framework.rollout.faults import FAULTS

    det = cfg.determinism
    if (cfg.get("recipe") or {}).get("needs_checkpoint") and not cfg.model.init_from:
        raise ConfigError("this recipe starts from a checkpoint: set model.init_from=DIR (an HF Qwen3 directory; "
                          "`lockstep init-model --like <model> --out DIR` writes a random-init one)")
    _choice(det.mode, MODES, "determinism.mode")
    _choice(det.case, CASES, "determinism.case")
    for module in ("attention", "ffn", "logp"):
        _choice(det[module], (0, 1), f"determinism.{module}")
    _choice(det.on_mismatch, ON_MISMATCH, "determinism.on_mismatch")
    _choice(det.inject_fault, FAULTS, "determinism.inject_fault")
    _check_stock_ops(cfg)
    _choice(cfg.parallel.device, DEVICES, "parallel.device")
    _choice(cfg.model.dtype, DTYPES, "model.dtype")
    if cfg.actor.backend == "megatron" and cfg.parallel.pp != 1:
        raise ConfigError(f"parallel.pp={cfg.parallel.pp}: the megatron actor runs without pipeline parallelism for now")
    if cfg.parallel.device == "cpu" and (cfg.actor.num_gpus or cfg.rollout.num_gpus):
        raise ConfigError("parallel.device=cpu with actor/rollout num_gpus > 0: set parallel.device=cuda")
    for key in ("tp", "cp", "pp", "dp"):  # the actor's parallelism; engines set their own
        if cfg.parallel[key] != 1 and cfg.actor.backend == "native":
            raise ConfigError(f"parallel.{key}={cfg.parallel[key]}: the native actor runs unsharded "
                              f"(parallel.{key}=1)")
    if cfg.actor.pack_sequences and cfg.parallel.cp > 1:
        raise ConfigError(f"actor.pack_sequences=true with parallel.cp={cfg.parallel.cp}: packed sequences run "
                          "without context parallelism (set parallel.cp=1 or actor.pack_sequences=false)")
    if not (isinstance(cfg.actor.max_tokens_per_gpu, int) and cfg.actor.max_tokens_per_gpu >= 1):
        raise ConfigError(f"actor.max_tokens_per_gpu must be an int >= 1, got {cfg.actor.max_tokens_per_gpu!r}")
    from lockstep.framework.weights.transport import TRANSPORTS, choose

    _choice(cfg.weights.transport, TRANSPORTS, "weights.transport")
    try:
        choose(cfg.weights.transport, cfg.parallel.device, cfg.parallel.colocate)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not cfg.weights.bucket_mb > 0:
        raise ConfigError(f"weights.bucket_mb must be > 0, got {cfg.weights.bucket_mb}")
    for role in ("actor", "rollout"):
        if not cfg[role].num_cpus > 0:
            raise ConfigError(f"{role}.num_cpus must be > 0 (a Ray resource; fractions share a core), got {cfg[role].num_cpus}")
        if not isinstance(cfg[role].num_threads, int) or cfg[role].num_threads < 1:
            raise ConfigError(f"{role}.num_threads must be an int >= 1 (torch threads), got {cfg[role].num_threads!r}")
    if cfg.rollout.backend == "native":
        _choice(cfg.rollout.tensor_parallel_size, (1, 2, 4, 8), "rollout.tensor_parallel_size")
    if cfg.rollout.num_engines < 1:
        raise ConfigError(f"rollout.num_engines must be >= 1, got {cfg.rollout.num_engines}")
    if cfg.rollout.backend == "vllm":
        _choice(cfg.rollout.enforce_eager, ("auto", True, False), "rollout.enforce_eager")
        from lockstep.framework.models.ops import Selection

        tp = cfg.rollout.tensor_parallel_size
        if tp > 1 and Selection.for_side(OmegaConf.to_container(det, resolve=True), "rollout").any:
            raise ConfigError(f"rollout.tensor_parallel_size={tp} with rollout=vllm: lockstep's kernels run in "
                              "unsharded vLLM engines only for now (a sharded R module needs lockstep's fixed-order "
                              "TP reduction inside vLLM); use rollout.tensor_parallel_size=1 with more "
                              "rollout.num_engines, rollout=native (TP engines), or determinism=off")
    if cfg.trainer.steps < 1:
        raise ConfigError(f"trainer.steps must be >= 1, got {cfg.trainer.steps}")
    if cfg.trainer.save_every < 0 or cfg.trainer.keep_checkpoints < 1:
        raise ConfigError(f"trainer.save_every must be >= 0 (0: no checkpoints to resume from) and "
                          f"trainer.keep_checkpoints >= 1, got {cfg.trainer.save_every} and {cfg.trainer.keep_checkpoints}")
    if cfg.rollout.prompts_per_step < 1:
        raise ConfigError(f"rollout.prompts_per_step must be >= 1, got {cfg.rollout.prompts_per_step}")
    if cfg.algo.name == "grpo":
        from lockstep.framework.algo.grpo import GRPOConfig

        try:
            GRPOConfig(**{k: v for k, v in OmegaConf.to_container(cfg.algo, resolve=True).items() if k != "name"})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"algo: {e}") from None
    if cfg.algo.name == "grpo" and cfg.rollout.n_samples < 2:
        raise ConfigError(f"rollout.n_samples={cfg.rollout.n_samples}: GRPO normalises rewards within "
                          f"each prompt's group, so it needs n_samples >= 2")


def _explicit_model_keys(overrides) -> set[str]:
    keys = set()
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key.startswith("model."):
            keys.add(key[len("model."):])
    return keys


def model_config(cfg: DictConfig, tokenizer_vocab: int, overrides=()) -> dict:
    """The Qwen3Config fields for this run. From a checkpoint (model.init_from) its config.json
    defines the shape (over the model group's defaults); a shape given on the command line that
    contradicts it is an error naming both. Else the group's shape, vocab_size=auto padding the
    tokenizer's vocab."""
    from lockstep.framework.models.hf import CheckpointError
    from lockstep.framework.models.qwen3 import SHAPE_KEYS, Qwen3Config

    m = OmegaConf.to_container(cfg.model, resolve=True)
    if m["init_from"]:
        try:
            shape = asdict(Qwen3Config.from_dir(m["init_from"]))
        except CheckpointError as e:
            raise ConfigError(f"model.init_from: {e}") from None
        conflicts = [f"model.{k}={m[k]!r} (command line) vs {k}={shape[k]!r} in {Path(m['init_from']) / 'config.json'}"
                     for k in sorted(_explicit_model_keys(overrides) & set(SHAPE_KEYS))
                     if m.get(k) is not None and m[k] != "auto" and m[k] != shape[k]]
        if conflicts:
            raise ConfigError("the checkpoint's shape and an explicit override disagree: " + "; ".join(conflicts))
        if shape["vocab_size"] < tokenizer_vocab:
            raise ConfigError(f"model.init_from={m['init_from']}: config.json vocab_size {shape['vocab_size']} < "
                              f"the tokenizer's {tokenizer_vocab} tokens")
        return shape
    vocab = m.pop("vocab_size")
    multiple = m.pop("pad_vocab_multiple")
    for key in ("init_from", "dtype"):
        m.pop(key)
    if vocab == "auto":
        vocab = -(-tokenizer_vocab // multiple) * multiple
    elif not isinstance(vocab, int) or vocab < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size={vocab!r} must be 'auto' or an int >= the tokenizer's "
                          f"{tokenizer_vocab} tokens")
    return {"vocab_size": vocab, **m}


def stops_on_mismatch(cfg: DictConfig) -> bool:
    policy = cfg.determinism.on_mismatch
    return cfg.determinism.mode in ("strict", "audit") if policy == "auto" else policy == "stop"
