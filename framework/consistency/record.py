"""The evidence of a mismatching step, saved for `lockstep bisect` (determinism.record_mismatch).

RUN_DIR/bisect/step-N/ holds the step's rollout (tokens, prompt and response lengths, the
rollout's logprobs and top-p/top-k supports, sampling parameters), the trainer's recomputed
logprobs, and the weights both sides computed with (an HF directory: the rollout was generated
with the weights the actor holds before it trains on it, verified by the weight sync's checksums).
Only the first mismatching step of a run is saved.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lockstep.framework.rollout.base import Rollout, SamplingParams

RECORD_DIR = "bisect"
ROLLOUT_FILE, META_FILE, WEIGHTS_DIR = "rollout.pt", "record.json", "weights"
_TENSORS = ("tokens", "prompt_lens", "response_lens", "logp", "support_ids", "finished")


@dataclass
class Record:
    step: int
    rollout: Rollout
    trainer_logp: torch.Tensor  # [B, R]
    mismatching_samples: list[int]
    real_vocab_size: int
    weights: Path  # HF directory


def record_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / RECORD_DIR / f"step-{step}"


def recorded_steps(run_dir: str | Path) -> list[int]:
    root = Path(run_dir) / RECORD_DIR
    return sorted(int(p.name.split("-", 1)[1]) for p in root.glob("step-*") if (p / META_FILE).exists())


def write_record(run_dir: str | Path, step: int, rollout: Rollout, trainer_logp: torch.Tensor,
                 save_weights, real_vocab_size: int) -> Path:
    """save_weights(path): writes the weights as an HF directory (the actor's save_weights)."""
    out = record_dir(run_dir, step)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({**{k: getattr(rollout, k) for k in _TENSORS}, "weights_version": rollout.weights_version,
                "sampling": asdict(rollout.sampling), "trainer_logp": trainer_logp.cpu()}, out / ROLLOUT_FILE)
    save_weights(str(out / WEIGHTS_DIR))
    mask = rollout.response_mask()
    differs = (rollout.logp.float().view(torch.int32) != trainer_logp.float().cpu().view(torch.int32)) & mask
    samples = differs.any(1).nonzero()[:, 0].tolist()
    (out / META_FILE).write_text(json.dumps({"step": step, "mismatching_samples": samples,
                                             "real_vocab_size": real_vocab_size}, indent=1))
    return out


def read_record(run_dir: str | Path, step: int) -> Record:
    d = record_dir(run_dir, step)
    if not (d / META_FILE).exists():
        have = recorded_steps(run_dir)
        raise FileNotFoundError(f"{d}: no record of step {step}; recorded: {have or 'none'} (a run records its first "
                                f"mismatching step when determinism.record_mismatch=true)")
    meta = json.loads((d / META_FILE).read_text())
    saved = torch.load(d / ROLLOUT_FILE, weights_only=True)
    rollout = Rollout(*(saved[k] for k in _TENSORS), saved["weights_version"], SamplingParams(**saved["sampling"]))
    return Record(meta["step"], rollout, saved["trainer_logp"], meta["mismatching_samples"], meta["real_vocab_size"],
                  d / WEIGHTS_DIR)
