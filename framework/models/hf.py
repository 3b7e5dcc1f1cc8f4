"""Hugging Face checkpoint directories: read (config, sharded safetensors, generation config) and
write (sharded, with an index) what transformers' `from_pretrained` loads.

Reading streams: `CheckpointReader.tensors(names)` opens only the shard files that hold those names
and reads only those tensors, so a trainer can load a model layer by layer (and a tensor-parallel
rank can slice each tensor as it arrives) without the whole model in memory at once.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read as a Qwen3 HF checkpoint (the message names the file)."""


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def is_hf_checkpoint(path: str | Path) -> bool:
    p = Path(path)
    return (p / CONFIG_FILE).exists() and ((p / SINGLE_FILE).exists() or (p / INDEX_FILE).exists())


class CheckpointReader:
    """The weights of an HF directory: `model.safetensors`, or shards listed by
    `model.safetensors.index.json`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if (self.path / INDEX_FILE).exists():
            index = read_json(self.path / INDEX_FILE)
            if "weight_map" not in index:
                raise CheckpointError(f"{self.path / INDEX_FILE} has no weight_map")
            self.file_of = dict(index["weight_map"])
            missing = sorted({f for f in self.file_of.values() if not (self.path / f).exists()})
            if missing:
                raise CheckpointError(f"{self.path / INDEX_FILE} names shard files that are not there: {missing}")
        elif (self.path / SINGLE_FILE).exists():
            with safe_open(str(self.path / SINGLE_FILE), "pt") as f:
                self.file_of = {k: SINGLE_FILE for k in f.keys()}
        else:
            raise CheckpointError(f"{self.path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")

    @property
    def names(self) -> set[str]:
        return set(self.file_of)

    def tensors(self, names: Iterable[str], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The named tensors, reading only the shard files (and tensors) they live in."""
        names = list(names)
        absent = [n for n in names if n not in self.file_of]
        if absent:
            raise CheckpointError(f"{self.path}: the checkpoint has no tensor(s) {absent[:5]}")
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.file_of[n], []).append(n)
        out = {}
        for file, group in by_file.items():
            with safe_open(str(self.path / file), "pt", device=str(device)) as f:
                for n in group:
                    out[n] = f.get_tensor(n)
        return out


class CheckpointWriter:
    """Writes named tensors as they come into shards of at most `max_shard_bytes` (one file when they
    all fit, as transformers names it), then the index."""

    def __init__(self, path: str | Path, max_shard_bytes: int = 5 * 2**30):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[dict[str, torch.Tensor] | list[str]] = []
        self._total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        n = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + n > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += n
        self._total += n

    def _flush(self) -> None:
        part = len(self._shards)
        save_file(self._pending, str(self.path / f"part-{part}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        if self._pending or not self._shards:
            self._flush()
        count = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = SINGLE_FILE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            (self.path / f"part-{i}.tmp").rename(self.path / final)
            weight_map.update({n: final for n in names})
        if count > 1:
            (self.path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": self._total},
                                                            "weight_map": dict(sorted(weight_map.items()))}, indent=2))
