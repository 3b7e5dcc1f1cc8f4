"""Character-level tokenizer built locally from the task's own text (nothing is downloaded).

Ids: 0 <pad>, 1 <bos>, 2 <eos>, then the characters in sorted order. Saved beside each run's
checkpoint as tokenizer.json so a run can be reloaded with the exact same ids.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
TOKENIZER_FILE = "tokenizer.json"


class CharTokenizer:
    kind = "char"

    def __init__(self, chars: Iterable[str]):
        chars = list(chars)
        if len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars):
            raise ValueError("CharTokenizer needs distinct single characters")
        self.vocab = list(SPECIAL_TOKENS) + chars
        self._ids = {c: i for i, c in enumerate(self.vocab)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    @classmethod
    def build(cls, texts: Iterable[str]) -> "CharTokenizer":
        return cls(sorted(set("".join(texts))))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        unknown = sorted({c for c in text if c not in self._ids})
        if unknown:
            raise ValueError(f"characters {unknown} are not in the tokenizer's vocabulary "
                             f"({''.join(self.vocab[len(SPECIAL_TOKENS):])!r})")
        return ([self.bos_id] if add_bos else []) + [self._ids[c] for c in text]

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.vocab[i] for i in ids if i >= len(SPECIAL_TOKENS))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"type": self.kind, "vocab": self.vocab}, ensure_ascii=False))

    @classmethod
    def load(cls, path: str | Path) -> "CharTokenizer":
        data = json.loads(Path(path).read_text())
        if data.get("type") != cls.kind or tuple(data["vocab"][:3]) != SPECIAL_TOKENS:
            raise ValueError(f"{path} is not a lockstep char tokenizer")
        return cls(data["vocab"][len(SPECIAL_TOKENS):])


def tokenizer_for(texts: Iterable[str], init_from: str | None) -> CharTokenizer:
    """The checkpoint's tokenizer when starting from one (ids must not move), else one built from
    the dataset's text."""
    if init_from:
        path = Path(init_from) / TOKENIZER_FILE
        if not path.exists():
            raise FileNotFoundError(f"{init_from} has no {TOKENIZER_FILE}; lockstep checkpoints carry one")
        return CharTokenizer.load(path)
    return CharTokenizer.build(texts)
