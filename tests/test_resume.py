"""Resume: 8 steps straight equal 5 steps, then trainer.resume=RUN_DIR to 8, bit for bit, for
both actors; a resume with a config that computes something else is refused, naming the keys."""
import json

import pytest

from lockstep.framework.tracking.jsonl import computed, read_jsonl
from lockstep.launch import cli

from helpers import optional

pytestmark = pytest.mark.slow

QUIET = ["logger.progress=false", "logger.wandb.enabled=false"]


def _run(run_dir, *overrides):
    return cli.main(["run", "tiny-cpu", f"hydra.run.dir={run_dir}", *QUIET, *overrides])


@pytest.mark.parametrize("actor", ["native", "megatron"])
def test_resume_continues_bitwise(ray_session, tmp_path, actor):
    if actor == "megatron":
        optional("megatron.core")
    common = [f"actor={actor}", "algo.kl_coef=0.01", "rollout.top_p=0.9"]
    assert _run(tmp_path / "straight", "trainer.steps=8", *common) == 0
    assert _run(tmp_path / "first", "trainer.steps=5", "trainer.save_every=2", "trainer.keep_checkpoints=2", *common) == 0
    kept = sorted(d.name for d in (tmp_path / "first" / "checkpoints").iterdir())
    assert kept == ["step-4", "step-5"]  # every 2 steps and the last, the newest 2
    assert _run(tmp_path / "resumed", "trainer.steps=8", f"trainer.resume={tmp_path / 'first'}", *common) == 0
    straight = {r["step"]: r for r in read_jsonl(tmp_path / "straight" / "metrics.jsonl")}
    resumed = read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(6, 9))
    for r in resumed:
        a, b = computed(straight[r["step"]]), computed(r)
        assert a == b, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


def test_resume_refuses_another_config(ray_session, tmp_path, capsys):
    # (with W&B offline: a resumed run logs on into the checkpoint's run)
    assert cli.main(["run", "tiny-cpu", f"hydra.run.dir={tmp_path / 'a'}", "logger.progress=false", "trainer.steps=2",
                     "trainer.save_every=1"]) == 0
    run_id = json.loads((tmp_path / "a" / "checkpoints" / "step-2" / "trainer_state.json").read_text())["tracker_run_id"]
    [first] = (tmp_path / "a" / "wandb").glob("offline-run-*")
    assert run_id and first.name.endswith(run_id)
    rc = _run(tmp_path / "b", "trainer.steps=4", f"trainer.resume={tmp_path / 'a'}", "rollout.temperature=0.5", "seed=3")
    err = capsys.readouterr().err.replace("\n", " ")
    assert rc != 0 and "written with a different config (2 key(s)" in err, err
    assert "rollout.temperature: 1.0 in the checkpoint, 0.5 now" in err and "seed: 1 in the checkpoint, 3 now" in err
    rc = _run(tmp_path / "c", "trainer.steps=4", f"trainer.resume={tmp_path / 'nothing'}")
    assert rc != 0 and "no checkpoint there" in capsys.readouterr().err
    assert cli.main(["run", "tiny-cpu", f"hydra.run.dir={tmp_path / 'd'}", "logger.progress=false", "trainer.steps=3",
                     f"trainer.resume={tmp_path / 'a'}"]) == 0
    [resumed] = (tmp_path / "d" / "wandb").glob("offline-run-*")
    assert resumed.name.endswith(run_id)
