"""Config composition, recipe listing and the errors a user sees for bad input."""
import pytest

from lockstep.framework import settings
from lockstep.launch import cli
from lockstep.launch.overrides import BadOverride, check_overrides, compose_recipe
from lockstep.launch.recipes import UnknownRecipe, check_recipe, listing


def _compose(overrides=()):
    return compose_recipe("tiny-cpu", list(overrides))


def test_tiny_cpu_composes_every_group():
    cfg = _compose()
    for group in ("model", "actor", "rollout", "parallel", "algo", "data", "determinism", "logger"):
        assert group in cfg, group
    assert cfg.determinism.mode == "strict"
    assert cfg.logger.wandb.mode == "offline"
    settings.validate(cfg)


def test_overrides_apply_and_groups_switch():
    cfg = _compose(["rollout.n_samples=4", "determinism=off", "seed=7"])
    assert cfg.rollout.n_samples == 4 and cfg.seed == 7
    assert cfg.determinism.mode == "off"  # the quoted "off", not YAML's boolean false
    assert _compose(["determinism.mode=off"]).determinism.mode == "off"


def test_recipes_listing_and_unknown_recipe():
    names = [line.split()[0] for line in listing().splitlines()]
    assert names == ["ablation-tiny", "qwen3-0.6b", "qwen3-1.7b-1gpu", "qwen3-1.7b", "tiny-cpu"]
    with pytest.raises(UnknownRecipe, match=r"did you mean 'tiny-cpu'.*\n.*tiny-cpu"):
        check_recipe("tiny-cpuu")


@pytest.mark.parametrize("override,expected", [
    ("rollout.tmperature=0.5", r"unknown key 'rollout.tmperature' \(did you mean 'rollout.temperature'\?\); "
                               r"valid keys under rollout: .*temperature"),
    ("foo=1", r"unknown key 'foo'; valid keys under <top level>: actor, algo"),
    ("rollout.temperature.x=1", r"rollout.temperature is a value"),
    ("rollout=nope", r"Available options in 'rollout'"),
    ("rollout.n_samples=", r"."),  # empty value parses, so this one is accepted by Hydra (None)
])
def test_bad_overrides_name_the_valid_choices(override, expected):
    if override.endswith("="):
        check_overrides("tiny-cpu", [override])
        return
    with pytest.raises(BadOverride, match=expected):
        check_overrides("tiny-cpu", [override])


def test_sweep_overrides_are_checked_too():
    check_overrides("tiny-cpu", ["determinism=strict,off", "seed=1,2"])
    with pytest.raises(BadOverride, match="unknown key 'sed'"):
        check_overrides("tiny-cpu", ["sed=1,2"])


@pytest.mark.parametrize("override,expected", [
    ("determinism.mode=bogus", r"determinism.mode='bogus' is not valid; choose one of: off, auto, strict, audit"),
    ("rollout.n_samples=1", r"n_samples >= 2"),
    ("parallel.tp=2", r"native actor runs unsharded"),
    ("rollout.num_engines=0", r"num_engines must be >= 1"),
    ("determinism.inject_fault=typo", r"choose one of: none, rollout_logp_reversed_vocab"),
])
def test_semantic_validation(override, expected):
    with pytest.raises(settings.ConfigError, match=expected):
        settings.validate(_compose([override]))


def test_cli_exit_codes(capsys):
    assert cli.main(["recipes"]) == 0
    assert "tiny-cpu" in capsys.readouterr().out
    assert cli.main(["run", "tiny-cpu", "rollout.tmperature=1"]) == 2
    assert "did you mean 'rollout.temperature'" in capsys.readouterr().err
    assert cli.main(["run", "no-such-recipe"]) == 2
    assert cli.main(["frobnicate"]) == 2
