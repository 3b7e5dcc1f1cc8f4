"""Resume on one GPU: N steps straight against N/2 steps, then trainer.resume=RUN_DIR to N, compared
bit for bit on everything the steps compute (CPU CI runs the same check on tiny-cpu in float32;
this is the bf16 megatron actor with its CUDA optimizer state).

    python benchmarks/resume_1gpu.py OUT_DIR [--recipe R] [--steps N] [extra hydra overrides]
"""
from __future__ import annotations

import sys
from pathlib import Path

from lockstep.framework.tracking.jsonl import computed, read_jsonl
from lockstep.launch import cli
from _harness import emit


def main() -> None:
    out, args = Path(sys.argv[1]), sys.argv[2:]
    recipe, steps, extra = "qwen3-1.7b-1gpu", 4, []
    it = iter(args)
    for a in it:
        if a == "--recipe":
            recipe = next(it)
        elif a == "--steps":
            steps = int(next(it))
        else:
            extra.append(a)
    half = steps // 2

    def run(name: str, *overrides: str) -> list[dict]:
        rc = cli.main(["run", recipe, f"hydra.run.dir={out / name}", "logger.progress=false", *extra, *overrides])
        if rc != 0:
            sys.exit(f"{name}: run failed (rc={rc}); see {out / name}/lockstep.log")
        return read_jsonl(out / name / "metrics.jsonl")

    straight = {r["step"]: r for r in run("straight", f"trainer.steps={steps}")}
    run("first", f"trainer.steps={half}", f"trainer.save_every={half}")
    resumed = run("resumed", f"trainer.steps={steps}", f"trainer.resume={out / 'first'}")
    lines = [f"recipe {recipe} {' '.join(extra)}: {steps} steps straight vs {half} + resume", "",
             "| step | keys compared | keys that differ | loss straight | loss resumed |", "|---|---|---|---|---|"]
    ok = [r["step"] for r in resumed] == list(range(half + 1, steps + 1))
    for r in resumed:
        a, b = computed(straight[r["step"]]), computed(r)
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        ok &= not differ
        lines.append(f"| {r['step']} | {len(a)} | {', '.join(differ) or 'none'} | {a.get('train/loss')} | "
                     f"{b.get('train/loss')} |")
    lines.append("")
    lines.append("resumed steps equal the straight run's bit for bit" if ok else "RESUME DIFFERS")
    emit(lines, out / "resume.md")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
