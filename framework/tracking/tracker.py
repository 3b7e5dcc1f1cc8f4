"""Fan-out of per-step metrics to JSONL, W&B and the console progress bar."""
from __future__ import annotations

import sys
from pathlib import Path

from tqdm import tqdm

from lockstep.framework.tracking.jsonl import JsonlWriter

METRICS_FILE = "metrics.jsonl"
WORST_TOKENS_FILE = "worst_tokens.jsonl"


class Tracker:
    def __init__(self, run_dir: Path, logger_cfg: dict, run_config: dict, total_steps: int, name: str,
                 run_id: str | None = None):
        self.metrics = JsonlWriter(run_dir / METRICS_FILE)
        self.worst = JsonlWriter(run_dir / WORST_TOKENS_FILE)
        self.wandb = None
        if logger_cfg["wandb"]["enabled"]:
            from lockstep.framework.tracking.wandb_logger import WandbLogger

            self.wandb = WandbLogger(run_dir, logger_cfg["wandb"], run_config, name, run_id)
        self.bar = tqdm(total=total_steps, desc=name, unit="step", file=sys.stderr, dynamic_ncols=True,
                        disable=not logger_cfg["progress"])

    @property
    def run_id(self) -> str | None:
        """The W&B run's id (None without W&B): a resumed run continues it."""
        return self.wandb.run.id if self.wandb else None

    def log_step(self, step: int, metrics: dict, worst_tokens: list[dict]) -> None:
        self.metrics.write({"step": step, **metrics})
        for row in worst_tokens:
            self.worst.write({"step": step, **row})
        if self.wandb:
            self.wandb.log(metrics, step)
            self.wandb.log_worst_tokens(worst_tokens, step)
        self.bar.set_postfix(reward=f"{metrics.get('rollout/reward_mean', float('nan')):.3f}",
                             mismatch=int(metrics.get("consistency/mismatch_count", -1)), refresh=False)
        self.bar.update(1)

    def close(self, ok: bool) -> None:
        self.bar.close()
        self.metrics.close()
        self.worst.close()
        if self.wandb:
            self.wandb.finish(0 if ok else 1)
