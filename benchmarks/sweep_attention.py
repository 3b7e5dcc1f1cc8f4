"""Tuning sweep for the Triton attention forward on the GPU at hand (bf16, Qwen3-8B heads).

    python benchmarks/sweep_attention.py

Decode (one query per request, 16-token pages in random order) at the rollout workload's shape
(batch 128, 600 keys) and at the decode table's corners, and a 4k-token prefill: every candidate
of kernels/_triton/attention.py's TUNING entry (num_stages x PREFETCH, the K/V load schedule) is
checked bitwise against the current table first, then timed with CUDA-graph replay. Tuning
changes no bit (the MMA instructions are fixed by the tile's row count); a candidate that changes
one is reported and never a winner.
"""
from __future__ import annotations

import math

import torch
import triton

from _harness import graph_ms_per_call
import lockstep.kernels as K
from lockstep.kernels._triton import attention as A

HEADS, KV_HEADS, D, PAGE = 32, 8, 128, 16
DECODE = [(128, 600), (1, 4096), (16, 4096), (64, 4096), (256, 1024)]
PREFILL = [4096]
# PREFETCH False: Triton's pipeliner schedules the K/V loads (num_stages); True: each block's K and V
# are loaded into registers during the block before
CANDIDATES = [dict(num_stages=s, PREFETCH=p) for p, stages in ((False, (2, 3, 4)), (True, (1, 3))) for s in stages]


def _case(batch: int, context: int, queries: int):
    g = torch.Generator(device="cuda").manual_seed(batch * 7 + context)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    pages = batch * triton.cdiv(context, PAGE)
    k_cache, v_cache = r(pages, KV_HEADS, PAGE, D), r(pages, KV_HEADS, PAGE, D)
    table = torch.randperm(pages, device="cuda", dtype=torch.int32, generator=g).view(batch, -1)
    q = r(batch * queries, HEADS, D)
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * queries
    return lambda: K.paged_attention(q, k_cache, v_cache, table, seq_lens, qsl, 1 / math.sqrt(D), queries, context)


def sweep(entry: str, name: str, fn) -> None:
    default = dict(A.TUNING[entry])
    want = fn()
    base = graph_ms_per_call(fn) * 1e3
    scored = []
    for cand in CANDIDATES:
        A.TUNING[entry] = {**default, **cand}
        try:
            same = torch.equal(fn(), want)
            us = graph_ms_per_call(fn) * 1e3
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile is not a winner
            print(f"  {entry} {name} {cand}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
            continue
        finally:
            A.TUNING[entry] = default
        print(f"  {entry} {name} {cand}: {us:.1f} us ({base / us:.3f}x the current table){'' if same else ' BITS DIFFER'}",
              flush=True)
        if same:
            scored.append((us, cand))
    us, best = min(scored, key=lambda t: t[0])
    print(f"BEST {entry} {name}: {best} {us:.1f} us vs current {base:.1f} us ({base / us:.3f}x)", flush=True)


def main() -> None:
    with K.using_backend("triton"):
        for batch, context in DECODE:
            sweep("decode", f"batch {batch} x {context} keys", _case(batch, context, 1))
        for tokens in PREFILL:
            sweep("prefill", f"{tokens}-token prompt", _case(1, tokens, tokens))


if __name__ == "__main__":
    main()
