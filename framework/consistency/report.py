"""`lockstep report SWEEP_DIR`: the module-ablation table of a multirun sweep (markdown and CSV)."""
from __future__ import annotations

import csv
import io
from pathlib import Path

import yaml

from lockstep.framework.consistency.validate import validate_run
from lockstep.framework.tracking.jsonl import read_jsonl
from lockstep.framework.tracking.tracker import METRICS_FILE

COLUMNS = ["group", "case", "attention", "ffn", "logp", "status", "mean_abs_dlogp", "max_abs_dlogp",
           "mismatch_rate", "k3_kl", "tok_per_s", "step_s"]


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def arm_row(run_dir: Path) -> dict:
    det = yaml.safe_load((run_dir / "config.yaml").read_text())["determinism"]
    rows = read_jsonl(run_dir / METRICS_FILE) if (run_dir / METRICS_FILE).exists() else []
    ok, gates = validate_run(run_dir)
    status = "COMPLETE" if ok else "refused: " + ", ".join(g.name for g in gates if not g.ok)
    numel = sum(r["consistency/numel"] for r in rows)
    flags = [int(det[m]) for m in ("attention", "ffn", "logp")]
    return {"group": "M" + "".join(map(str, flags)) if det["mode"] != "off" else "off", "case": det["case"],
            "attention": flags[0], "ffn": flags[1], "logp": flags[2], "status": status,
            "mean_abs_dlogp": _mean([r["consistency/mean_abs_diff"] for r in rows]),
            "max_abs_dlogp": max((r["consistency/max_abs_diff"] for r in rows), default=float("nan")),
            "mismatch_rate": sum(r["consistency/mismatch_count"] for r in rows) / numel if numel else float("nan"),
            "k3_kl": _mean([r["consistency/k3_kl"] for r in rows]),
            "tok_per_s": _mean([r["rollout/tok_per_s_per_gpu"] for r in rows]),
            "step_s": _mean([r["perf/step_s"] for r in rows if "perf/step_s" in r]),
            "run_dir": str(run_dir)}


def sweep_rows(sweep_dir: str | Path) -> list[dict]:
    runs = sorted(p.parent for p in Path(sweep_dir).glob("*/config.yaml"))
    if not runs:
        raise FileNotFoundError(f"{sweep_dir} holds no runs (no */config.yaml)")
    return sorted((arm_row(r) for r in runs), key=lambda r: (r["case"], r["group"]))


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def to_markdown(rows: list[dict]) -> str:
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    return head + "".join("| " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |\n" for r in rows)


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS + ["run_dir"])
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def write_report(sweep_dir: str | Path) -> str:
    rows = sweep_rows(sweep_dir)
    md = to_markdown(rows)
    Path(sweep_dir, "report.md").write_text(md)
    Path(sweep_dir, "report.csv").write_text(to_csv(rows))
    return md
