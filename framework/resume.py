"""Checkpoints a run can resume from, and resuming.

Layout: every `trainer.save_every` steps, and at its last step, the driver writes RUN_DIR/checkpoints/step-N/: the actor's
checkpoint (HF weights, the optimizer state, its step and weights version: actor.save), the
tokenizer, the prompt sampler's position (trainer_state.json) and the run's resolved config. It is
written under a temporary name after the step trains and renamed once the step's metrics are
logged, so a run killed in between resumes from the previous checkpoint and loses no step's line;
the newest `trainer.keep_checkpoints` are kept.

`trainer.resume=PATH` (a run dir, or one of its step-N dirs) starts the run at step N+1 from that
checkpoint, in this run's own dir, logging on into the checkpoint's W&B run (same run id). Everything else a step depends on is a function of the step
number and the seed (per-sample sampling seeds, the LR schedule from the optimizer's step count),
so steps N+1.. compute the same bits as an uninterrupted run. Config keys that change what the
steps compute must equal the checkpoint's; the error lists the ones that differ.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

STATE = "trainer_state.json"
CONFIG = "config.yaml"
# what may differ between a run and the run it resumes (how long, where to, how it is watched)
FREE = ("trainer.steps", "trainer.resume", "trainer.save_every", "trainer.keep_checkpoints", "trainer.save_final",
        "logger", "ray", "determinism.record_mismatch", "actor.num_cpus", "rollout.num_cpus")


def save(run_dir: Path, step: int, cfg: DictConfig, actor, tokenizer, prompts, tracker_run_id: str | None) -> Path:
    """Step `step`'s checkpoint under a temporary name (the actor must hold its weights: the driver
    calls this after training, before the weight sync offloads it); `commit` makes it the latest.
    tracker_run_id: the W&B run's id, which a resumed run logs on into."""
    tmp = run_dir / "checkpoints" / f".step-{step}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    actor.save(str(tmp))
    tokenizer.save(tmp)
    (tmp / CONFIG).write_text(OmegaConf.to_yaml(cfg, resolve=True))
    (tmp / STATE).write_text(json.dumps({"step": step, "prompts": prompts.state_dict(),
                                         "tracker_run_id": tracker_run_id}))
    return tmp


def commit(run_dir: Path, step: int, keep: int) -> Path:
    """Once step `step` is logged: its checkpoint becomes the latest (a run that dies before that
    resumes from the one before, and computes the step again), and only the newest `keep` stay."""
    root = run_dir / "checkpoints"
    final = root / f"step-{step}"
    shutil.rmtree(final, ignore_errors=True)
    (root / f".step-{step}.partial").rename(final)
    for old in sorted(_complete(root), key=_step)[:-max(1, keep)]:
        shutil.rmtree(old)
    return final


def _step(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def _complete(root: Path) -> list[Path]:
    return [p for p in root.glob("step-*") if (p / STATE).exists()] if root.is_dir() else []


def find(path: str) -> Path:
    """The checkpoint `trainer.resume` names: PATH itself if it is one, else PATH's latest."""
    p = Path(path).expanduser()
    if (p / STATE).exists():
        return p
    found = _complete(p / "checkpoints")
    if not found:
        raise FileNotFoundError(f"trainer.resume={path}: no checkpoint there (looked for {p / STATE} and "
                                f"{p / 'checkpoints'}/step-N/{STATE}); a run writes them with trainer.save_every=N")
    return max(found, key=_step)


def check(checkpoint: Path, cfg: DictConfig) -> dict:
    """The checkpoint's trainer state, once this run's config computes what the checkpoint's did."""
    saved = _flat(OmegaConf.to_container(OmegaConf.create((checkpoint / CONFIG).read_text()), resolve=True))
    now = _flat(OmegaConf.to_container(cfg, resolve=True))
    differ = sorted(k for k in saved.keys() | now.keys()
                    if saved.get(k) != now.get(k) and not any(k == f or k.startswith(f + ".") for f in FREE))
    if differ:
        rows = "; ".join(f"{k}: {saved.get(k)!r} in the checkpoint, {now.get(k)!r} now" for k in differ[:8])
        raise ValueError(f"trainer.resume: {checkpoint} was written with a different config ({len(differ)} key(s): "
                         f"{rows}); resume with the checkpoint's values (see {checkpoint / CONFIG})")
    state = json.loads((checkpoint / STATE).read_text())
    if state["step"] >= cfg.trainer.steps:
        raise ValueError(f"trainer.resume: {checkpoint} is at step {state['step']} and trainer.steps="
                         f"{cfg.trainer.steps}: nothing left to run (raise trainer.steps)")
    return state


def _flat(d, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
