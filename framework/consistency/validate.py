"""`lockstep validate RUN_DIR`: check every gate of a run and seal it COMPLETE, or list what failed.

The gates read only what the run left on disk (config.yaml, summary.json, metrics.jsonl,
lockstep.log, readbacks/*.json): a run is COMPLETE when it finished every planned step, logged no
traceback, had mismatch_count == 0 with numel > 0 on every step, fell back nowhere, and the
readbacks of both sides show every module configured R actually ran the lockstep route
(call count > 0) with one kernel backend on every side, with route evidence from every process in
audit mode.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from lockstep.framework.consistency.readback import load_readbacks
from lockstep.framework.models.ops import SIDES, TORCH_IMPL, Selection
from lockstep.framework.summary import SUMMARY_FILE
from lockstep.framework.tracking.jsonl import read_jsonl
from lockstep.framework.tracking.tracker import METRICS_FILE

SEAL_FILE = "COMPLETE"
# the op slots each R module must have called; "a|b": either (the attention core is the contiguous
# op in the native engine and the trainers, the paged one in vLLM, the packed one in trainers that
# pack sequences; the projections are linear_rows where an adapter holds the weights fused)
MODULE_OPS = {"attention": ("linear|linear_rows", "row_linear", "rms_norm", "rope_cos_sin", "apply_rope",
                            "attention|paged_attention|varlen_attention"),
              "ffn": ("linear|linear_rows", "row_linear", "rms_norm", "silu_mul"), "logp": ("rms_norm", "linear_logp")}


@dataclass
class Gate:
    name: str
    ok: bool
    detail: str = ""


def _gate(gates: list[Gate], name: str, problems: list[str], ok_detail: str = "") -> None:
    gates.append(Gate(name, not problems, "; ".join(problems) if problems else ok_detail))


def check_run(run_dir: str | Path) -> list[Gate]:
    run_dir = Path(run_dir)
    gates: list[Gate] = []
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.exists():
        return [Gate("config", False, f"{cfg_path} missing: not a lockstep run dir")]
    cfg = yaml.safe_load(cfg_path.read_text())
    det, planned = cfg["determinism"], cfg["trainer"]["steps"]

    summary = json.loads((run_dir / SUMMARY_FILE).read_text()) if (run_dir / SUMMARY_FILE).exists() else {}
    _gate(gates, "finished", [] if summary.get("status") == "completed" else
          [f"status {summary.get('status', 'unknown')!r}" + (f": {summary['error']}" if summary.get("error") else "")])

    rows = read_jsonl(run_dir / METRICS_FILE) if (run_dir / METRICS_FILE).exists() else []
    trained = [r["step"] for r in rows if "train/loss" in r]
    _gate(gates, "steps_reached", [] if trained == list(range(1, planned + 1)) else
          [f"{len(trained)} of {planned} steps trained"], f"{planned} steps")

    log = run_dir / "lockstep.log"
    _gate(gates, "no_traceback", ["lockstep.log holds a traceback"] if log.exists() and "Traceback" in log.read_text() else [])

    bad = [f"step {r['step']}: {r['consistency/mismatch_count']} mismatches" for r in rows
           if r["consistency/mismatch_count"] != 0]
    bad += [f"step {r['step']}: numel 0" for r in rows if r["consistency/numel"] <= 0]
    if not rows:
        bad.append("no steps logged")
    numel = sum(r["consistency/numel"] for r in rows)
    _gate(gates, "mismatch_zero", bad[:5] + ([f"... {len(bad) - 5} more"] if len(bad) > 5 else []),
          f"0 of {numel} logprobs differ")

    readbacks = load_readbacks(run_dir)  # one per process: several per side with engines/ranks

    def label(rb):
        return f"{rb['side']}[{rb.get('instance', 0)}.{rb['rank']}]"

    problems = [f"no {side} readback" for side in SIDES if not any(rb["side"] == side for rb in readbacks)]
    problems += [f"{label(rb)} readback says mode {rb['mode']!r}, config {det['mode']!r}" for rb in readbacks
                 if rb["mode"] != det["mode"]]
    _gate(gates, "readbacks", problems, f"{len(readbacks)} processes")

    fallbacks = [f"{label(rb)}: {f['reason']} (x{f['count']})" for rb in readbacks for f in rb["fallbacks"]]
    _gate(gates, "no_fallback", fallbacks)

    problems = []
    for rb in readbacks:
        expected = Selection.for_side(det, rb["side"]).letters()
        if rb["selection"] != expected:
            problems.append(f"{label(rb)} ran {rb['selection']}, config implies {expected}")
        for module, letter in expected.items():
            if letter != "R":
                continue
            for slot in MODULE_OPS[module]:
                entries = [rb["ops"].get(f"{module}.{op}", {"impl": "absent", "calls": 0}) for op in slot.split("|")]
                if not any(e["impl"] != TORCH_IMPL and e["calls"] > 0 for e in entries):
                    problems.append(f"{label(rb)} {module}.{slot}: " + ", ".join(
                        f"{e['impl']} called {e['calls']} times" for e in entries))
        if expected["logp"] == "R" and not rb["logp_route"]["calls"].get("provider"):
            problems.append(f"{label(rb)}: the logp provider never served a call")
    _gate(gates, "r_ops_called", problems)

    # both sides must compute with one implementation of the kernels (torch reference or Triton)
    backends = {}
    for rb in readbacks:
        if "R" in rb["selection"].values():
            backends.setdefault(rb.get("kernel_backend", "unknown"), []).append(label(rb))
    _gate(gates, "same_kernel_backend", [] if len(backends) <= 1 else
          ["; ".join(f"{b}: {' '.join(who)}" for b, who in sorted(backends.items()))],
          ", ".join(backends) or "no lockstep kernels")

    if det["mode"] == "audit":
        _gate(gates, "route_evidence", [f"{label(rb)}: no route evidence" for rb in readbacks
                                        if Selection.for_side(det, rb["side"]).logp
                                        and not rb["logp_route"]["evidence_count"]])
    return gates


def validate_run(run_dir: str | Path) -> tuple[bool, list[Gate]]:
    """Check the gates; seal the run COMPLETE when all pass (a stale seal is removed otherwise)."""
    run_dir = Path(run_dir)
    gates = check_run(run_dir)
    ok = all(g.ok for g in gates)
    seal = run_dir / SEAL_FILE
    if ok:
        seal.write_text(json.dumps({"sealed_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                    "gates": [asdict(g) for g in gates]}, indent=2))
    elif seal.exists():
        seal.unlink()
    return ok, gates


def format_gates(run_dir, ok: bool, gates: list[Gate]) -> str:
    lines = [f"{run_dir}: {'COMPLETE' if ok else 'REFUSED'}"]
    for g in gates:
        lines.append(f"  [{'ok' if g.ok else 'FAIL'}] {g.name}" + (f": {g.detail}" if g.detail else ""))
    return "\n".join(lines)
