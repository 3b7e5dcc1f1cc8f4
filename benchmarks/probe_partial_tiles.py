"""Whether a part-full tile of x is what slows the decode buckets (bf16, Qwen3-8B projections).

    python benchmarks/probe_partial_tiles.py [OUT.md] [--ms 80,96,112,128]

Thirty-third session (H100, benchmarks/RESULTS.md): the swapped Gluon tile of 128 rows of x took
22.6 us on o_proj's tree at 80 rows and 14.3 at 128, with the same grid and split, and every
lockstep kernel read 0.41-0.50x cuBLAS on o_proj at 80 rows against about 1.0 at 128. The tile's
rows past M are TMA's zero fill and masked stores; this says whether they are what costs.

For each projection as the model runs it (qkv and gate/up through `linear`, o_proj and down
through the row-parallel tree) at M rows: cuBLAS on the M rows; lockstep on the M rows as they are
(the table's bucket for M); and lockstep on a 128-row buffer whose first M rows are copied in by
each call (the rest stay zero; the 128-row bucket, the copy timed in). Each row's bits do not
depend on the other rows (row invariance), so the padded call's first M rows must equal the plain
call's: checked before anything is timed.
"""
from __future__ import annotations

import argparse

import torch

from _harness import emit, graph_ms_per_call, markdown_table
from bench_matmul import QWEN3_8B_PROJECTIONS
import lockstep.kernels as K

FULL = 128  # the decode buckets' x tile (matmul_configs.SWAPPED_128_ROWS)
ROW_PARALLEL = ("o_proj", "down")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?")
    p.add_argument("--ms", default="80,96,112,128", help=f"comma-separated row counts, at most {FULL}")
    args = p.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    if not all(0 < m <= FULL for m in ms):
        raise SystemExit(f"--ms {args.ms}: each M must be 1 .. {FULL} (the buffer it is padded to)")
    K.set_backend("triton")
    rows = []
    for name, k, n in QWEN3_8B_PROJECTIONS:
        op = K.row_parallel_linear if name in ROW_PARALLEL else K.linear
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        source = torch.randn(max(ms), k, device="cuda", dtype=torch.bfloat16)
        padded = torch.zeros(FULL, k, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            x = source[:m].contiguous()
            padded.zero_()
            padded[:m].copy_(x)
            if not torch.equal(op(padded, w)[:m], op(x, w)):
                raise SystemExit(f"{name} M={m}: the padded call's first {m} rows differ from the plain call's")

            def pad_call(x=x, m=m):
                padded[:m].copy_(x)
                return op(padded, w)

            cublas = graph_ms_per_call(lambda: x @ w.t())
            plain = graph_ms_per_call(lambda: op(x, w))
            pad = graph_ms_per_call(pad_call)
            rows.append([name, m, round(cublas * 1e3, 1), round(plain * 1e3, 1), round(pad * 1e3, 1),
                         f"{cublas / plain:.3f}", f"{cublas / pad:.3f}"])
            print(rows[-1], flush=True)
    device = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    emit([f"Device: {device}", "",
          markdown_table("Part-full x tiles: each M as is, and padded to 128 rows (copy included)",
                         ["shape", "M", "cuBLAS us", "lockstep us", "padded us", "lockstep ratio", "padded ratio"],
                         rows)], args.out)


if __name__ == "__main__":
    main()
