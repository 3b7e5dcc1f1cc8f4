"""Prompt datasets in the dapo-math-17k jsonl layout: one record per line with `prompt` (a string,
or a list of chat messages {role, content}) and `label` (the reference answer)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from lockstep.framework.data.synthetic import task_path

BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class PromptRecord:
    index: int  # position in the file: the prompt's stable id (used for per-sample seeds)
    prompt: str
    label: str


def resolve_path(path: str) -> Path:
    if path.startswith(BUILTIN_PREFIX):
        return task_path(path[len(BUILTIN_PREFIX):])
    return Path(path).expanduser()


def _prompt_text(prompt, where: str) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt):
        return "\n".join(str(m["content"]) for m in prompt)
    raise ValueError(f"{where}: `prompt` must be a string or a list of {{role, content}} messages")


def load_records(path: str, prompt_key: str = "prompt", label_key: str = "label") -> list[PromptRecord]:
    file = resolve_path(path)
    if not file.exists():
        raise FileNotFoundError(f"prompt dataset {file} does not exist")
    records = []
    with file.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{file}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            missing = [k for k in (prompt_key, label_key) if k not in obj]
            if missing:
                raise ValueError(f"{where}: missing key(s) {missing}; record has {sorted(obj)}")
            records.append(PromptRecord(len(records), _prompt_text(obj[prompt_key], where), str(obj[label_key])))
    if not records:
        raise ValueError(f"prompt dataset {file} is empty")
    return records


class PromptSampler:
    """Endless batches of prompts: each epoch is a seeded permutation of the records."""

    def __init__(self, records: list[PromptRecord], seed: int, shuffle: bool = True):
        self.records, self.seed, self.shuffle = records, seed, shuffle
        self.epoch, self._order, self._cursor = 0, self._permutation(0), 0

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.records)))
        return torch.randperm(len(self.records), generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def next_batch(self, n: int) -> list[PromptRecord]:
        batch = []
        while len(batch) < n:
            if self._cursor == len(self._order):
                self.epoch += 1
                self._order, self._cursor = self._permutation(self.epoch), 0
            batch.append(self.records[self._order[self._cursor]])
            self._cursor += 1
        return batch
