"""A 1-GPU recipe end to end in both determinism modes, side by side (one process, one GPU).

    python benchmarks/e2e_1gpu.py OUT_DIR [--recipe R] [--modes strict,off] [extra hydra overrides]

Runs the recipe (default qwen3-1.7b-1gpu) with determinism.mode=strict and =off, then prints (and
writes to OUT_DIR/e2e.md) per-mode timings, the mismatch of every step, the weight sync's parts and
the colocated memory per phase. Step 1 carries start-up costs (compilation, allocator warm-up), so
means are over steps 2.. when there are several.
"""
from __future__ import annotations

import sys
from pathlib import Path

from lockstep.framework.tracking.jsonl import read_jsonl
from lockstep.launch import cli
from _harness import emit

TIMES = ["perf/step_s", "perf/rollout_s", "perf/logp_s", "perf/train_s", "perf/weight_sync_s"]
SYNC = ["perf/weight_verify_total_s", "perf/weight_load_total_s", "perf/weight_load_send_gather_s",
        "perf/weight_load_send_pack_s", "perf/weight_load_send_checksum_s", "perf/weight_load_open_s",
        "perf/weight_load_verify_s", "perf/weight_load_load_s", "perf/weight_load_post_verify_s",
        "perf/actor_offload_s", "perf/actor_reload_s", "perf/engine_sleep_s", "perf/engine_wake_s"]
MEMORY = ["perf/actor_allocated_gib/train", "perf/actor_allocated_gib/weight_sync", "perf/actor_offloaded_gib",
          "perf/mem_used_gib/rollout", "perf/mem_used_gib/train", "perf/peak_mem_gib/rollout",
          "perf/peak_mem_gib/train", "perf/peak_mem_gib/weight_sync"]


def run_mode(out: Path, recipe: str, mode: str, extra: list[str]) -> list[dict]:
    run_dir = out / mode
    rc = cli.main(["run", recipe, f"determinism.mode={mode}", f"hydra.run.dir={run_dir}", "logger.progress=false", *extra])
    rows = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    if rc != 0:
        print(f"{mode}: run failed (rc={rc}); see {run_dir}/lockstep.log", file=sys.stderr)
        log = run_dir / "lockstep.log"
        if log.exists():
            print(log.read_text()[-3000:], file=sys.stderr)
    return rows


def mean(rows: list[dict], key: str) -> float:
    steady = rows[1:] if len(rows) > 1 else rows
    vals = [r[key] for r in steady if key in r]
    return sum(vals) / len(vals) if vals else float("nan")


def main() -> None:
    out, args = Path(sys.argv[1]), sys.argv[2:]
    recipe, modes, extra = "qwen3-1.7b-1gpu", ["strict", "off"], []
    it = iter(args)
    for a in it:
        if a == "--recipe":
            recipe = next(it)
        elif a == "--modes":
            modes = next(it).split(",")
        else:
            extra.append(a)
    results = {mode: run_mode(out, recipe, mode, extra) for mode in modes}
    cols = ["mode", "steps", "mismatch per step", "logprobs", "response tokens per step (mean)", "entropy per step", "step s", "rollout s",
            "logp s", "train s", "sync s"]
    lines = [f"recipe {recipe} {' '.join(extra)}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for mode, rows in results.items():
        mism = ",".join(str(int(r["consistency/mismatch_count"])) for r in rows)
        numel = sum(int(r["consistency/numel"]) for r in rows)
        lens = ",".join(f"{r['rollout/response_len_mean']:.1f}" for r in rows)
        ent = ",".join(f"{r['train/entropy']:.3g}" for r in rows)  # near 0: a collapsed policy, its logprobs ~0
        vals = [f"{mean(rows, k):.3f}" for k in TIMES]
        lines.append(f"| {mode} | {len(rows)} | {mism} | {numel} | {lens} | {ent} | " + " | ".join(vals) + " |")
    if len(modes) == 2 and all(results.values()):
        a, b = (mean(results[m], "perf/step_s") for m in modes)
        lines.append(f"\n{modes[0]} / {modes[1]} step time: {a / b:.3f}x")
    for title, keys in (("weight sync and colocation (s, mean of steps 2..)", SYNC), ("memory (GiB, mean of steps 2..)", MEMORY)):
        lines += ["", f"{title}:", "", "| metric | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
        for k in keys:
            lines.append(f"| {k} | " + " | ".join(f"{mean(results[m], k):.4g}" for m in modes) + " |")
    emit(lines, out / "e2e.md")


if __name__ == "__main__":
    main()
