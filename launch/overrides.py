"""Validation of command-line overrides before Hydra runs anything, so that a typo fails in a
second with the valid names listed (Hydra alone says only that a key is "not in struct")."""
from __future__ import annotations

import difflib
from importlib import resources

from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from lockstep.launch.recipes import PACKAGE, SEARCHPATH_OVERRIDE

CONFIGS_PACKAGE = "lockstep.configs"


class BadOverride(ValueError):
    pass


def config_groups() -> set[str]:
    """The config groups (folders of the lockstep.configs package)."""
    root = resources.files(CONFIGS_PACKAGE)
    return {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("_")}


def _first_value(o) -> str:
    """A sweep `k=a,b` is checked with its first value (every value of a choice sweep is a plain
    override of the same key, so the key check covers them all)."""
    if o.is_sweep_override():
        value = next(iter(o.sweep_string_iterator()))
        return f"{o.get_key_element()}={value}"
    return o.input_line


def compose_recipe(recipe: str, overrides: list[str] = ()) -> DictConfig:
    """The recipe's config as `lockstep run` would compose it (without running anything)."""
    with initialize_config_module(config_module=PACKAGE, version_base="1.3"):
        return compose(config_name=recipe, overrides=[SEARCHPATH_OVERRIDE, *overrides])


def _diagnose_key(cfg: DictConfig, key: str) -> str | None:
    node, path = cfg, []
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            where = ".".join(path) or "<top level>"
            valid = sorted(node.keys()) if isinstance(node, DictConfig) else []
            full = ".".join(path + [part])
            close = difflib.get_close_matches(part, valid, n=1)
            hint = f" (did you mean {'.'.join(path + [close[0]])!r}?)" if close else ""
            if not valid:
                return f"unknown key {full!r}: {where} is a value ({OmegaConf.select(cfg, where)!r}), not a section"
            return f"unknown key {full!r}{hint}; valid keys under {where}: {', '.join(map(str, valid))}"
        node, path = node[part], path + [part]
    return None


def check_overrides(recipe: str, overrides: list[str]) -> None:
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise BadOverride(f"cannot parse overrides: {e}") from None
    plain = [_first_value(o) for o in parsed]
    try:
        compose_recipe(recipe, plain)
        return
    except HydraException as e:
        error = str(e)
    # Find the offending key against the config composed with the group choices alone.
    group_keys = {o.key_or_group for o in parsed if o.key_or_group in config_groups() and not o.is_add()}
    groups = [p for o, p in zip(parsed, plain) if o.key_or_group in group_keys]
    try:
        base = compose_recipe(recipe, groups)
    except HydraException as e:
        raise BadOverride(str(e)) from None  # Hydra lists the available options of a group
    for o in parsed:
        key = o.key_or_group
        if o.is_add() or key.startswith("hydra") or key in group_keys:
            continue
        problem = _diagnose_key(base, key)
        if problem:
            raise BadOverride(f"{problem} (in override {o.input_line!r}; add new keys with '+{key}=...')")
    raise BadOverride(error)
