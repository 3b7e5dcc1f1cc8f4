"""`lockstep bisect`: a mismatching run records its first failing step; the replay names the first
op where trainer and rollout part (a fault in the logprob, a stock attention core on one side)."""
import json
import shutil

import pytest
import yaml

from lockstep.framework.consistency.record import read_record, recorded_steps
from lockstep.launch import cli

pytestmark = pytest.mark.slow

QUIET = ["logger.progress=false", "logger.wandb.enabled=false"]


def _mismatching_run(tmp_path, *overrides):
    rc = cli.main(["run", "tiny-cpu", f"hydra.run.dir={tmp_path}", "trainer.steps=2", *overrides, *QUIET])
    assert rc == 1  # strict stops at step 1
    assert recorded_steps(tmp_path) == [1]
    return tmp_path


def _first_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("first difference:"))


def test_bisect_names_the_logp_op_of_an_injected_fault(ray_session, tmp_path, capsys):
    run = _mismatching_run(tmp_path, "determinism.inject_fault=rollout_logp_reversed_vocab", "rollout.top_p=0.9")
    assert "lockstep bisect" in capsys.readouterr().err  # the error says where the record is and what to run
    rec = read_record(run, 1)
    assert rec.mismatching_samples and rec.rollout.support_ids is not None
    assert cli.main(["bisect", str(run), "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert "reproduces the run's logprobs: trainer yes, rollout yes" in out
    line = _first_line(out)
    assert line.startswith("first difference: token logprob (logp.linear_logp)"), line
    assert "fault:rollout_logp_reversed_vocab" in line and "32 ops before it agree" in line  # 1 + 2 x 15 + 1
    saved = json.loads((run / "bisect" / "step-1" / f"bisect-sample-{rec.mismatching_samples[0]}.json").read_text())
    assert saved["first"]["slot"] == "logp.linear_logp"
    assert all(op["rows_differ"] == 0 for op in saved["ops"][:-1])


def test_bisect_names_the_attention_core_of_a_stock_attention_arm(ray_session, tmp_path, capsys):
    run = _mismatching_run(tmp_path, "determinism.stock_ops.rollout=[attention.attention]")
    assert cli.main(["bisect", str(run), "--step", "1", "--all"]) == 0
    out = capsys.readouterr().out
    line = _first_line(out)
    assert line.startswith("first difference: layer 0 attention core (attention.attention): "
                           "trainer lockstep.kernels[torch] vs rollout torch"), line
    assert "9 ops before it agree" in line  # RoPE tables, then layer 0's norm, q/k/v, q/k norms, RoPE of q and k
    assert "rollout yes" in out and len([x for x in out.splitlines() if "down_proj" in x]) == 2  # --all: every op

    # negative control: the same record replayed as if both sides ran lockstep's core agrees op by op,
    # and says that this rollout side does not reproduce what the run recorded
    clean = tmp_path.parent / (tmp_path.name + "-clean")
    shutil.copytree(run, clean)
    cfg = yaml.safe_load((clean / "config.yaml").read_text())
    cfg["determinism"]["stock_ops"]["rollout"] = []
    (clean / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["bisect", str(clean), "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert "no op differs between the sides, nor the logprob" in out
    assert "rollout NO" in out and "outside the ops replayed here" in out


def test_bisect_errors_name_what_is_missing(ray_session, tmp_path, capsys):
    assert cli.main(["run", "tiny-cpu", f"hydra.run.dir={tmp_path}", "trainer.steps=1", *QUIET]) == 0
    assert recorded_steps(tmp_path) == []  # a clean run records nothing
    assert cli.main(["bisect", str(tmp_path), "--step", "1"]) == 2
    assert "no record of step 1; recorded: none" in capsys.readouterr().err
    assert cli.main(["bisect", str(tmp_path / "nope"), "--step", "1"]) == 2
    assert "not a run directory" in capsys.readouterr().err
