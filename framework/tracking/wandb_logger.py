"""W&B logging, offline by default (files under <run_dir>/wandb; `wandb sync` uploads later)."""
from __future__ import annotations

import os
from pathlib import Path

MODES = ("offline", "online", "disabled")


class WandbLogger:
    def __init__(self, run_dir: Path, cfg: dict, run_config: dict, name: str, run_id: str | None = None):
        """run_id: continue that run (a resumed lockstep run), else start a new one."""
        if cfg["mode"] not in MODES:
            raise ValueError(f"logger.wandb.mode={cfg['mode']!r}; valid: {', '.join(MODES)}")
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self._wandb = wandb
        self.run = wandb.init(project=cfg["project"], entity=cfg.get("entity"), name=name, mode=cfg["mode"],
                              dir=str(run_dir), config=run_config, tags=list(cfg.get("tags") or []),
                              id=run_id, resume="allow" if run_id else None,
                              settings=wandb.Settings(console="off", x_disable_stats=True))

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def log_worst_tokens(self, rows: list[dict], step: int) -> None:
        if rows:
            cols = list(rows[0])
            table = self._wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in rows])
            self.run.log({"consistency/worst_tokens": table}, step=step)

    def finish(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)
