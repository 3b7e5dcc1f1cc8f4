"""The end-of-run summary: printed to the console and written to <run_dir>/summary.json."""
from __future__ import annotations

import json
from pathlib import Path

SUMMARY_FILE = "summary.json"
WINDOW = 5  # steps averaged at each end of the run for the reward trend


class RunSummary:
    def __init__(self, run_dir: Path, mode: str, planned_steps: int):
        self.run_dir, self.mode, self.planned_steps = run_dir, mode, planned_steps
        self.steps: list[dict] = []
        self.status, self.error = "running", None
        self.resumed_from: str | None = None  # the checkpoint trainer.resume started this run from

    def add(self, step: int, metrics: dict) -> None:
        self.steps.append({"step": step, **metrics})

    def _mean(self, key: str, rows: list[dict]) -> float | None:
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else None

    def as_dict(self) -> dict:
        s = self.steps
        return {
            "status": self.status, "error": self.error, "mode": self.mode, "run_dir": str(self.run_dir),
            "steps_completed": sum(1 for r in s if "train/loss" in r), "steps_planned": self.planned_steps,
            "reward_first5": self._mean("rollout/reward_mean", s[:WINDOW]),
            "reward_last5": self._mean("rollout/reward_mean", s[-WINDOW:]),
            "mismatch_total": sum(int(r["consistency/mismatch_count"]) for r in s),
            "numel_total": sum(int(r["consistency/numel"]) for r in s),
            "steps_with_mismatch": sum(1 for r in s if r["consistency/mismatch_count"]),
            "max_abs_diff": max((r["consistency/max_abs_diff"] for r in s), default=0.0),
            "step_s_mean": self._mean("perf/step_s", s),
            "resumed_from": self.resumed_from,
            "first_step": s[0]["step"] if s else None,
        }

    def finish(self, status: str, error: str | None = None) -> None:
        self.status, self.error = status, error
        (self.run_dir / SUMMARY_FILE).write_text(json.dumps(self.as_dict(), indent=2))

    def format(self) -> str:
        d = self.as_dict()

        def f(x):
            return "n/a" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x)

        lines = [f"lockstep run {d['status']} ({d['mode']} mode): {d['steps_completed']}/{d['steps_planned']} steps",
                 f"  reward        first {WINDOW}: {f(d['reward_first5'])}   last {WINDOW}: {f(d['reward_last5'])}",
                 f"  consistency   {d['mismatch_total']} mismatching of {d['numel_total']} logprobs "
                 f"({d['steps_with_mismatch']} steps with any), max |diff| {f(d['max_abs_diff'])}",
                 f"  time          {f(d['step_s_mean'])} s/step",
                 f"  run dir       {d['run_dir']}"]
        if d["resumed_from"]:
            lines.insert(1, f"  resumed       from {d['resumed_from']} (steps {d['first_step']}..)")
        if d["error"]:
            lines.insert(1, f"  error         {d['error']}")
        return "\n".join(lines)
