"""Backends picked by config name. An unknown or unavailable backend raises an error that lists
every valid name and, for each one that cannot be imported here, why."""
from __future__ import annotations

import importlib


class BackendRegistry:
    def __init__(self, kind: str, entries: dict[str, str]):
        self.kind, self.entries = kind, dict(entries)  # name -> "package.module:Class"

    def _import(self, name: str):
        module, _, attr = self.entries[name].partition(":")
        return getattr(importlib.import_module(module), attr)

    def availability(self) -> dict[str, str | None]:
        out = {}
        for name in self.entries:
            try:
                self._import(name)
                out[name] = None
            except ImportError as e:
                out[name] = f"{type(e).__name__}: {e}"
        return out

    def _describe(self) -> str:
        return "; ".join(name if why is None else f"{name} (unavailable: {why})"
                         for name, why in self.availability().items())

    def get(self, name: str):
        if name not in self.entries:
            raise ValueError(f"unknown {self.kind} backend {name!r}; valid: {self._describe()}")
        try:
            return self._import(name)
        except ImportError as e:
            raise ImportError(f"{self.kind} backend {name!r} cannot be imported ({e}); "
                              f"valid: {self._describe()}") from e
