"""Attention A/B: another revision's Triton attention module against this tree's, on the decode
table's shapes (sweep_attention.paged_inputs: bf16, Qwen3-8B heads, 16-key pages in random order),
paged prefills and training's varlen forward, paired CUDA-graph timing (the two sides alternate,
the median turn of each kept) and the outputs compared bit for bit (a revision of other numerics,
such as the twenty-eighth session's fma in the softmax, differs in every case: the column says
so, and the times stand).

    git show REV:kernels/_triton/attention.py > OLD.py      # here; carry OLD.py to the GPU host
    python benchmarks/ab_decode.py OLD.py[,VAR.py,...] [CASE,...]   # default: the decode table's corners
    (several other modules: each against this tree's, case by case, this tree's kernels compiled once)
    CASE: BxC (B requests of C keys, one query each: decode), BxCxQ (Q queries each: a paged
    prefill of the last Q of C keys), either with :H for H kv heads (a TP rank's share of the 8, 4
    query heads each; e.g. 23x4096:4), BxC+P (a mixed step: B decode requests of C keys and one request
    of C keys whose last P are its queries, a chunked prefill beside them), trainN (the training
    forward: N packed 4,096-token sequences; trainNxS: of S tokens)
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _harness import paired_graph_ms  # noqa: E402
from sweep_attention import paged_inputs, training_inputs  # noqa: E402
from lockstep.kernels._triton import attention as NEW  # noqa: E402

CASES = "1x1024,1x4096,1x16384,16x1024,16x4096,16x16384,64x1024,64x4096,64x16384,256x1024,128x600"


def _module(path: str, n: int):
    """The module at `path`, imported beside this tree's as the n-th other (its kernels are its own)."""
    spec = importlib.util.spec_from_file_location(f"lockstep.kernels._triton.attention_ab{n}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sides(case: str, old) -> list:
    """The two sides' calls of one CASE (module docstring), each returning the output."""
    if case.startswith("train"):
        n, _, seq = case[5:].partition("x")
        seq = int(seq or 4096)
        q, k, v, _, cu, scale = training_inputs(int(n or 4) * seq, seq)
        return [lambda m=m: m._varlen(q, k, v, cu, scale, seq)[0] for m in (old, NEW)]
    shape, _, kv_heads = case.partition(":")
    shape, _, prompt = shape.partition("+")
    batch, context, *queries = map(int, shape.split("x"))
    heads = [int(kv_heads)] if kv_heads else []
    if prompt:  # a mixed step: the batch's decode tokens and one more request's last `prompt` tokens
        q, k_cache, v_cache, table, seq_lens, qsl, scale, _, max_seq = paged_inputs(batch + 1, context, 1, *heads)
        g = torch.Generator(device="cuda").manual_seed(batch * 7 + context + int(prompt))  # (as paged_inputs')
        q = torch.cat([q[:batch], torch.randn(int(prompt), *q.shape[1:], device=q.device, dtype=q.dtype, generator=g)])
        qsl = torch.cat([qsl[:batch + 1], qsl[batch:batch + 1] + int(prompt)])
        args = (q, k_cache, v_cache, table, seq_lens, qsl, scale, int(prompt), max_seq)
    else:
        args = paged_inputs(batch, context, queries[0] if queries else 1, *heads)
    return [lambda m=m: m._paged(*args) for m in (old, NEW)]


def main() -> None:
    if len(sys.argv) < 2 or not torch.cuda.is_available():
        raise SystemExit(__doc__)
    others = {path: _module(path, n) for n, path in enumerate(sys.argv[1].split(","))}
    print("| case | other | other us | this tree us | other / this | bits |\n|---|---|---|---|---|---|")
    for case in (sys.argv[2] if len(sys.argv) > 2 else CASES).split(","):
        for path, old in others.items():
            sides = _sides(case, old)
            same = torch.equal(sides[0](), sides[1]()) and torch.equal(sides[1](), sides[1]())
            a, b = paired_graph_ms(*sides)
            print(f"| {case} | {path} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.3f} | {'same' if same else 'DIFFER'} |",
                  flush=True)
            del sides
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
