"""Prompt datasets in the dapo-math-17k jsonl layout: one record per line with `prompt` (a string,
or a list of chat messages {role, content}, rendered with the tokenizer's chat template) and the
reference answer (`reward_model.ground_truth` as in dapo-math-17k, or `label`).

Every problem with a row is an error naming file:line (undecodable bytes included); with
`data.skip_bad_rows=true` bad rows are skipped instead, and how many were skipped is returned for
the run log, never silently.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lockstep.framework.data.synthetic import task_path

BUILTIN_PREFIX = "builtin:"
AUTO_LABEL_KEYS = ("reward_model.ground_truth", "label")


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class PromptRecord:
    index: int  # position in the file: the prompt's stable id (used for per-sample seeds)
    prompt: str | tuple  # a string, or chat messages as ((role, content), ...)
    label: str

    def messages(self) -> list[dict] | None:
        return None if isinstance(self.prompt, str) else [{"role": r, "content": c} for r, c in self.prompt]

    def text(self) -> str:
        """The prompt's text (message contents joined), for rewards and char vocabularies."""
        return self.prompt if isinstance(self.prompt, str) else "\n".join(c for _, c in self.prompt)


@dataclass
class Dataset:
    records: list[PromptRecord]
    path: Path
    skipped: list[str] = field(default_factory=list)  # "file:line: why" of every skipped row


def resolve_path(path: str) -> Path:
    if path.startswith(BUILTIN_PREFIX):
        return task_path(path[len(BUILTIN_PREFIX):])
    return Path(path).expanduser()


def _get(obj: dict, dotted: str):
    cur = obj
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(dotted)
        cur = cur[part]
    return cur


def _prompt(value, where: str):
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                 and isinstance(m.get("role"), str) for m in value):
        return tuple((m["role"], m["content"]) for m in value)
    raise DataError(f"{where}: the prompt must be a string or a non-empty list of {{role, content}} messages")


def _label(obj: dict, label_key: str, where: str) -> str:
    keys = AUTO_LABEL_KEYS if label_key == "auto" else (label_key,)
    for key in keys:
        try:
            value = _get(obj, key)
        except KeyError:
            continue
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if not isinstance(value, (str, int, float)):
            raise DataError(f"{where}: the answer at {key!r} is {type(value).__name__}, not a string or number")
        return str(value)
    raise DataError(f"{where}: no answer at {' or '.join(map(repr, keys))}; the row has keys {sorted(obj)}")


def load_records(path: str, prompt_key: str = "prompt", label_key: str = "label", skip_bad_rows: bool = False) -> Dataset:
    file = resolve_path(path)
    if not file.exists():
        raise FileNotFoundError(f"prompt dataset {file} does not exist")
    records, skipped = [], []
    with file.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{file}:{lineno}"
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{where}: not UTF-8 (byte {e.start}: {raw[e.start:e.start + 4]!r})") from None
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: not valid JSON ({e})") from None
                if not isinstance(obj, dict):
                    raise DataError(f"{where}: a row must be a JSON object, got {type(obj).__name__}")
                try:
                    prompt = _get(obj, prompt_key)
                except KeyError:
                    raise DataError(f"{where}: no prompt at {prompt_key!r}; the row has keys {sorted(obj)}") from None
                records.append(PromptRecord(len(records), _prompt(prompt, where), _label(obj, label_key, where)))
            except DataError as e:
                if not skip_bad_rows:
                    raise
                skipped.append(str(e))
    if not records:
        raise DataError(f"prompt dataset {file} has no usable rows" + (f" ({len(skipped)} skipped)" if skipped else ""))
    return Dataset(records, file, skipped)


class PromptSampler:
    """Endless batches of prompts: each epoch is a seeded permutation of the records."""

    def __init__(self, records: list[PromptRecord], seed: int, shuffle: bool = True):
        self.records, self.seed, self.shuffle = records, seed, shuffle
        self.epoch, self._order, self._cursor = 0, self._permutation(0), 0

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.records)))
        return torch.randperm(len(self.records), generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self._cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self._cursor = state["epoch"], state["cursor"]
        self._order = self._permutation(self.epoch)

    def next_batch(self, n: int) -> list[PromptRecord]:
        batch = []
        while len(batch) < n:
            if self._cursor == len(self._order):
                self.epoch += 1
                self._order, self._cursor = self._permutation(self.epoch), 0
            batch.append(self.records[self._order[self._cursor]])
            self._cursor += 1
        return batch
