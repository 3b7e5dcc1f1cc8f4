"""Readbacks, the run validator and the ablation sweep, on real runs."""
import json

import pytest
import torch

from helpers import PROVIDER, determinism
from lockstep.framework.consistency.readback import readback
from lockstep.framework.consistency.validate import MODULE_OPS, SEAL_FILE
from lockstep.framework.models.ops import Selection, ops_for_side
from lockstep.framework.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from lockstep.launch import cli

QUIET = ["logger.progress=false", "logger.wandb.enabled=false", "trainer.save_final=false"]


@pytest.mark.parametrize("case,trainer,rollout", [("R/R", "RRR", "RRR"), ("P/R", "PPP", "RRR"),
                                                  ("R/P", "RRR", "PPP"), ("P/P", "PPP", "PPP")])
def test_cases_pick_ops_per_side(case, trainer, rollout):
    for side, want in (("trainer", trainer), ("rollout", rollout)):
        assert "".join(Selection.for_side(determinism(case=case), side).letters().values()) == want
    assert "".join(Selection.for_side(determinism(case="R/R", ffn=0), "trainer").letters().values()) == "RPR"
    assert "".join(Selection.for_side(determinism(mode="off"), "rollout").letters().values()) == "PPP"


def test_readback_counts_what_ran():
    ops = ops_for_side(determinism(ffn=0), "trainer")
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=16), ops)
    model.init_weights(0)
    h = model(torch.randint(0, 16, (2, 5)), torch.arange(5).expand(2, 5))
    model.token_logp(h[:, -1], torch.tensor([3, 4]))
    rb = readback(ops, side="trainer", backend="native")
    assert rb["selection"] == {"attention": "R", "ffn": "P", "logp": "R"}
    assert rb["ops"]["attention.attention"] == {"impl": "lockstep.kernels[torch]", "calls": 2}  # 2 layers
    assert rb["ops"]["attention.rope_cos_sin"]["calls"] == 1 and rb["ops"]["attention.apply_rope"]["calls"] == 4
    assert rb["ops"]["ffn.linear"]["impl"] == "torch" and rb["ops"]["ffn.linear"]["calls"] == 4
    assert rb["ops"]["ffn.row_linear"]["impl"] == "torch" and rb["ops"]["ffn.row_linear"]["calls"] == 2
    assert rb["ops"]["logp.linear_logp"]["impl"] == f"provider:{PROVIDER}"
    assert rb["logp_route"]["calls"] == {"provider": 1} and rb["fallbacks"] == []


def _validate(run_dir, capsys):
    rc = cli.main(["validate", str(run_dir)])
    return rc, capsys.readouterr().out


@pytest.mark.slow
def test_ablation_tiny_report_and_seal(ray_session, tmp_path, capsys):
    # 2 of the recipe's 6 steps per arm: what the report and the seal check does not change with them
    assert cli.main(["run", "ablation-tiny", f"hydra.sweep.dir={tmp_path}", "logger.progress=false",
                     "trainer.steps=2"]) == 0
    arms = sorted(p.parent for p in tmp_path.glob("*/config.yaml"))
    assert len(arms) == 8
    capsys.readouterr()
    assert cli.main(["report", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| M")]
    assert sorted(r.split("|")[1].strip() for r in rows) == [f"M{i:03b}" for i in range(8)]
    m111 = next(r for r in rows if r.startswith("| M111"))
    assert "| COMPLETE |" in m111
    assert (tmp_path / "report.csv").read_text().count("\n") == 9
    r_r = next(a for a in arms if "attention=1,determinism.ffn=1,determinism.logp=1" in a.name)
    assert (r_r / SEAL_FILE).exists()
    for side in ("trainer", "rollout"):  # readbacks prove the lockstep route ran on both sides
        rb = json.loads((r_r / "readbacks" / f"{side}-0-rank0.json").read_text())
        assert all(v["impl"] != "torch" for v in rb["ops"].values())
        for module, slots in MODULE_OPS.items():  # the trainer never samples, so logp.linear is not here
            for slot in slots:
                assert any(rb["ops"][f"{module}.{op}"]["calls"] > 0 for op in slot.split("|")), (side, module, slot)
        assert rb["logp_route"]["calls"]["provider"] > 0


@pytest.mark.slow
def test_injected_fallback_is_refused(ray_session, tmp_path, capsys):
    rc = cli.main(["run", "tiny-cpu", f"hydra.run.dir={tmp_path}", "trainer.steps=2", "determinism=auto",
                   "determinism.provider=no_such_provider_pkg.mod:fn", *QUIET])
    assert rc == 0  # auto falls back on an import failure and keeps running ...
    rc, out = _validate(tmp_path, capsys)
    assert rc == 1 and "REFUSED" in out  # ... but the run cannot be sealed
    assert "[FAIL] no_fallback:" in out and "trainer[0.0]: import failed: ModuleNotFoundError" in out
    assert "[FAIL] r_ops_called" in out and not (tmp_path / SEAL_FILE).exists()


@pytest.mark.slow
def test_injected_mismatch_is_refused_and_strict_fails_closed(ray_session, tmp_path, capsys):
    rc = cli.main(["run", "tiny-cpu", f"hydra.run.dir={tmp_path / 'a'}", "trainer.steps=2",
                   "determinism.inject_fault=rollout_logp_reversed_vocab", "determinism.on_mismatch=report", *QUIET])
    assert rc == 0
    rc, out = _validate(tmp_path / "a", capsys)
    assert rc == 1 and "[FAIL] mismatch_zero: step 1:" in out and "[ok] no_fallback" in out
    rc = cli.main(["run", "tiny-cpu", f"hydra.run.dir={tmp_path / 'b'}", "trainer.steps=2",
                   "determinism=strict", "determinism.provider=no_such_provider_pkg.mod:fn", *QUIET])
    assert rc == 1
    assert "needs a linear-logp provider" in capsys.readouterr().err
    rc, out = _validate(tmp_path / "b", capsys)
    assert rc == 1 and "[FAIL] finished" in out


@pytest.mark.slow
def test_sides_on_different_kernel_backends_are_refused(ray_session, tmp_path, capsys):
    assert cli.main(["run", "tiny-cpu", f"hydra.run.dir={tmp_path}", "trainer.steps=1", *QUIET]) == 0
    rc, out = _validate(tmp_path, capsys)
    assert rc == 0 and "[ok] same_kernel_backend: torch" in out
    path = tmp_path / "readbacks" / "rollout-0-rank0.json"
    rb = json.loads(path.read_text())
    rb["kernel_backend"] = "triton"  # as if the engine had run the Triton kernels and the trainer the torch ones
    path.write_text(json.dumps(rb))
    rc, out = _validate(tmp_path, capsys)
    assert rc == 1 and "[FAIL] same_kernel_backend: torch: trainer[0.0]; triton: rollout[0.0]" in out
