"""The 1-GPU recipe end to end in both determinism modes, side by side (one process, one GPU).

    python benchmarks/e2e_1gpu.py OUT_DIR [extra hydra overrides]

Runs `qwen3-1.7b-1gpu` with determinism.mode=strict and =off, then prints (and writes to
OUT_DIR/e2e_1gpu.md) per-mode timings and the mismatch of every step. Step 1 carries start-up
costs (compilation, allocator warm-up), so means are over steps 2.. when there are several.
"""
from __future__ import annotations

import sys
from pathlib import Path

from lockstep.framework.tracking.jsonl import read_jsonl
from lockstep.launch import cli

RECIPE = "qwen3-1.7b-1gpu"
TIMES = ["perf/step_s", "perf/rollout_s", "perf/logp_s", "perf/train_s", "perf/weight_sync_s"]


def run_mode(out: Path, mode: str, extra: list[str]) -> list[dict]:
    run_dir = out / mode
    rc = cli.main(["run", RECIPE, f"determinism.mode={mode}", f"hydra.run.dir={run_dir}", "logger.progress=false", *extra])
    rows = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    if rc != 0:
        print(f"{mode}: run failed (rc={rc}); see {run_dir}/lockstep.log", file=sys.stderr)
    return rows


def summarize(mode: str, rows: list[dict]) -> list:
    steady = rows[1:] if len(rows) > 1 else rows
    means = [sum(r.get(k, float("nan")) for r in steady) / max(1, len(steady)) for k in TIMES]
    mism = ",".join(str(int(r["consistency/mismatch_count"])) for r in rows)
    numel = sum(int(r["consistency/numel"]) for r in rows)
    return [mode, len(rows), mism, numel, *means]


def main() -> None:
    out = Path(sys.argv[1])
    extra = sys.argv[2:]
    table = [summarize(mode, run_mode(out, mode, extra)) for mode in ("strict", "off")]
    cols = ["mode", "steps", "mismatch per step", "logprobs", "step s", "rollout s", "logp s", "train s", "sync s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in table:
        lines.append("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r) + " |")
    if len(table) == 2 and table[1][4]:
        lines.append(f"\nstrict / off step time: {table[0][4] / table[1][4]:.2f}x "
                     f"(train {table[0][7] / table[1][7]:.2f}x, logp {table[0][6] / table[1][6]:.2f}x)")
    text = "\n".join(lines) + "\n"
    (out / "e2e_1gpu.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
