"""The `lockstep` command.

  lockstep run RECIPE [KEY=VALUE ...]        one run (Hydra overrides)
  lockstep run RECIPE -m KEY=A,B ...         a Hydra multirun sweep
  lockstep recipes                           list the recipes
  lockstep validate RUN_DIR                  check a run's gates; seal it COMPLETE
  lockstep report SWEEP_DIR                  the ablation table of a sweep (markdown + CSV)
  lockstep init-model --like M --out DIR     a random-init HF Qwen3 directory (with a tokenizer)
  lockstep plan RECIPE [KEY=VALUE ...]       check a topology; print the placement and memory per GPU
  lockstep dashboard [--dry-run]             save the W&B mismatch workspace (or print its spec)
  lockstep bisect RUN_DIR --step N           replay a recorded sample on both sides: the first op that differs
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lockstep.launch.overrides import BadOverride, check_overrides
from lockstep.launch.recipes import SEARCHPATH_OVERRIDE, UnknownRecipe, check_recipe, is_multirun_recipe, listing

_results: list[tuple[Path, str]] = []  # (run dir, status) per job of this invocation


@hydra.main(config_path="pkg://lockstep.recipes", config_name=None, version_base="1.3")
def _job(cfg: DictConfig) -> None:
    from lockstep.framework.driver import run

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    try:
        name = hc.job.config_name + (f"#{hc.job.num}" if hc.mode.name == "MULTIRUN" else "")
        summary = run(cfg, run_dir, name, tuple(hc.overrides.task))
    except Exception as e:  # noqa: BLE001 - reported below, and the exit code says failed
        from lockstep.framework.summary import RunSummary, SUMMARY_FILE

        with (run_dir / "lockstep.log").open("a") as log:  # the full traceback, off the console
            log.write(traceback.format_exc())
        print(f"\nlockstep: run failed: {type(e).__name__}: {e}\n(traceback in {run_dir / 'lockstep.log'})",
              file=sys.stderr)
        _results.append((run_dir, "failed"))
        if not (run_dir / SUMMARY_FILE).exists():  # failed before the driver's summary existed
            run_dir.mkdir(parents=True, exist_ok=True)
            RunSummary(run_dir, str(cfg.determinism.mode), cfg.trainer.steps).finish("failed", f"{type(e).__name__}: {e}")
        if os.environ.get("LOCKSTEP_RAISE"):  # debugging: the full traceback
            raise
        return  # a sweep goes on to its next arm; the exit code reports the failure
    print(summary.format())
    _results.append((run_dir, summary.status))


def _run(args, passthrough: list[str]) -> int:
    try:
        check_recipe(args.recipe)
        check_overrides(args.recipe, args.overrides)
    except (UnknownRecipe, BadOverride) as e:
        print(f"lockstep: {e}", file=sys.stderr)
        return 2
    args.multirun = args.multirun or is_multirun_recipe(args.recipe)
    _results.clear()
    sys.argv = ["lockstep", "--config-name", args.recipe] + (["--multirun"] if args.multirun else []) \
        + passthrough + [SEARCHPATH_OVERRIDE] + args.overrides
    from lockstep.framework.driver import ray_cluster

    knobs = dict(o.split("=", 1) for o in args.overrides if o.startswith(("ray.address=", "ray.connect_timeout_s=")))
    address = knobs.get("ray.address")
    address = None if address in (None, "null", "") else address
    try:
        timeout = {"timeout_s": float(knobs["ray.connect_timeout_s"])} if "ray.connect_timeout_s" in knobs else {}
        cluster = ray_cluster(address, **timeout)
        with cluster if args.multirun and not passthrough else contextlib.nullcontext():
            _job()  # a sweep's arms share one Ray cluster
    except SystemExit as e:  # Hydra exits on its own errors (after printing them)
        return int(e.code or 1) if not isinstance(e.code, str) else 1
    except ConnectionError as e:  # a sweep's cluster (ray.address) did not answer
        print(f"lockstep: {e}", file=sys.stderr)
        return 1
    failed = [d for d, status in _results if status != "completed"]
    if args.multirun:
        print(f"\nlockstep: sweep finished, {len(_results) - len(failed)}/{len(_results)} runs completed")
        for d, status in _results:
            print(f"  {status:<9} {d}")
        if _results:
            print(f"table: lockstep report {_results[0][0].parent}")
    return 1 if failed else 0


USAGE = """usage: lockstep run RECIPE [-m] [--cfg job|hydra|all [--resolve]] [KEY=VALUE ...]
       lockstep recipes
       lockstep validate RUN_DIR | lockstep report SWEEP_DIR
       lockstep init-model --like MODEL --out DIR [--seed N] [KEY=VALUE ...]
       lockstep plan RECIPE [--gpu-gib G] [KEY=VALUE ...]
       lockstep dashboard [--entity E] [--project P] [--dry-run]
       lockstep bisect RUN_DIR --step N [--sample S]

  run       run a recipe with Hydra overrides, e.g.
              lockstep run tiny-cpu rollout.n_samples=4 determinism=off
            -m / --multirun sweeps comma-separated values:
              lockstep run tiny-cpu -m determinism=strict,off seed=1,2
            --cfg job prints the composed config instead of running
  recipes   list the recipes with one line each
  init-model  write a random-init HF Qwen3 checkpoint shaped like a model group (lockstep init-model -h)
  plan      check a recipe's topology and print the placement and memory per GPU (no GPU needed)
  dashboard the W&B workspace for mismatch (--dry-run prints its spec)
  bisect    replay a sample a run recorded (determinism.record_mismatch) on both sides, op by op"""

_HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p"}
_HYDRA_FLAGS = {"--resolve", "--info", "-i"}


def _parse_run(rest: list[str]):
    args = argparse.Namespace(recipe=None, multirun=False, overrides=[])
    passthrough, it = [], iter(rest)
    for a in it:
        if a in ("-m", "--multirun"):
            args.multirun = True
        elif a in _HYDRA_FLAGS_WITH_VALUE:
            passthrough += [a, next(it, "job")]
        elif a in _HYDRA_FLAGS:
            passthrough.append(a)
        elif a.startswith("-") and not a.startswith("~"):
            raise SystemExit(f"lockstep: unknown option {a!r}\n{USAGE}")
        elif args.recipe is None:
            args.recipe = a
        else:
            args.overrides.append(a)
    if args.recipe is None:
        raise SystemExit(f"lockstep: run needs a recipe name\n{USAGE}\n\nrecipes:\n{listing()}")
    return args, passthrough


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "recipes":
        print(listing())
        return 0
    if argv[0] == "run":
        return _run(*_parse_run(argv[1:]))
    if argv[0] == "plan":
        from lockstep.launch.plan import main as plan

        return plan(argv[1:])
    if argv[0] == "dashboard":
        from lockstep.launch.dashboard import main as dashboard

        return dashboard(argv[1:])
    if argv[0] == "bisect":
        from lockstep.launch.bisect import main as bisect

        return bisect(argv[1:])
    if argv[0] == "init-model":
        from lockstep.launch.init_model import main as init_model

        return init_model(argv[1:])
    if argv[0] in ("validate", "report"):
        if len(argv) != 2:
            print(f"lockstep: {argv[0]} takes one directory\n{USAGE}", file=sys.stderr)
            return 2
        return _validate(argv[1]) if argv[0] == "validate" else _report(argv[1])
    print(f"lockstep: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
    return 2


def _validate(run_dir: str) -> int:
    from lockstep.framework.consistency.validate import format_gates, validate_run

    ok, gates = validate_run(run_dir)
    print(format_gates(run_dir, ok, gates))
    return 0 if ok else 1


def _report(sweep_dir: str) -> int:
    from lockstep.framework.consistency.report import write_report

    try:
        print(write_report(sweep_dir), end="")
    except FileNotFoundError as e:
        print(f"lockstep: {e}", file=sys.stderr)
        return 2
    print(f"(also {Path(sweep_dir) / 'report.md'} and report.csv)")
    return 0


def console_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    console_main()
