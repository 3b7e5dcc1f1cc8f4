"""Recipe discovery: every YAML file in the lockstep.recipes package is a recipe, named by its
file stem, described by its `recipe.description` key."""
from __future__ import annotations

from importlib import resources

import yaml

PACKAGE = "lockstep.recipes"
# Recipes are primary configs; the config groups live in another package. Hydra reads a search
# path only from the primary config, and recipes include each other, so the CLI adds it instead.
SEARCHPATH_OVERRIDE = "hydra.searchpath=[pkg://lockstep.configs]"


def recipe_files() -> dict[str, object]:
    root = resources.files(PACKAGE)
    return {p.name[:-5]: p for p in sorted(root.iterdir(), key=lambda p: p.name) if p.name.endswith(".yaml")}


def _recipe_block(name: str) -> dict:
    data = yaml.safe_load(recipe_files()[name].read_text()) or {}
    return data.get("recipe") or {}


def describe(name: str) -> str:
    return str(_recipe_block(name).get("description", "(no description)"))


def is_multirun_recipe(name: str) -> bool:
    """A sweep recipe (hydra.sweeper.params) sets recipe.multirun so that `lockstep run` sweeps."""
    return bool(_recipe_block(name).get("multirun", False))


def listing() -> str:
    names = recipe_files()
    width = max(map(len, names), default=0)
    return "\n".join(f"{n:<{width}}  {describe(n)}" for n in names)


class UnknownRecipe(ValueError):
    pass


def check_recipe(name: str) -> None:
    if name not in recipe_files():
        import difflib

        close = difflib.get_close_matches(name, list(recipe_files()), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownRecipe(f"unknown recipe {name!r}{hint}; valid recipes:\n{listing()}")
