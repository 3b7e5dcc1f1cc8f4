"""Tuning sweep for the Triton attention forward on the GPU at hand (bf16, Qwen3-8B heads).

    python benchmarks/sweep_attention.py [--entries decode,prefill]

Decode (one query per request, 16-token pages in random order) at the rollout workload's shape
(batch 128, 600 keys) and at the decode table's corners, and a 4k-token prefill: every candidate
of kernels/_triton/attention.py's TUNING entry (num_stages x PREFETCH, the K/V load schedule; for
decode also the swapped or padded tile and the programs per SM) is checked bitwise against the
current table first, then timed with CUDA-graph replay. Tuning changes no bit (every candidate's
dots are wgmma, whose elements do not depend on the tile's shape or operand order); a candidate
that changes one is reported and never a winner.
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
# are loaded into registers during the block before. Decode also: SWAP (the dots' operands swapped,
# the heads as the MMA's N side, or the heads padded to 64 rows) and the programs per SM its grid aims for.
CANDIDATES = {
    "prefill": [dict(num_stages=s, PREFETCH=p) for p, stages in ((False, (2, 3, 4)), (True, (1, 3))) for s in stages],
    # (swapped tiles with num_stages=1 faulted on the H200, Triton 3.6: the launcher refuses them)
    "decode": [dict(SWAP=False, num_stages=3, PREFETCH=False, PROGRAMS_PER_SM=4)]
    + [dict(SWAP=True, num_stages=s, PREFETCH=False, PROGRAMS_PER_SM=n) for s in (2, 3, 4) for n in (2, 4)]
    + [dict(SWAP=True, num_stages=3, PREFETCH=True, PROGRAMS_PER_SM=4)],
}


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
    for cand in CANDIDATES[entry]:
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
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--entries", default="decode,prefill", help="TUNING entries to sweep (decode, prefill)")
    entries = p.parse_args().entries.split(",")
    with K.using_backend("triton"):
        if "decode" in entries:
            for batch, context in DECODE:
                sweep("decode", f"batch {batch} x {context} keys", _case(batch, context, 1))
        if "prefill" in entries:
            for tokens in PREFILL:
                sweep("prefill", f"{tokens}-token prompt", _case(1, tokens, tokens))


if __name__ == "__main__":
    main()
