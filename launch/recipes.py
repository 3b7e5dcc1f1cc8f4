"""Recipe discovery: every YAML file in the lockstep.recipes package is a recipe, named by its
file stem, described by its `recipe.description` key."""
from __future__ import annotations

from importlib import resources

import yaml

PACKAGE = "lockstep.recipes"


def recipe_files() -> dict[str, object]:
    root = resources.files(PACKAGE)
    return {p.name[:-5]: p for p in sorted(root.iterdir(), key=lambda p: p.name) if p.name.endswith(".yaml")}


def describe(name: str) -> str:
    data = yaml.safe_load(recipe_files()[name].read_text()) or {}
    return str((data.get("recipe") or {}).get("description", "(no description)"))


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
