"""Tokenizers: a checkpoint's own (Hugging Face, through `transformers`) or, for the synthetic
digit task, a character-level one built locally from the task's text.

Both answer the same questions: `encode_prompt` (a string, or a list of chat messages rendered
with the chat template, `add_generation_prompt=True`), `decode`, `vocab_size` (the real ids; a
model's padded vocab beyond them is masked), `eos_ids` (generation stops at any of them: from the
checkpoint's generation_config.json), `pad_id`, `token(id)` (for reports) and `save(dir)` (beside
each checkpoint, so a run can be reloaded with the exact same ids).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"


class TokenizerError(ValueError):
    pass


class CharTokenizer:
    """Ids: 0 <pad>, 1 <bos>, 2 <eos>, then the characters in sorted order."""
    kind = "char"

    def __init__(self, chars: Iterable[str]):
        chars = list(chars)
        if len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars):
            raise ValueError("CharTokenizer needs distinct single characters")
        self.vocab = list(SPECIAL_TOKENS) + chars
        self._ids = {c: i for i, c in enumerate(self.vocab)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.eos_ids = [self.eos_id]

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

    def encode_prompt(self, prompt: str | list[dict]) -> list[int]:
        if not isinstance(prompt, str):
            raise TokenizerError("the character tokenizer has no chat template: use a string prompt, or a "
                                 "checkpoint's tokenizer (model.init_from) for message lists")
        return self.encode(prompt)

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.vocab[i] for i in ids if i >= len(SPECIAL_TOKENS))

    def token(self, i: int) -> str:
        return self.vocab[i]

    def save(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / TOKENIZER_FILE).write_text(json.dumps({"type": self.kind, "vocab": self.vocab}, ensure_ascii=False))

    @classmethod
    def load(cls, file: str | Path) -> "CharTokenizer":
        data = json.loads(Path(file).read_text())
        if data.get("type") != cls.kind or tuple(data["vocab"][:3]) != SPECIAL_TOKENS:
            raise ValueError(f"{file} is not a lockstep char tokenizer")
        return cls(data["vocab"][len(SPECIAL_TOKENS):])


class HFTokenizer:
    """A checkpoint's tokenizer (tokenizer.json + tokenizer_config.json, with its chat template),
    loaded by transformers' AutoTokenizer; EOS ids from generation_config.json when present."""
    kind = "hf"

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.path = Path(path)
        try:
            self.tok = AutoTokenizer.from_pretrained(str(self.path))
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds; the path is what matters
            raise TokenizerError(f"{self.path}: transformers could not load the tokenizer ({type(e).__name__}: {e})") from e
        self.eos_ids = self._eos_ids()
        pad = self.tok.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]

    def _eos_ids(self) -> list[int]:
        gen = self.path / GENERATION_CONFIG_FILE
        ids = json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else None
        if ids is None:
            ids = self.tok.eos_token_id
        if ids is None:
            raise TokenizerError(f"{self.path}: no EOS token (neither {GENERATION_CONFIG_FILE} nor the tokenizer "
                                 f"names one): generation could never stop")
        return [int(i) for i in (ids if isinstance(ids, list) else [ids])]

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    @property
    def eos_id(self) -> int:
        return self.eos_ids[0]

    def encode_prompt(self, prompt: str | list[dict]) -> list[int]:
        if isinstance(prompt, str):
            return self.tok.encode(prompt, add_special_tokens=False)
        if not self.tok.chat_template:
            raise TokenizerError(f"{self.path}: the tokenizer has no chat template, but a prompt is a message list")
        ids = self.tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def token(self, i: int) -> str:
        return self.tok.convert_ids_to_tokens(int(i))

    def save(self, path: str | Path) -> None:
        self.tok.save_pretrained(str(path))
        gen = self.path / GENERATION_CONFIG_FILE
        if gen.exists():
            (Path(path) / GENERATION_CONFIG_FILE).write_text(gen.read_text())


def is_char_tokenizer(file: Path) -> bool:
    try:
        return json.loads(file.read_text()).get("type") == CharTokenizer.kind
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False


def tokenizer_for(texts: Iterable[str], init_from: str | None):
    """The checkpoint's tokenizer when starting from one (ids must not move): lockstep's character
    tokenizer, or an HF one; else a character tokenizer built from the dataset's text."""
    if init_from:
        file = Path(init_from) / TOKENIZER_FILE
        if not file.exists():
            raise FileNotFoundError(f"model.init_from={init_from}: no {TOKENIZER_FILE} (an HF checkpoint "
                                    f"carries its tokenizer; lockstep init-model writes one)")
        return CharTokenizer.load(file) if is_char_tokenizer(file) else HFTokenizer(init_from)
    return CharTokenizer.build(texts)


# ---- a tokenizer for checkpoints made here (lockstep init-model, tests) -------------------------
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen's chat layout, without tools or thinking blocks
CHAT_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                 "{%- endif %}")


def train_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 1024) -> HFTokenizer:
    """A byte-level BPE tokenizer trained here with `tokenizers` on `texts` (deterministic), with
    Qwen's special tokens and chat layout, saved as an HF tokenizer (tokenizer.json,
    tokenizer_config.json) with a generation_config.json whose EOS ids are <|im_end|> and
    <|endoftext|>. For checkpoints made without downloads; real checkpoints bring their own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(QWEN_SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    ids = [fast.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    (out / GENERATION_CONFIG_FILE).write_text(json.dumps({"eos_token_id": ids, "pad_token_id": ids[1]}, indent=2))
    return HFTokenizer(out)
