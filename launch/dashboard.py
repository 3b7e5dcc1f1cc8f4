"""`lockstep dashboard [--entity E] [--project P] [--name N] [--dry-run]`: the W&B workspace for watching
mismatch, made from one spec.

Sections: consistency (mismatch count and rate, max / mean |dlogp|, k3 KL, logprobs compared), the
worst tokens of every step (the `consistency/worst_tokens` table), strict vs off (step time, rollout
throughput, reward and loss, grouped by `determinism.mode`, so both modes of a sweep overlay), and
the weight sync and memory per phase. `--dry-run` prints the spec as JSON and contacts nothing. The
live call needs `pip install lockstep-rl[dashboard]` (wandb-workspaces) and a W&B login
(`wandb login`, or WANDB_API_KEY); it saves the workspace into ENTITY/PROJECT and prints its URL.
Offline runs (the default, `logger.wandb.mode=offline`) appear in it once synced:
`wandb sync runs/<recipe>/<time>/wandb/offline-run-*` (to the same entity and project).
"""
from __future__ import annotations

import argparse
import json
import sys

GROUP_BY = "determinism.mode"


def _lines(*keys: str) -> list[dict]:
    return [{"type": "line", "title": k, "x": "Step", "y": [k]} for k in keys]


def spec(entity: str | None, project: str, name: str) -> dict:
    return {
        "entity": entity, "project": project, "name": name, "groupby": GROUP_BY,
        "sections": [
            {"name": "Consistency", "panels": _lines(
                "consistency/mismatch_count", "consistency/mismatch_rate", "consistency/max_abs_diff",
                "consistency/mean_abs_diff", "consistency/k3_kl", "consistency/numel", "consistency/certain_frac")},
            {"name": "Worst tokens", "panels": [{"type": "table", "title": "worst tokens per step",
                                                 "table": "consistency/worst_tokens"}]},
            {"name": "Strict vs off", "panels": _lines(
                "perf/step_s", "rollout/tok_per_s_per_gpu", "rollout/reward_mean", "train/loss", "train/grad_norm")},
            {"name": "Weight sync and memory", "panels": _lines(
                "perf/weight_sync_s", "perf/weight_verify_total_s", "perf/weight_load_total_s",
                "perf/mem_used_gib/rollout", "perf/mem_used_gib/train", "perf/actor_allocated_gib/weight_sync")},
        ],
    }


def build_workspace(s: dict):
    """The wandb-workspaces object for a spec (no network until .save())."""
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as e:
        raise RuntimeError(f"the live dashboard needs wandb-workspaces: pip install lockstep-rl[dashboard] ({e})") from e

    def panel(p):
        if p["type"] == "table":
            return wr.WeavePanelSummaryTable(table_name=p["table"])
        return wr.LinePlot(title=p["title"], x=p["x"], y=p["y"], groupby=wr.Config(s["groupby"]))

    return ws.Workspace(entity=s["entity"], project=s["project"], name=s["name"],
                        sections=[ws.Section(name=sec["name"], panels=[panel(p) for p in sec["panels"]], is_open=True)
                                  for sec in s["sections"]],
                        runset_settings=ws.RunsetSettings(groupby=[ws.Config(s["groupby"])]))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="lockstep dashboard", description=__doc__.split("\n\n")[0])
    ap.add_argument("--entity", default=None, help="W&B entity (default: your default entity)")
    ap.add_argument("--project", default="lockstep", help="W&B project (logger.wandb.project; default lockstep)")
    ap.add_argument("--name", default="lockstep mismatch", help="the workspace's name")
    ap.add_argument("--dry-run", action="store_true", help="print the workspace spec as JSON; contact nothing")
    args = ap.parse_args(argv)
    s = spec(args.entity, args.project, args.name)
    if args.dry_run:
        print(json.dumps(s, indent=2))
        return 0
    if s["entity"] is None:
        import wandb

        s["entity"] = wandb.Api().default_entity
    try:
        workspace = build_workspace(s)
        workspace.save()
    except Exception as e:  # noqa: BLE001 - W&B's errors vary; say what failed and where
        print(f"lockstep dashboard: could not save the workspace to {s['entity']}/{s['project']}: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"workspace saved: {workspace.url}")
    return 0
