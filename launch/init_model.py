"""`lockstep init-model --like MODEL --out DIR [--seed N] [--tokenizer-vocab N] [--max-shard-mb N] [KEY=VALUE ...]`

Writes a random-init Hugging Face Qwen3 directory (config.json, safetensors shards with their
index, a tokenizer trained here on lockstep's math sample with Qwen's special tokens and chat
layout, generation_config.json) so that recipes taking `model.init_from` can be tried without
downloading weights. MODEL is a model group (configs/model/*.yaml: qwen3-0.6b, qwen3-1.7b, ...);
KEY=VALUE overrides its shape (num_hidden_layers=2 hidden_size=128 ...). The weights are the native
model's seeded initialisation, in the group's dtype (model.dtype, or dtype=...).
"""
from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

import yaml

USAGE = __doc__.split("\n\n")[0]


def _groups() -> dict[str, object]:
    root = resources.files("lockstep.configs") / "model"
    return {p.name[:-5]: p for p in root.iterdir() if p.name.endswith(".yaml")}


def _value(text: str):
    return yaml.safe_load(text)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lockstep init-model", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--like", required=True, help="the model group whose shape to take")
    p.add_argument("--out", required=True, help="the directory to write (must not hold a checkpoint)")
    p.add_argument("--seed", type=int, default=1, help="seed of the random initialisation (default 1)")
    p.add_argument("--tokenizer-vocab", type=int, default=2048, help="tokens of the trained tokenizer (default 2048)")
    p.add_argument("--max-shard-mb", type=float, default=5 * 1024, help="largest safetensors shard (default 5 GiB)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="shape overrides, e.g. num_hidden_layers=2")
    args = p.parse_args(argv)

    groups = _groups()
    if args.like not in groups:
        print(f"lockstep init-model: unknown model {args.like!r}; valid: {', '.join(sorted(groups))}", file=sys.stderr)
        return 2
    group = yaml.safe_load(groups[args.like].read_text())
    for o in args.overrides:
        key, sep, value = o.partition("=")
        key = key.removeprefix("model.")
        if not sep or key not in group or key in ("init_from", "pad_vocab_multiple"):
            valid = sorted(k for k in group if k not in ("init_from", "pad_vocab_multiple"))
            print(f"lockstep init-model: bad override {o!r}; valid keys: {', '.join(valid)}", file=sys.stderr)
            return 2
        group[key] = _value(value)
    out = Path(args.out)
    from lockstep.framework.models.hf import is_hf_checkpoint

    if is_hf_checkpoint(out):
        print(f"lockstep init-model: {out} already holds a checkpoint; choose another --out", file=sys.stderr)
        return 2

    import torch

    from lockstep.framework.data.dataset import load_records
    from lockstep.framework.data.tokenizer import train_tokenizer
    from lockstep.framework.models.ops import ALL_P, build_ops
    from lockstep.framework.models.qwen3 import SHAPE_KEYS, Qwen3Config, Qwen3ForCausalLM

    texts = [r.text() + " " + r.label for r in load_records("builtin:math_sample", label_key="auto").records]
    tokenizer = train_tokenizer(texts + ["0123456789 +-*/=()[]{}<>.,;:!?"], out, args.tokenizer_vocab)
    vocab = group["vocab_size"]
    if vocab == "auto":
        multiple = int(group.get("pad_vocab_multiple", 16))
        vocab = -(-tokenizer.vocab_size // multiple) * multiple
    if vocab < tokenizer.vocab_size:
        print(f"lockstep init-model: vocab_size={vocab} < the tokenizer's {tokenizer.vocab_size} tokens", file=sys.stderr)
        return 2
    shape = {k: group[k] for k in SHAPE_KEYS if k in group}
    cfg = Qwen3Config(**{**shape, "vocab_size": int(vocab), "initializer_range": group.get("initializer_range", 0.02)})
    dtype = group.get("dtype", "float32")
    model = Qwen3ForCausalLM(cfg, build_ops(ALL_P))
    model.init_weights(args.seed)
    model.to(getattr(torch, dtype))
    model.save_pretrained(out, max_shard_bytes=int(args.max_shard_mb * 2**20))
    n = sum(t.numel() for t in model.hf_state_dict().values())
    print(f"wrote {out}: Qwen3 like {args.like} ({n / 1e6:.1f}M parameters, {dtype}), tokenizer of "
          f"{tokenizer.vocab_size} tokens (vocab_size {vocab}), seed {args.seed}")
    return 0
