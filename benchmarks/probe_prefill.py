"""Where the Gluon forward's time goes (training's, prefill's): the same kernel with parts of its
consumers' work left out, each timed against the whole (CUDA only; Hopper, bf16).

    python benchmarks/probe_prefill.py [--seqs N] [--seq 4096] [--chunks 256,1048576] [--blocks 64,128]
                                       [--q-regs both] [--variants "whole,loads only"]

No profiler runs on the GPU host, so this probe times ablations. _prefill_ws_kernel takes ABLATE
(kernels/_triton/attention.py, above _ablated_softmax; 0 in every real call): no softmax (P = the
products, alpha = 1: no maxima or exponentials), no ones-dot row sums, no rescale of the chunk
state a block, or all three (what is left: the ring, the barriers and the q.k and P@V wgmmas);
the ring's loads alone (the consumers wait for each block and free it), and the whole kernel or its
MMAs without loads (no copies, no waits: what the SM's own work takes with K/V in shared memory);
with host descriptors (the tile's end descriptors not made on the device: what making them costs).
--seq varies the blocks a tile at the same programs: what a program costs beside its blocks.
Each runs at the contract's KV_CHUNK and at --chunks' others (1,048,576: no chunk merge but the
tile's last), on training's forward (sweep_attention.training_inputs: N packed sequences of
--seq tokens, Qwen3-8B heads), launched as the table launches it (_prefill_ws, TUNING["prefill_linear"]).
--blocks: KV_BLOCK values (the contract's 64 by default; 128: what a 128-key contract's forward would
run, at the ring stages that fit shared memory), --q-regs: GLUON_Q_REGS as the table has it, or both;
--variants: which variants (all by default; the first row timed is the others' base).
An ablation's outputs are wrong by design; only times are compared. For scale, the fastest torch
SDPA forward (bench_attention.fastest_sdpa, causal, the sequences as a batch) on the same inputs.

Prints a table: variant, KV_BLOCK, ring stages, q in registers, KV_CHUNK, us (CUDA-graph replay of
10 calls), the whole kernel's time over the variant's, and TFLOP/s (the causal forward's
4 * D * S * (S + 1) / 2 flops a head a sequence).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _harness import graph_ms_per_call, markdown_table  # noqa: E402
from bench_attention import fastest_sdpa, sdpa  # noqa: E402
from sweep_attention import training_inputs  # noqa: E402
from lockstep.kernels._triton import attention as A  # noqa: E402

VARIANTS = {"whole": 0, "no softmax": A._NO_SOFTMAX.value, "no row sums": A._NO_ROW_SUMS.value,
            "no rescale": A._NO_RESCALE.value,
            "MMAs only": A._NO_SOFTMAX.value | A._NO_ROW_SUMS.value | A._NO_RESCALE.value,
            "loads only": A._NO_MMA.value, "whole without loads": A._NO_LOADS.value,
            "MMAs without loads": A._NO_SOFTMAX.value | A._NO_ROW_SUMS.value | A._NO_RESCALE.value | A._NO_LOADS.value,
            "whole with host descriptors": A._HOST_ENDS.value,
            "MMAs without loads or device descriptors": A._NO_SOFTMAX.value | A._NO_ROW_SUMS.value | A._NO_RESCALE.value
            | A._NO_LOADS.value | A._HOST_ENDS.value}


SHARED_BYTES = 227 * 1024  # sm_90's shared memory a block


def _forward(q, k, v, cu, scale, seq: int, ablate: int, cfg: dict | None = None):
    """The table's Gluon forward over the packed sequences (what varlen_attention launches), with
    ABLATE (cfg: TUNING["prefill_linear"] or a variant of it)."""
    queries, keys = A._varlen_layout(q, k, v, cu, seq)
    view = A._gluon_view(keys)
    if view is None or not A.TUNING["prefill_linear"].get("GLUON"):
        raise SystemExit("probe_prefill: the Gluon forward does not run here (Hopper, bf16, TUNING['prefill_linear']"
                         "['GLUON'])")
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=q.device, dtype=torch.float32)
    group = q.shape[1] // keys.n_heads
    A._prefill_ws(queries, keys, view, out, lse, group, scale * A._LOG2E, 1, cfg or A.TUNING["prefill_linear"],
                  "prefill_linear", ablate=ablate)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, default=4, help="packed sequences")
    p.add_argument("--seq", type=int, default=4096, help="tokens a sequence")
    p.add_argument("--chunks", default=f"{A.KV_CHUNK},1048576", help="KV_CHUNK values, comma-separated")
    p.add_argument("--blocks", default=str(A.KV_BLOCK), help="KV_BLOCK values, comma-separated")
    p.add_argument("--q-regs", choices=("table", "both"), default="table", help="GLUON_Q_REGS: the table's, or both")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = p.parse_args()
    variants = {name: VARIANTS[name] for name in args.variants.split(",")}
    seq = args.seq
    q, k, v, _, cu, scale = training_inputs(args.seqs * seq, seq)
    flops = 4 * q.shape[2] * seq * (seq + 1) / 2 * q.shape[1] * args.seqs
    whole = _forward(q, k, v, cu, scale, seq, 0)
    if not torch.equal(whole, torch.ops.lockstep.varlen_attention(q, k, v, cu, scale, seq)[0]):
        raise SystemExit("probe_prefill: the probe's launch of the whole kernel does not give varlen_attention's bits")
    contract, contract_block, table = A.KV_CHUNK, A.KV_BLOCK, A.TUNING["prefill_linear"]
    q_regs = (table["GLUON_Q_REGS"], ) if args.q_regs == "table" else (True, False)
    rows, base = [], None
    for block in (int(b) for b in args.blocks.split(",")):
        # the ring's stages that fit beside q (both halves) and the ones tile, at most the table's
        ring = (SHARED_BYTES - 2 * q.shape[2] * 128 - 2 * block * A._SUM_COLS.value) // (4 * block * q.shape[2])
        for regs in q_regs:
            cfg = dict(table, GLUON_STAGES=min(table["GLUON_STAGES"], ring), GLUON_Q_REGS=regs)
            for chunk in (int(c) for c in args.chunks.split(",")):
                A.KV_CHUNK, A.KV_BLOCK = chunk, block
                try:
                    for name, ablate in variants.items():
                        us = graph_ms_per_call(lambda: _forward(q, k, v, cu, scale, seq, ablate, cfg)) * 1e3
                        base = us if base is None else base
                        rows.append([name, block, cfg["GLUON_STAGES"], regs, chunk, f"{us:.1f}", f"{base / us:.3f}",
                                     f"{flops / us / 1e6:.0f}"])
                        print(f"{name} KV_BLOCK={block} stages={cfg['GLUON_STAGES']} q_regs={regs} KV_CHUNK={chunk}: "
                              f"{us:.1f} us", flush=True)
                finally:
                    A.KV_CHUNK, A.KV_BLOCK = contract, contract_block
    batch = lambda t: t.view(args.seqs, seq, t.shape[1], t.shape[2]).transpose(1, 2).contiguous()  # noqa: E731
    qb, kb, vb = batch(q), batch(k), batch(v)
    ms, backend = fastest_sdpa(graph_ms_per_call, lambda b: sdpa(b, qb, kb, vb, True))
    us = ms * 1e3
    rows.append([f"torch SDPA forward ({backend})", "-", "-", "-", "-", f"{us:.1f}", f"{base / us:.3f}",
                 f"{flops / us / 1e6:.0f}"])
    print(markdown_table(f"Gluon forward ablations, {args.seqs} x {seq} packed tokens, bf16, 32 / 8 heads, D 128 "
                         f"({torch.cuda.get_device_name()})",
                         ["variant", "KV_BLOCK", "stages", "q in registers", "KV_CHUNK", "us", "whole / variant",
                          "TFLOP/s"], rows))


if __name__ == "__main__":
    main()
