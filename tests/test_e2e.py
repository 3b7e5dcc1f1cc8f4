"""End-to-end runs through the real CLI, Hydra, Ray actors on a placement group, and W&B offline."""
import json

import pytest

from lockstep.framework.tracking.jsonl import read_jsonl
from lockstep.launch import cli

pytestmark = pytest.mark.slow

QUIET = ["logger.progress=false", "logger.wandb.enabled=false"]
REQUIRED = ["consistency/mismatch_count", "consistency/max_abs_diff", "consistency/mean_abs_diff",
            "consistency/numel", "consistency/mismatch_rate", "consistency/k3_kl", "consistency/certain_frac",
            "train/train_rollout_logprob_abs_diff", "rollout/reward_mean", "rollout/response_len_mean",
            "rollout/tok_per_s_per_gpu", "train/loss", "train/pg_loss", "train/kl_loss", "train/entropy",
            "train/grad_norm", "train/lr", "perf/step_s", "perf/rollout_s", "perf/train_s", "perf/logp_s",
            "perf/weight_sync_s"]


def _run(tmp_path, *overrides):
    return cli.main(["run", "tiny-cpu", f"hydra.run.dir={tmp_path}", *overrides])


def test_tiny_cpu_strict_short_run(ray_session, tmp_path, capsys):
    rc = _run(tmp_path, "trainer.steps=4", "algo.kl_coef=0.01", "rollout.top_p=0.9")
    assert rc == 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["consistency/mismatch_count"] == 0 and r["consistency/numel"] > 0
        assert r["train/tis_differ"] == 0  # the loss's rollout/trainer importance ratio is exactly 1
        assert r["consistency/certain_frac"] < 0.5  # an uncertain policy: the agreement means something
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
    assert rows[-1]["rollout/weights_version"] == 3  # one sync per step, verified each time
    from lockstep.launch.dashboard import spec  # the dashboard plots what runs log (memory: colocated GPUs only)
    plotted = {y for sec in spec(None, "p", "n")["sections"] for p in sec["panels"] for y in p.get("y", [])}
    assert not {k for k in plotted if "_gib" not in k} - rows[-1].keys()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps_completed"] == 4
    assert (tmp_path / "config.yaml").read_text().count("${") == 0  # resolved
    assert (tmp_path / "checkpoint" / "model.safetensors").exists()
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline W&B run written"
    # a second run into the same directory is refused before it starts: its steps would mix with these
    capsys.readouterr()
    assert _run(tmp_path, "trainer.steps=1") == 1
    assert f"FileExistsError: hydra.run.dir={tmp_path} already holds a run" in capsys.readouterr().err
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


def test_a_collapsed_policy_is_flagged(ray_session, tmp_path):
    """lr 1.0 makes tiny-cpu certain of its tokens by step 3: every logprob then agrees as 0.0 on both
    sides whatever the kernels do, and the run says so once (the qwen3-1.7b-1gpu recipe's old lr did this)."""
    assert _run(tmp_path, "trainer.steps=3", "actor.lr=1.0", *QUIET) == 0
    frac = [r["consistency/certain_frac"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert frac[0] < 0.5 and frac[-1] >= 0.9, frac
    log = (tmp_path / "lockstep.log").read_text()
    assert log.count("compared logprobs are exactly 0.0 on both sides") == 1, log[-2000:]


@pytest.mark.parametrize("route", [[], ["rollout.top_p=0.9"], ["rollout.top_k=20"], ["rollout.top_k=4", "rollout.top_p=0.8"]],
                         ids=["full-vocab", "top-p", "top-k", "top-k+top-p"])
def test_injected_fault_stops_strict_with_a_clear_error(ray_session, tmp_path, capsys, route):
    rc = _run(tmp_path, "trainer.steps=3", "determinism.inject_fault=rollout_logp_reversed_vocab", *route, *QUIET)
    assert rc == 1
    err = capsys.readouterr().err
    assert "LockstepMismatchError: step 1:" in err
    assert "first at sample" in err and "response position" in err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps_completed"] == 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")  # the failing step's report is on disk
    assert len(rows) == 1 and rows[0]["consistency/mismatch_count"] > 0
    assert read_jsonl(tmp_path / "worst_tokens.jsonl")


def test_off_mode_only_reports(ray_session, tmp_path):
    rc = _run(tmp_path, "trainer.steps=3", "determinism=off", "algo.tis_cap=2.0",
              "determinism.inject_fault=rollout_logp_reversed_vocab", *QUIET)
    assert rc == 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == 3 and all(r["consistency/mismatch_count"] > 0 for r in rows)
    # TIS reweights by the rollout logprobs, which here part from the trainer's by float noise (the
    # fault acts in strict only): ratios off 1 on some tokens, none near the cap
    assert all(r["train/tis_differ"] > 0 and r["train/tis_capped"] == 0 for r in rows)
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


def test_off_mode_runs_no_lockstep_op_on_either_side(ray_session, tmp_path):
    from lockstep.framework.consistency.readback import load_readbacks

    assert _run(tmp_path, "trainer.steps=2", "determinism=off", "rollout.top_p=0.9", *QUIET) == 0
    readbacks = load_readbacks(tmp_path)
    assert sorted(rb["side"] for rb in readbacks) == ["rollout", "trainer"]
    for rb in readbacks:
        assert rb["selection"] == {"attention": "P", "ffn": "P", "logp": "P"}
        slots = rb["ops"]
        assert {"attention.rope_cos_sin", "attention.apply_rope", "attention.attention", "ffn.silu_mul"} <= slots.keys()
        assert all(v["impl"] == "torch" for v in slots.values()), slots
        assert slots["attention.apply_rope"]["calls"] > 0  # the stock ops did run
        # the kernels count their own calls: nothing reached lockstep.kernels, RoPE included
        assert not any(rb["kernel_calls"].values()), rb["kernel_calls"]


def test_multirun_sweep(ray_session, tmp_path):
    rc = cli.main(["run", "tiny-cpu", "-m", "determinism=strict,off", "trainer.steps=2",
                   f"hydra.sweep.dir={tmp_path}", *QUIET])
    assert rc == 0
    runs = sorted(p.parent for p in tmp_path.glob("*/summary.json"))
    assert len(runs) == 2
    modes = sorted(json.loads((r / "summary.json").read_text())["mode"] for r in runs)
    assert modes == ["off", "strict"]


def test_a_dead_engine_is_the_error_the_user_sees(ray_session, tmp_path, capsys):
    """The engine's process is killed mid-run: the CLI fails with the engine's death, not with the
    secondary failure of collecting its readback; the run dir says so; resume continues from the
    last checkpoint to the end."""
    import threading
    import time

    import psutil

    def kill_engine_after_step_1():
        deadline = time.time() + 120
        while time.time() < deadline:
            metrics = tmp_path / "metrics.jsonl"
            if metrics.exists() and metrics.read_text().endswith("\n"):  # step 1 logged
                for p in psutil.Process().children(recursive=True):  # this session's Ray workers only
                    try:
                        if any("ray::NativeRolloutEngine" in c for c in p.cmdline()):
                            p.kill()
                            return
                    except psutil.Error:  # a worker that exited (or a zombie) since the listing
                        continue
            time.sleep(0.05)

    killer = threading.Thread(target=kill_engine_after_step_1)
    killer.start()
    rc = _run(tmp_path, "trainer.steps=12", "trainer.save_every=1", *QUIET)
    killer.join()
    assert rc == 1
    err = capsys.readouterr().err
    failure = next(line for line in err.splitlines() if line.startswith("lockstep: run failed:"))
    assert failure.startswith("lockstep: run failed: WorkerDied: NativeRolloutEngine (pid "), failure
    assert __import__("re").search(r"died in step \d+, phase (rollout|weight_sync)\. Ray says: ", failure), failure
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("WorkerDied: NativeRolloutEngine")
    assert 1 <= summary["steps_completed"] < 12
    assert "the rollout engines wrote none" in (tmp_path / "lockstep.log").read_text()
    latest = max(int(d.name.removeprefix("step-")) for d in (tmp_path / "checkpoints").glob("step-*"))
    assert latest <= summary["steps_completed"] and len(list((tmp_path / "checkpoints").glob("step-*"))) <= 2
    again = tmp_path / "resumed"
    assert cli.main(["run", "tiny-cpu", f"hydra.run.dir={again}", "trainer.steps=12", f"trainer.resume={tmp_path}",
                     *QUIET]) == 0
    rows = read_jsonl(again / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(latest + 1, 13))
    assert all(r["consistency/mismatch_count"] == 0 for r in rows)
    assert json.loads((again / "summary.json").read_text())["resumed_from"] == str(tmp_path / "checkpoints" / f"step-{latest}")


def test_ray_address_is_explicit(tmp_path, monkeypatch):
    """Unset: a fresh local cluster even where RAY_ADDRESS (or a stale address file) points at a
    dead one; set: a dead address fails within ray.connect_timeout_s, naming it."""
    import subprocess
    import sys
    import time

    from lockstep.framework.driver import ray_address

    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=r"ray.address=127.0.0.1:9: no Ray cluster answers at 127.0.0.1:9 "
                                              r"within ray.connect_timeout_s=1"):
        ray_address("127.0.0.1:9", 1.0)
    assert time.monotonic() - t0 < 10
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    with pytest.raises(ConnectionError, match=r"ray.address=auto \(RAY_ADDRESS=127.0.0.1:9\)"):
        ray_address("auto", 0.5)
    code = ("import ray\nfrom lockstep.framework.driver import ray_cluster\n"
            "with ray_cluster():\n    print('cpus', ray.cluster_resources()['CPU'])\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0 and "cpus" in out.stdout, out.stderr[-2000:]
    assert time.monotonic() - t0 < 90  # not minutes of retrying the dead address
    out = subprocess.run([sys.executable, "-m", "lockstep.launch.cli", "run", "tiny-cpu", f"hydra.run.dir={tmp_path / 'run'}",
                          "ray.address=127.0.0.1:9", "ray.connect_timeout_s=1", *QUIET],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)  # a process without Ray
    assert out.returncode == 1 and "lockstep: run failed: ConnectionError: ray.address=127.0.0.1:9" in out.stderr
    assert "ConnectionError: ray.address=127.0.0.1:9" in json.loads((tmp_path / "run" / "summary.json").read_text())["error"]
