"""Synthetic tasks shipped with lockstep, small enough for a random-init tiny model to learn by RL.

`digit_sum`: prompts "a+b=" with single digits a, b and a + b <= 9; the label is the sum. A random
policy scores a few percent (its last emitted number rarely equals the sum); learning to emit one
digit and stop, then the right digit, raises the reward measurably within tens of steps.

Regenerate the shipped file with `python -m lockstep.framework.data.synthetic` (deterministic).
"""
from __future__ import annotations

import json
from pathlib import Path

TASKS_DIR = Path(__file__).parent / "tasks"


def digit_sum_records() -> list[dict]:
    return [{"prompt": f"{a}+{b}=", "label": str(a + b)}
            for a in range(10) for b in range(10) if a + b <= 9]


TASKS = {"digit_sum": digit_sum_records}


def task_path(name: str) -> Path:
    """builtin:<name>: a generated task (TASKS) or a file shipped in tasks/ (math_sample: 40
    hand-written problems in the dapo-math-17k layout, answers in reward_model.ground_truth)."""
    path = TASKS_DIR / f"{name}.jsonl"
    if name not in TASKS and not path.exists():
        valid = sorted(set(TASKS) | {p.stem for p in TASKS_DIR.glob("*.jsonl")})
        raise ValueError(f"unknown builtin task {name!r}; valid: {', '.join(valid)}")
    return path


def render(name: str) -> str:
    return "".join(json.dumps(r) + "\n" for r in TASKS[name]())


def main() -> None:
    TASKS_DIR.mkdir(exist_ok=True)
    for name in TASKS:
        task_path(name).write_text(render(name))
        print(f"wrote {task_path(name)}")


if __name__ == "__main__":
    main()
