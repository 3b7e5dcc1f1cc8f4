"""lockstep's Triton GEMM, RMSNorm and SwiGLU against their baselines, on one CUDA device.

- GEMM: lockstep `linear` vs torch.matmul (cuBLAS) on the Qwen3-8B projection shapes in bf16,
  in TFLOP/s, against issue 15's bar (>= 0.90x cuBLAS at every M); qkv and gate_up are the fused
  shapes strict mode runs (`linear_rows`);
- the row-parallel GEMM (`row_parallel_linear`: the canonical 8-chunk tree, what strict mode runs
  for o_proj and down_proj) vs cuBLAS, same bar, on all four shapes (qkv and gate_up: what a
  `linear` on the same tree would cost).
- RMSNorm (H=4096) and SwiGLU (width 12288): achieved bandwidth against the roofline (the device's
  datasheet peak, looked up by its name in PEAK_BANDWIDTH; `--peak-bandwidth` for another device)
  and against the torch composition the model runs without lockstep.

Each measurement replays a CUDA graph of 10 back-to-back calls, so it times the
kernels rather than Python launch overhead (a decode-sized GEMM takes a few microseconds); a
kernel that cannot be captured fails here first. A GEMM's two sides are timed in five alternating
turns, the median turn of each kept (_harness.paired_graph_ms). Both sides run in the same process
on the same inputs; a weight that fits in L2 (o_proj: 32 MiB of H200's 50 MiB) stays cached across calls for
both, so small-M rows of that shape measure L2 rather than HBM bandwidth. Where it fits, the "from HBM"
columns time both sides again with each call on the next of enough weight copies to overflow L2 twice,
as a model's layers read theirs (each layer its own weight); pass/miss stays the first measure's.

    python benchmarks/bench_matmul.py [--peak-bandwidth 3.35e12]
"""
from __future__ import annotations

import argparse
import functools
import itertools

import torch

if __package__:  # imported as benchmarks.bench_matmul
    from ._harness import graph_ms_per_call, markdown_table, paired_graph_ms
else:  # run as a script, or imported with benchmarks/ on sys.path
    from _harness import graph_ms_per_call, markdown_table, paired_graph_ms

import lockstep.kernels as K
from lockstep.framework.models.ops import torch_rms_norm, torch_silu_mul

QWEN3_8B_PROJECTIONS = [("qkv", 4096, 6144), ("o_proj", 4096, 4096), ("gate_up", 4096, 24576), ("down", 12288, 4096)]
GEMM_M = [1, 8, 64, 256, 1024, 4096, 16384]
NORM_M = [256, 4096, 16384]
HIDDEN = 4096
FFN_WIDTH = 12288
# datasheet HBM bandwidth, B/s, by a substring of torch.cuda.get_device_name()
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12}
DTYPE = torch.bfloat16


TARGET = 0.90  # issue 15: >= 0.90x cuBLAS for M in {1, 8, 64, 256, 1024} (goal 1.0x at M <= 64)


def _rotating(weights: list):
    """A function that returns the next of `weights` at each call (a captured graph's calls each
    bind the next copy)."""
    return functools.partial(next, itertools.cycle(weights))


def gemm_table(title: str, shapes, ours_fn) -> str:
    rows = []
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for name, k, n in shapes:
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(DTYPE)
        # weight copies that overflow L2 twice, where one fits in it
        size = w.numel() * w.element_size()
        copies = [w] + [w.clone() for _ in range(2 * l2 // size)] if size <= l2 else []
        for m in GEMM_M:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            tflop = 2 * m * n * k / 1e12
            cublas_ms, ours_ms = paired_graph_ms(lambda: torch.matmul(x, w.t()), lambda: ours_fn(x, w))
            cublas, ours = tflop / (cublas_ms / 1e3), tflop / (ours_ms / 1e3)
            cold = ["-", "-", "-"]
            if copies and m <= 1024:
                theirs_w, ours_w = _rotating(copies), _rotating(copies)
                cold_ms = paired_graph_ms(lambda: torch.matmul(x, theirs_w().t()), lambda: ours_fn(x, ours_w()))
                cold = [tflop / (cold_ms[0] / 1e3), tflop / (cold_ms[1] / 1e3), cold_ms[0] / cold_ms[1]]
            rows.append([f"{name} K={k} N={n}", m, cublas, ours, ours / cublas, f">={TARGET:.2f}",
                         "pass" if ours / cublas >= TARGET else "miss", *cold])
            del x
    columns = ["shape", "M", "cuBLAS TFLOP/s", "lockstep TFLOP/s", "ratio", "target", "pass/miss",
               "from HBM: cuBLAS TFLOP/s", "from HBM: lockstep TFLOP/s", "from HBM: ratio"]
    return markdown_table(title, columns, rows)


def _bandwidth_rows(label, make_inputs, ours, baseline, bytes_moved, peak_bandwidth):
    rows = []
    for m in NORM_M:
        inputs = make_inputs(m)
        moved = bytes_moved(m)
        ours_bw = moved / (graph_ms_per_call(lambda: ours(*inputs)) / 1e3)
        torch_bw = moved / (graph_ms_per_call(lambda: baseline(*inputs)) / 1e3)
        rows.append([label, m, ours_bw / 1e9, ours_bw / peak_bandwidth, torch_bw / 1e9, ours_bw / torch_bw])
    return rows


def bandwidth_table(peak_bandwidth: float) -> str:
    size = DTYPE.itemsize
    w = torch.randn(HIDDEN, device="cuda", dtype=DTYPE)
    rows = _bandwidth_rows(
        f"RMSNorm H={HIDDEN}", lambda m: (torch.randn(m, HIDDEN, device="cuda", dtype=DTYPE),),
        lambda x: K.rms_norm(x, w, 1e-6), lambda x: torch_rms_norm(x, w, 1e-6),
        lambda m: (2 * m + 1) * HIDDEN * size, peak_bandwidth)  # read x and weight, write y
    rows += _bandwidth_rows(
        f"SwiGLU width={FFN_WIDTH}",
        lambda m: tuple(torch.randn(m, FFN_WIDTH, device="cuda", dtype=DTYPE) for _ in range(2)),
        K.silu_mul, torch_silu_mul,
        lambda m: 3 * m * FFN_WIDTH * size, peak_bandwidth)  # read gate and up, write out
    columns = ["op", "M", "lockstep GB/s", "of roofline", "torch GB/s", "ratio vs torch"]
    return markdown_table(f"Memory-bound ops (bf16) vs roofline ({peak_bandwidth / 1e12:.2g} TB/s) and torch",
                          columns, rows)


def device_peak_bandwidth(name: str) -> float:
    for key, bandwidth in PEAK_BANDWIDTH.items():
        if key in name:
            return bandwidth
    raise ValueError(f"bench_matmul: no peak bandwidth known for {name!r} (PEAK_BANDWIDTH in "
                     f"benchmarks/bench_matmul.py knows {sorted(PEAK_BANDWIDTH)}); pass --peak-bandwidth B/s")


def run(out_md_lines: list[str], peak_bandwidth: float | None = None) -> None:
    """Append the GEMM and the memory-bound tables (markdown) to out_md_lines. CUDA only; the
    roofline is the device's (PEAK_BANDWIDTH) unless peak_bandwidth is given."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_matmul needs a CUDA device")
    peak_bandwidth = peak_bandwidth or device_peak_bandwidth(torch.cuda.get_device_name())
    with K.using_backend("triton"):
        out_md_lines.append(gemm_table("GEMM (bf16, Qwen3-8B projections): linear vs cuBLAS",
                                       QWEN3_8B_PROJECTIONS, K.linear))
        # o_proj and down run this in strict mode; qkv and gate_up are measured too, as what `linear`
        # would cost if its K order became the same chunk tree (the way to split K at small M)
        out_md_lines.append(gemm_table("The 8-chunk tree GEMM (row_parallel_linear, bf16, TP 1, one launch) vs cuBLAS",
                                       QWEN3_8B_PROJECTIONS, K.row_parallel_linear))
        out_md_lines.append(bandwidth_table(peak_bandwidth))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-bandwidth", type=float, default=None,
                        help="peak memory bandwidth of the device in B/s (default: the device's, from PEAK_BANDWIDTH)")
    args = parser.parse_args()
    lines: list[str] = []
    run(lines, args.peak_bandwidth)
    print("\n".join(lines))
