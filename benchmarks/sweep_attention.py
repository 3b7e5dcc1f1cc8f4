"""Tuning sweep for the Triton attention kernels on the GPU at hand (bf16, Qwen3-8B heads).

    python benchmarks/sweep_attention.py [--entries decode,prefill,prefill_linear,bwd_dkdv,bwd_dq]
                                         [--train-seqs N] [--decode-cases BxC,...] [--page KEYS]
                                         [--only KEY=VALUE[|VALUE...]]
                                         [--contract KEY=VALUE[,KEY=VALUE]] ...

Decode (one query per request, 16-token pages in random order, --page: another size; the cache
lockstep's vLLM backend allocates) at the rollout workload's shape
(batch 128, 600 keys) and at the decode table's corners (or --decode-cases), a 4k-token prefill (paged), and training's
forward and backward (varlen, N = 4 packed 4,096-token sequences by default, bench_attention.py's
larger training row; N = 1 its smaller one). Every candidate of kernels/_triton/attention.py's
TUNING entry (num_stages x PREFETCH x TMA, the K/V load schedule; GLUON, the warp-specialised forms
of the training forward and dK/dV, and their rings; for decode also the swapped or padded tile and
the programs per SM; for the backward the tiles) is checked against the current
table first, then timed as bench_attention.py's tables time them: CUDA-graph replay of 10 calls.
Forward tuning changes no bit (every
candidate's dots are wgmma, whose elements do not depend on the tile's shape or operand order): a
forward candidate that changes one is reported and never a winner. Backward tiles set the order of
the gradient sums, so a backward candidate's gradients are checked against the current table's to
a bf16 tolerance instead, and for determinism (two calls, the same bits).

--contract (repeated: each a contract) times the forward entries' current tables under other
values of the contract's block sizes (KV_CHUNK, KV_BLOCK: kernels/_triton/attention.py reads them at
call time) against the current ones, in place of the candidate sweep: what a contract change would
give prefill and training and cost decode (its merge every KV_CHUNK keys, its decode programs a
request). Other contracts give other bits by design, so nothing is bit-checked there; that every
kernel agrees under a new contract is the GPU tests' part (run them under it before adopting it).
"""
from __future__ import annotations

import math

import torch

from _harness import graph_ms_per_call
from bench_attention import paged_cache
import lockstep.kernels as K
from lockstep.kernels._triton import attention as A

HEADS, KV_HEADS, D, PAGE = 32, 8, 128, 16
DECODE = [(128, 600), (1, 4096), (16, 4096), (64, 4096), (256, 1024)]
PREFILL = [4096]
# PREFETCH False: Triton's pipeliner schedules the K/V loads (num_stages); True: each block's K and V
# are loaded into registers during the block before. Decode also: SWAP (the dots' operands swapped,
# the heads as the MMA's N side, or the heads padded to 64 rows) and the programs per SM its grid aims for.
CANDIDATES = {
    "prefill": [dict(GLUON=False, num_stages=s, PREFETCH=p) for p, stages in ((False, (2, 3, 4)), (True, (1, 3)))
                for s in stages]
    # the warp-specialised Gluon kernel over the pages (boxes of a page), a ring of GLUON_STAGES blocks
    + [dict(GLUON=True, GLUON_STAGES=s) for s in (2, 3, 4)]
    # GLUON_Q_REGS: the consumers' q in registers (the q.k wgmmas read only K from shared memory)
    + [dict(GLUON=True, GLUON_STAGES=s, GLUON_Q_REGS=True) for s in (3, 4, 5)],
    # (swapped tiles with num_stages=1 faulted on the H200, Triton 3.6: the launcher refuses them)
    # TMA: the blocks before a tile's last through descriptors, pipelined over num_stages
    # (GLUON=False: the tl kernel, whose schedules these are)
    "prefill_linear": [dict(GLUON=False, TMA=True, PREFETCH=False, num_stages=s) for s in (2, 3, 4)]
    + [dict(GLUON=False, TMA=False, PREFETCH=True, num_stages=1), dict(GLUON=False, TMA=False, PREFETCH=False,
                                                                       num_stages=3)]
    # 64-row tiles on one warpgroup: two programs an SM, each one's softmax beside the other's MMAs
    + [dict(GLUON=False, TMA=True, PREFETCH=False, BLOCK_Q=64, num_warps=4, num_stages=s) for s in (2, 3, 4)]
    # the warp-specialised Gluon kernel: a producer warp, two consumer warpgroups, a ring of GLUON_STAGES
    + [dict(GLUON=True, GLUON_STAGES=s) for s in (2, 3, 4)]
    + [dict(GLUON=True, GLUON_STAGES=s, GLUON_Q_REGS=True) for s in (3, 4, 5)],
    # one program per BLOCK_KV keys looping over BLOCK_Q-row query tiles / one per BLOCK_Q rows over
    # BLOCK_KV-key blocks
    "bwd_dkdv": [dict(BLOCK_KV=kv, BLOCK_Q=bq, num_warps=w, num_stages=st, GLUON=False)
                 for kv, bq, w, st in ((64, 64, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 8, 3),
                                       (64, 32, 4, 4), (64, 32, 4, 3), (64, 64, 4, 4), (128, 64, 4, 3))]
    # the warp-specialised Gluon dK/dV (128 keys, two consumer warpgroups of 64, 64-row query tiles
    # through TMA): the table's sums at BLOCK_Q 64
    + [dict(GLUON=True, GLUON_STAGES=s) for s in (2, 3, 4)],
    # TMA: the blocks before a tile's last through descriptors
    "bwd_dq": [dict(BLOCK_Q=bq, BLOCK_KV=kv, num_warps=w, num_stages=st, TMA=tma, GLUON=False)
               for bq, kv, w, st, tma in ((128, 64, 8, 3, False), (64, 32, 4, 4, False), (64, 32, 4, 4, True),
                                          (64, 32, 4, 3, True), (64, 64, 4, 3, True), (64, 64, 4, 4, True),
                                          (128, 64, 8, 3, True), (128, 32, 4, 4, True), (128, 64, 8, 2, True))]
    # the warp-specialised Gluon dQ (two consumer warpgroups of 64 rows sharing each K/V block, a
    # producer warp bringing the blocks through TMA): the tl kernel's sums at BLOCK_Q 64
    + [dict(BLOCK_Q=64, BLOCK_KV=kv, GLUON=True, GLUON_STAGES=st) for kv in (32, 64) for st in (2, 3, 4)]
    # GLUON_Q_REGS: its consumers' q and dO in registers (the q.k and dO.v wgmmas read only K and V)
    + [dict(BLOCK_Q=64, BLOCK_KV=64, GLUON=True, GLUON_STAGES=st, GLUON_Q_REGS=True) for st in (3, 4)],
    "decode": [dict(SWAP=False, num_stages=3, PREFETCH=False, PROGRAMS_PER_SM=4)]
    + [dict(SWAP=True, num_stages=s, PREFETCH=False, PROGRAMS_PER_SM=n) for s in (2, 3) for n in (2, 3, 4)]
    + [dict(SWAP=True, num_stages=3, PREFETCH=True, PROGRAMS_PER_SM=4)]
    # more programs a (sequence, kv head) than one wave at batch 64 and 256 (a pair's chunks split over
    # 2-16 programs): whole waves against the last wave part full
    + [dict(SWAP=True, num_stages=2, PREFETCH=False, PROGRAMS_PER_SM=n) for n in (8, 12, 16, 32, 64)]
    # deeper rings (5-6 stages: 105 KB, 2 programs an SM; 3-4 stages take the table's 71.7 KB); for the
    # one-program walk TUNING["decode"]["WALK_STAGES"] already applies where it costs no wave, so these
    # time it elsewhere too (RESULTS.md, twenty-third session)
    + [dict(SWAP=True, num_stages=s, PREFETCH=False, PROGRAMS_PER_SM=n) for s in (4, 5, 6) for n in (1, 2, 3)]
    # the heads padded to 64 rows on deeper rings: a longer MMA, but a block's maxima within each warp
    # and P in registers (no shared-memory round trip), for the smallest batches' chains
    + [dict(SWAP=False, num_stages=s, PREFETCH=False, PROGRAMS_PER_SM=n) for s in (2, 3, 4) for n in (1, 2)]
    # the last, part-full wave's pairs split across programs (SPLIT_TAIL) or walked whole; WALK_PER_SM=1
    # keeps the walks off the deeper ring (_walk_fits), so batches that take it time the split tail
    + [dict(SPLIT_TAIL=t, WALK_PER_SM=w) for t, w in ((False, 2), (True, 1), (False, 1))]
    # a grid of splits alone (batches 1-16): a program's several chunks in one loop on a ring of
    # FLAT_STAGES (0: a loop a chunk on SPLIT_STAGES' ring, as a program of one chunk always runs)
    + [dict(FLAT_STAGES=f) for f in (0, 4, 5, 6)]
    # one or two warps a program: the heads padded to 16 rows run mma.sync (m16n8k16), not wgmma, and
    # with one warp a block's maxima and P never leave it (no barrier, no shared-memory trip). sm_90a
    # (ptxas): one warp 255 registers, ~370 bytes spilled, 36 KB of shared memory at 2 stages, 70 KB
    # at 3; two warps 36 bytes spilled, 38 KB. The twenty-ninth session (H200): the table's bits in
    # every case (mma.sync sums as wgmma does: probe_limits.py mma), but 0.49-0.98x its time
    + [dict(SWAP=False, MIN_ROWS=16, num_warps=w, num_stages=s, PROGRAMS_PER_SM=n, SPLIT_STAGES=s, SPLIT_PER_SM=n,
            FLAT_STAGES=0, WALK_STAGES=s, WALK_PER_SM=n) for w, s, n in ((1, 2, 6), (1, 3, 3), (2, 2, 5))]
}


def paged_inputs(batch: int, context: int, queries: int, kv_heads: int = KV_HEADS) -> tuple:
    """The arguments of paged_attention for `batch` requests of `context` keys (PAGE-key pages in random
    order, on the cache lockstep's vLLM backend allocates: bench_attention.paged_cache) and `queries`
    new tokens each, seeded by the shape; kv_heads (8, or a TP rank's share) with HEADS // KV_HEADS
    query heads each."""
    g = torch.Generator(device="cuda").manual_seed(batch * 7 + context)
    k_cache, v_cache, table = paged_cache(batch, context, generator=g, page=PAGE, kv_heads=kv_heads)
    q = torch.randn(batch * queries, kv_heads * (HEADS // KV_HEADS), D, device="cuda", dtype=torch.bfloat16,
                    generator=g)
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * queries
    return q, k_cache, v_cache, table, seq_lens, qsl, 1 / math.sqrt(D), queries, context


def _case(batch: int, context: int, queries: int):
    args = paged_inputs(batch, context, queries)
    return lambda: K.paged_attention(*args)


def training_inputs(tokens: int = 4 * 4096, seq: int = 4096) -> tuple:
    """(q, k, v, output gradient, cu_seqlens, scale) of varlen attention on `tokens` packed tokens in
    sequences of `seq`, seeded by the token count."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, grad = r(tokens, HEADS, D), r(tokens, KV_HEADS, D), r(tokens, KV_HEADS, D), r(tokens, HEADS, D)
    return q, k, v, grad, torch.arange(0, tokens + 1, seq, device="cuda", dtype=torch.int32), 1 / math.sqrt(D)


def _training_case(tokens: int = 4 * 4096, seq: int = 4096):
    """(forward, backward) of varlen attention on training_inputs: the forward returns its output; the
    backward returns (dq, dk, dv) for the fixed output gradient."""
    q, k, v, grad, cu, scale = training_inputs(tokens, seq)
    out, lse = torch.ops.lockstep.varlen_attention(q, k, v, cu, scale, seq)  # (max_seqlen: no host sync)
    return (lambda: torch.ops.lockstep.varlen_attention(q, k, v, cu, scale, seq)[0],
            lambda: torch.ops.lockstep.varlen_attention_backward(grad, q, k, v, cu, out, lse, scale, seq))


def timer(fn) -> float:
    """Microseconds a call of fn, as bench_attention's tables time them (CUDA-graph replay)."""
    return graph_ms_per_call(fn) * 1e3


def _close(got, want) -> bool:
    """Gradients from another summation order: within bf16 rounding of the table's (relative to
    each tensor's largest entry), and deterministic."""
    return all((a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max() for a, b in zip(got, want))


def sweep(entry: str, name: str, fn) -> None:
    """Every candidate of TUNING[entry] on fn; forward entries must give the table's bits, backward
    ones gradients close to the table's (and the same bits twice)."""
    backward = entry.startswith("bwd")
    default = dict(A.TUNING[entry])
    want = fn()
    base = timer(fn)
    scored = []
    for cand in CANDIDATES[entry]:
        A.TUNING[entry] = {**default, **cand}
        try:
            got = fn()
            if backward:
                again = fn()
                same = _close(got, want) and all(torch.equal(a, b) for a, b in zip(got, again))
            else:
                same = torch.equal(got, want)
            us = timer(fn)
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile is not a winner
            print(f"  {entry} {name} {cand}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
            continue
        finally:
            A.TUNING[entry] = default
        bad = " GRADIENTS DIFFER" if backward else " BITS DIFFER"
        print(f"  {entry} {name} {cand}: {us:.1f} us ({base / us:.3f}x the current table){'' if same else bad}",
              flush=True)
        if same:
            scored.append((us, cand))
    if not scored:
        print(f"BEST {entry} {name}: no candidate passed its check", flush=True)
        return
    us, best = min(scored, key=lambda t: t[0])
    print(f"BEST {entry} {name}: {best} {us:.1f} us vs current {base:.1f} us ({base / us:.3f}x)", flush=True)


CONTRACT_KEYS = ("KV_BLOCK", "KV_CHUNK")


def parse_contract(text: str) -> dict:
    """--contract's KEY=VALUE,... as {KEY: int}: keys of CONTRACT_KEYS, chunks whole blocks."""
    contract = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in CONTRACT_KEYS or not value.isdigit():
            raise SystemExit(f"sweep_attention: --contract {text!r}: expected KEY=VALUE,... with KEY one of "
                             f"{', '.join(CONTRACT_KEYS)} and VALUE a positive integer")
        contract[key] = int(value)
    block, chunk = (contract.get(k, getattr(A, k)) for k in CONTRACT_KEYS)
    if block < 16 or block & (block - 1) or chunk % block:
        raise SystemExit(f"sweep_attention: --contract {text!r}: KV_BLOCK={block} must be a power of two >= 16 "
                         f"and KV_CHUNK={chunk} a multiple of it")
    return contract


def contracts(entry: str, name: str, fn, alternatives: list[dict]) -> None:
    """TUNING[entry]'s current table on fn under each alternative contract against the current one."""
    base = timer(fn)
    current = {k: getattr(A, k) for k in CONTRACT_KEYS}
    print(f"CONTRACT {entry} {name} {current}: {base:.1f} us", flush=True)
    for alt in alternatives:
        try:
            for key, value in alt.items():
                setattr(A, key, value)
            fn()
            us = timer(fn)
        except Exception as e:  # noqa: BLE001 - a contract the kernels cannot run is reported, not timed
            print(f"CONTRACT {entry} {name} {alt}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
            continue
        finally:
            for key, value in current.items():
                setattr(A, key, value)
        print(f"CONTRACT {entry} {name} {alt}: {us:.1f} us ({base / us:.3f}x the current contract)", flush=True)


def main() -> None:
    import argparse

    global PAGE
    p = argparse.ArgumentParser()
    p.add_argument("--entries", default="decode,prefill", help="TUNING entries to sweep (decode, prefill, "
                   "prefill_linear, bwd_dkdv, bwd_dq)")
    p.add_argument("--train-seqs", type=int, default=4, help="4,096-token sequences of the training case")
    p.add_argument("--decode-cases", default=",".join(f"{b}x{c}" for b, c in DECODE),
                   help="decode shapes BATCHxCONTEXT, comma-separated")
    p.add_argument("--page", type=int, default=PAGE, help="keys a page of the paged cases (16: vLLM's default "
                   "block size, the tables'; a larger one times what a larger vLLM block_size would give)")
    p.add_argument("--only", action="append", default=[], help="KEY=VALUE: only the candidates whose KEY is VALUE "
                                                                 "(e.g. GLUON=True; VALUE|VALUE|...: any of these); "
                                                                 "repeated: all of them")
    p.add_argument("--contract", action="append", default=[], help="KEY=VALUE,...: time the forward entries' "
                   f"tables under this contract ({', '.join(CONTRACT_KEYS)}) instead of sweeping candidates; "
                   "repeated: each (no bit check: another contract's bits differ by design)")
    args = p.parse_args()
    alternatives = [parse_contract(c) for c in args.contract]
    entries, train_seqs, PAGE = args.entries.split(","), args.train_seqs, args.page
    for only in args.only:
        key, value = only.split("=", 1)
        for entry in CANDIDATES:
            CANDIDATES[entry] = [c for c in CANDIDATES[entry] if str(c.get(key)) in value.split("|")]
    unknown = set(entries) - set(CANDIDATES)
    if unknown:
        raise SystemExit(f"sweep_attention: no candidates for {sorted(unknown)}; entries: {sorted(CANDIDATES)}")
    run = sweep
    if alternatives:
        if {e for e in entries if e.startswith("bwd")}:
            raise SystemExit("sweep_attention: --contract times forward entries only (the backward recomputes "
                             "its probabilities from the lse: no chunk or block of the contract)")
        run = lambda entry, name, fn: contracts(entry, name, fn, alternatives)  # noqa: E731
    with K.using_backend("triton"):
        forward, backward = _training_case(train_seqs * 4096)
        if "prefill_linear" in entries:
            run("prefill_linear", f"training forward, {train_seqs} x 4,096 packed", forward)
        for entry in ("bwd_dkdv", "bwd_dq"):
            if entry in entries:
                run(entry, f"training backward, {train_seqs} x 4,096 packed", backward)
        if "decode" in entries:
            for batch, context in (map(int, case.split("x")) for case in args.decode_cases.split(",")):
                run("decode", f"batch {batch} x {context} keys", _case(batch, context, 1))
        if "prefill" in entries:
            for tokens in PREFILL:
                run("prefill", f"{tokens}-token prompt", _case(1, tokens, tokens))


if __name__ == "__main__":
    main()
