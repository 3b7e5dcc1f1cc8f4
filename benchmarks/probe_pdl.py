"""Programmatic dependent launch (kernels/_triton/_pdl.py) on and off, side by side with the stock
baseline, on the decode-sized cells of issue 15's table: decode attention at small batches
(`paged_attention`, 16-key pages in random order, against the fastest torch SDPA backend on a
contiguous cache) and the decode-sized GEMMs (`linear` and `row_parallel_linear` against cuBLAS).

Each side is a CUDA graph of 10 back-to-back calls (_harness.paired_graph_ms: alternating turns,
the median kept), so with PDL each call's launch overlaps the call before it. The "after a torch
op" rows put a torch kernel that writes the call's input (an in-place multiply by one) before every
call on both sides: there lockstep's kernel follows a kernel that does not take PDL, as it does
behind stock ops in a model's step. Every PDL-on output is checked bit for bit against PDL off.

    python benchmarks/probe_pdl.py [--decode 1x1024,...] [--gemm o_proj:64,...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _harness import graph_ms_per_call, paired_graph_ms  # noqa: E402
from bench_attention import fastest_sdpa, sdpa  # noqa: E402
from sweep_attention import D, HEADS, KV_HEADS, paged_inputs  # noqa: E402

import lockstep.kernels as K  # noqa: E402
from lockstep.kernels._triton import _pdl  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}
TREE = {"o_proj", "down"}  # run through the row-parallel tree, as the model runs them


def _with(flag: bool, fn):
    """fn, launched with _pdl.ENABLED = flag (read at each launch, so at a graph's capture)."""
    def call():
        _pdl.ENABLED = flag
        try:
            return fn()
        finally:
            _pdl.ENABLED = True
    return call


def _row(label: str, base: tuple[float, str], fn, before=None) -> str:
    """A table row: fn with PDL off and on (and `before`, a torch op, ahead of each call on every side)."""
    def seq(f):
        return (lambda: (before(), f())[1]) if before else f
    off, on = _with(False, fn), _with(True, fn)
    same = torch.equal(off(), on())
    off_ms, on_ms = paired_graph_ms(seq(off), seq(on))
    base_ms, base_name = base
    return (f"| {label} | {base_name} | {base_ms * 1e3:.2f} | {off_ms * 1e3:.2f} | {on_ms * 1e3:.2f} | "
            f"{off_ms / on_ms:.3f} | {base_ms / off_ms:.3f} | {base_ms / on_ms:.3f} | {'same' if same else 'DIFFER'} |")


def decode_rows(case: str, after_op: bool) -> list[str]:
    batch, context = map(int, case.split("x"))
    args = paged_inputs(batch, context, 1)
    q = args[0]
    before = (lambda: q.mul_(1.0)) if after_op else None
    qb = q.view(batch, HEADS, 1, D)
    kb, vb = (torch.randn(batch, KV_HEADS, context, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if before:
        base = fastest_sdpa(graph_ms_per_call, lambda backend: (before(), sdpa(backend, qb, kb, vb, False))[1])
    else:
        base = fastest_sdpa(graph_ms_per_call, lambda backend: sdpa(backend, qb, kb, vb, False))
    del kb, vb
    label = f"decode {batch} x {context}" + (" after a torch op" if after_op else "")
    return [_row(label, base, lambda: K.paged_attention(*args), before)]


def gemm_rows(case: str, after_op: bool) -> list[str]:
    name, m = case.split(":")
    k, n = SHAPES[name]
    m = int(m)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    x = torch.randn(int(m), k, device="cuda", dtype=torch.bfloat16)
    before = (lambda: x.mul_(1.0)) if after_op else None
    ours = K.row_parallel_linear if name in TREE else K.linear

    def cublas():
        if before:
            before()
        return torch.matmul(x, w.t())
    base = (graph_ms_per_call(cublas), "cuBLAS")
    label = f"{name} ({'tree' if name in TREE else 'linear'}) M={m}" + (" after a torch op" if after_op else "")
    return [_row(label, base, lambda: ours(x, w), before)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode", default="1x1024,1x4096,1x16384,16x1024,64x4096")
    parser.add_argument("--gemm", default="qkv:1,qkv:64,o_proj:1,o_proj:8,o_proj:64,down:64")
    parser.add_argument("--after-op", default="1x1024,o_proj:64",
                        help="cases also timed behind a torch op that writes their input")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_pdl needs a CUDA device")
    print(f"device: {torch.cuda.get_device_name()}")
    print("| case | baseline | baseline us | PDL off us | PDL on us | off / on | baseline / off | baseline / on | bits |\n"
          "|---|---|---|---|---|---|---|---|---|")
    after = set(filter(None, args.after_op.split(",")))
    with K.using_backend("triton"):
        for case in filter(None, args.decode.split(",")):
            for row in decode_rows(case, False) + (decode_rows(case, True) if case in after else []):
                print(row, flush=True)
        for case in filter(None, args.gemm.split(",")):
            for row in gemm_rows(case, False) + (gemm_rows(case, True) if case in after else []):
                print(row, flush=True)


if __name__ == "__main__":
    main()
