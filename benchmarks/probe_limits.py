"""What limits issue 15's misses, measured (CUDA only; speed only, every variant's bits checked).

    python benchmarks/probe_limits.py [logp] [decode] [clocks] [mma]

logp: linear_logp at T = 256 runs 128 programs (two 128-row blocks x 64 vocab chunks) that each read
their chunk's weight rows; the two row blocks of a chunk read the same rows. If they are fetched
from DRAM twice, the forward is bound by 2 x 1.24 GB of weight traffic. The probe times, in one
process: the weight's DRAM copy rate, the bare GEMM at T = 128 and 256, the forward at T = 256, and
the forward at T = 128 in one 128-row block (64 programs, every weight row read once): if a program
of the latter runs as long as one of the former, the doubled traffic is not what binds.
clocks: the SM clock and board power (nvidia-smi, sampled every 20 ms) while each of these is
replayed for two seconds: the bare GEMM and the forward at T = 256, the forward at T = 128 in one
row block; o_proj's tree at M = 1,024 and cuBLAS; decode at batch 1 and 256 x 4k keys and cuDNN.
Whether a kernel runs at the board's power limit (then its speed is its energy a step) or below it.
decode: programs per (sequence, kv head) forced to 1-4 (or 4-8) at the decode table's larger
batches, against the table's own choice, in paired CUDA-graph turns.
mma: whether mma.sync (a 16-row tile on one warp) sums a bf16 dot chain to wgmma's bits (a 64-row
tile on a warpgroup): the same 16 rows, K = 4,096 in BLOCK_K steps, several N and BLOCK_K, random
and cancelling data; the instruction each compiled to is read from its PTX. Every lockstep table
keeps its dots on wgmma because this was never checked (kernels/_triton/matmul_configs.py); if the
bits agree, 16-row tiles (decode heads on one warp, small-M GEMMs) keep the contract.

What it read (H200, twenty-first session; benchmarks/RESULTS.md): the forward at T = 256 0.558 ms,
one 128-row block alone 0.461 ms; pacing the two row blocks' producers together in the Gluon
forward (a counter per chunk every 4-16 k steps) did not move T = 256 (0.560-0.564 ms against
0.566 unpaced): either the doubled reads are not what binds (a full machine's clocks or L2 may be),
or pacing did not make them shared (no profiler on the host to tell). Decode:
three programs a pair at batch 64 read 1.03x / 1.08x the table's one at 4k / 16k keys; two or four
at batch 256 0.88-0.91x. Clocks (twenty-second session): the clock it was. The forward and the
GEMM at T = 256 both run at the 700 W limit at 1,380 MHz, and one row block alone at 1,725 MHz;
a program takes about 0.79 M cycles either way. o_proj's tree at 1,024 sits below the limit with
1.29x cuBLAS's cycles, and decode at batch 1 runs at full clock far below it.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))

from _harness import PowerLog, graph_of, measure, paired_graph_ms  # noqa: E402
from bench_logp import HIDDEN, VOCAB, _inputs, fwd_ms, fwd_pair_ms  # noqa: E402
import lockstep.kernels as K  # noqa: E402
from lockstep.kernels._triton._device import resident_programs  # noqa: E402


def logp() -> None:
    from lockstep.kernels._triton import logp as L

    K.set_backend("triton")
    h, w, tgt = _inputs(256)
    copy = measure(lambda: torch.empty_like(w).copy_(w))
    print(f"weight {w.numel() * 2 / 2**30:.2f} GiB: copy {copy.ms:.3f} ms = {2 * w.numel() * 2 / copy.ms / 1e9:.2f} "
          f"TB/s (read + write)", flush=True)
    for t in (128, 256):
        gemm, ours = fwd_pair_ms(lambda: h[:t] @ w.t(), lambda: K.linear_logp(h[:t], w, tgt[:t]))
        print(f"T={t} table: GEMM {gemm:.3f} ms, linear_logp {ours:.3f} ms = {ours / gemm:.3f}x", flush=True)
    ref = K.linear_logp(h[:128], w, tgt[:128]).logp
    saved = L.BLOCK_T_WARPS, L.MIN_WAVE_FILL, L.WS_MIN_ITEMS_PER_PROGRAM
    try:
        L.BLOCK_T_WARPS, L.MIN_WAVE_FILL = {128: 8}, 0.0
        assert torch.equal(K.linear_logp(h[:128], w, tgt[:128]).logp, ref)
        one = fwd_ms(lambda: K.linear_logp(h[:128], w, tgt[:128]))
        print(f"T=128 in one 128-row block (64 programs): {one:.3f} ms", flush=True)
        L.BLOCK_T_WARPS, L.MIN_WAVE_FILL = saved[:2]
        L.WS_MIN_ITEMS_PER_PROGRAM = 0
        ref = K.linear_logp(h, w, tgt).logp
        gemm, ws = fwd_pair_ms(lambda: h @ w.t(), lambda: K.linear_logp(h, w, tgt))
        print(f"T=256 Gluon forward: {ws:.3f} ms = {ws / gemm:.3f}x", flush=True)
        L.BLOCK_T_WARPS, L.MIN_WAVE_FILL = {128: 8}, 0.0
        one = fwd_ms(lambda: K.linear_logp(h[:128], w, tgt[:128]))
        print(f"T=128 Gluon forward, one 128-row block (64 programs): {one:.3f} ms", flush=True)
    finally:
        L.BLOCK_T_WARPS, L.MIN_WAVE_FILL, L.WS_MIN_ITEMS_PER_PROGRAM = saved
    print(f"(H = {HIDDEN}, V = {VOCAB}, bf16)")


def _under_load(fn, seconds: float = 2.0) -> str:
    """The median SM clock and board power (_harness.PowerLog) while fn's CUDA graph replays for
    `seconds`, and fn's milliseconds a call over that time."""
    graph = graph_of(fn, 20)
    graph.replay()
    torch.cuda.synchronize()
    with PowerLog() as power:
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            for _ in range(10):
                graph.replay()
            calls += 200
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    return f"{power.summary()}, {elapsed * 1e3 / calls:.3f} ms a call"


def clocks() -> None:
    from bench_attention import DTYPE, HEAD_DIM, HEADS, KV_HEADS, SCALE, paged_cache, _randn, sdpa
    from torch.nn.attention import SDPBackend
    from lockstep.kernels._triton import logp as L

    K.set_backend("triton")
    print(subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit", "--format=csv"],
                         capture_output=True, text=True).stdout.strip(), flush=True)
    with K.skipping_value_checks():
        h, w, tgt = _inputs(256)
        print(f"bare GEMM T=256: {_under_load(lambda: h @ w.t())}", flush=True)
        print(f"bare GEMM T=128: {_under_load(lambda: h[:128] @ w.t())}", flush=True)
        print(f"linear_logp T=256 (table): {_under_load(lambda: K.linear_logp(h, w, tgt))}", flush=True)
        saved = L.BLOCK_T_WARPS, L.MIN_WAVE_FILL
        try:
            L.BLOCK_T_WARPS, L.MIN_WAVE_FILL = {128: 8}, 0.0
            print(f"linear_logp T=128, one row block (64 programs): "
                  f"{_under_load(lambda: K.linear_logp(h[:128], w, tgt[:128]))}", flush=True)
        finally:
            L.BLOCK_T_WARPS, L.MIN_WAVE_FILL = saved
        h = w = tgt = None
        # done-means 1's miss: o_proj's tree at M = 1,024
        x = torch.randn(1024, 4096, device="cuda", dtype=DTYPE)
        wo = (torch.randn(4096, 4096, device="cuda") / 64).to(DTYPE)
        print(f"o_proj M=1024 cuBLAS: {_under_load(lambda: x @ wo.t())}", flush=True)
        print(f"o_proj M=1024 tree: {_under_load(lambda: K.row_parallel_linear(x, wo))}", flush=True)
        # done-means 2's decode: batch 1 and 256 at 4k keys, against cuDNN on a contiguous cache
        for batch in (1, 256):
            q = _randn(batch, HEADS, HEAD_DIM)
            k_cache, v_cache, table = paged_cache(batch, 4096)
            lens = torch.full((batch,), 4096, device="cuda", dtype=torch.int32)
            qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
            print(f"decode {batch} x 4096 lockstep: "
                  f"{_under_load(lambda: K.paged_attention(q, k_cache, v_cache, table, lens, qsl, SCALE, 1, 4096))}",
                  flush=True)
            k_cache = v_cache = None
            qb, kb, vb = q.view(batch, HEADS, 1, HEAD_DIM), _randn(batch, KV_HEADS, 4096, HEAD_DIM), \
                _randn(batch, KV_HEADS, 4096, HEAD_DIM)
            print(f"decode {batch} x 4096 cuDNN: {_under_load(lambda: sdpa(SDPBackend.CUDNN_ATTENTION, qb, kb, vb, False))}",
                  flush=True)
            q = qb = kb = vb = None
            torch.cuda.empty_cache()


def decode() -> None:
    from sweep_attention import paged_inputs
    from lockstep.kernels._triton import attention as A

    K.set_backend("triton")
    cfg = A.TUNING["decode"]
    table = cfg["PROGRAMS_PER_SM"]
    sms = resident_programs(torch.device("cuda"))
    print("| batch x context | programs a pair | table us | forced us | table / forced | bits |\n|---|---|---|---|---|---|")
    for batch, context, forced in ((64, 4096, (1, 2, 3, 4)), (64, 16384, (2, 3)), (256, 1024, (2, 4)),
                                   (256, 4096, (2, 3)), (16, 4096, (4, 6, 8)), (16, 16384, (4, 6))):
        args = paged_inputs(batch, context, 1)
        pairs = batch * 8
        ref = A._paged(*args)
        for p in forced:
            pps = -(-p * pairs // sms)  # the smallest programs-an-SM figure whose grid gives p a pair

            def run(v=pps):
                cfg["PROGRAMS_PER_SM"] = v
                try:
                    return A._paged(*args)
                finally:
                    cfg["PROGRAMS_PER_SM"] = table

            same = torch.equal(run(), ref)
            a, b = paired_graph_ms(lambda: A._paged(*args), run)
            print(f"| {batch} x {context} | {p} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.3f} | "
                  f"{'same' if same else 'DIFFER'} |", flush=True)
        args = ref = None  # freed before the next shape
        torch.cuda.empty_cache()


@triton.jit
def _dot_chain(a_ptr, b_ptr, c_ptr, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c = a[:BLOCK_M] @ b, fp32, one tl.dot per BLOCK_K step in increasing k (a [*, K], b [K, BLOCK_N])."""
    rm, rn, rk = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :])
        b = tl.load(b_ptr + (k0 + rk)[:, None] * BLOCK_N + rn[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * BLOCK_N + rn[None, :], acc)


def mma() -> None:
    k = 4096
    print("| data | N | BLOCK_K | 16 rows, 1 warp | 64 rows, 4 warps | elements differing (of 16 x N) |\n"
          "|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for data in ("random", "cancelling"):
        a = torch.randn(64, k, device="cuda", generator=g)
        if data == "cancelling":  # large terms of alternating sign: sums that lose bits to cancellation
            a = a * 64 * torch.where(torch.arange(k, device="cuda") % 2 == 0, 1.0, -1.0)
        a = a.bfloat16()
        for n in (16, 64, 128):
            b = torch.randn(k, n, device="cuda", generator=g).bfloat16()
            for block_k in (16, 64):
                out, kinds = [], []
                for rows, warps in ((16, 1), (64, 4)):
                    c = torch.empty(rows, n, device="cuda")
                    compiled = _dot_chain[(1,)](a, b, c, k, BLOCK_M=rows, BLOCK_N=n, BLOCK_K=block_k, num_warps=warps)
                    ptx = compiled.asm["ptx"]
                    kinds.append("wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "?")
                    out.append(c[:16])
                differ = int((out[0].view(torch.int32) != out[1].view(torch.int32)).sum())
                print(f"| {data} | {n} | {block_k} | {kinds[0]} | {kinds[1]} | {differ} |", flush=True)


if __name__ == "__main__":
    what = sys.argv[1:] or ["logp", "decode"]
    for name in what:
        {"logp": logp, "decode": decode, "clocks": clocks, "mma": mma}[name]()
