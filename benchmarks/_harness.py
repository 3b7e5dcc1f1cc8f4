"""Side-by-side timing and memory for the kernel benchmarks (CUDA only).

Every benchmark measures lockstep and its baseline in the same process on the same inputs and
reports the ratio; absolute times are printed only next to their ratio.
"""
from __future__ import annotations

import math
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch


def emit(lines: list[str], out: str | Path | None) -> str:
    """A benchmark's report: printed, and written to `out` when given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    return text


class PowerLog:
    """The GPU's SM clock (MHz) and board power (W) as nvidia-smi samples them every `interval_ms`
    while the `with` block runs; after it, `clock_mhz` and `power_w` are the medians of the samples
    past the first eighth (the ramp-up), NaN where nvidia-smi is absent or sampled nothing (`error`
    says which). A GPU at its power limit lowers its clock, and a kernel's speed there follows its
    energy a step rather than its cycles (an H200 at 700 W runs GEMMs at 1.3-1.7 GHz, not 1.98):
    results that may be power-bound report both figures beside the times."""

    def __init__(self, interval_ms: int = 20, device: int = 0):
        self.cmd = ["nvidia-smi", f"--id={device}", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                    f"-lms={interval_ms}"]
        self.clock_mhz = self.power_w = math.nan
        self.samples, self.error, self._proc = 0, None, None

    def __enter__(self) -> "PowerLog":
        try:
            self._proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except FileNotFoundError:
            self.error = "nvidia-smi not found"
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        lines = self._proc.communicate()[0].splitlines()
        rows = []
        for line in lines[len(lines) // 8:]:  # in sampling order: the ramp-up dropped
            try:
                row = tuple(float(v) for v in line.split(","))
            except ValueError:  # a "[N/A]" field, or a line cut short by the termination
                continue
            if len(row) == 2:
                rows.append(row)
        self.samples = len(rows)
        if not rows:
            self.error = "nvidia-smi sampled nothing"
            return
        self.clock_mhz = sorted(r[0] for r in rows)[len(rows) // 2]
        self.power_w = sorted(r[1] for r in rows)[len(rows) // 2]

    def summary(self) -> str:
        return self.error or f"{self.clock_mhz:.0f} MHz, {self.power_w:.0f} W ({self.samples} samples)"


@dataclass
class Measure:
    ms: float  # median milliseconds per call
    extra_gib: float  # peak memory above what was allocated before the call, GiB


def measure(fn, warmup: int = 5, iters: int = 20) -> Measure:
    """Median time (CUDA events) and peak extra memory of fn()."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base) / 2**30
    return Measure(sorted(times)[len(times) // 2], extra)


def graph_of(fn, calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` back-to-back fn() calls; warm-up (compilation, library handles, the
    split kernels' ticket counters: kernels/_triton/_tickets.py) runs eagerly on the capture stream
    first, off the current one."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for _ in range(calls):
            fn()
    return graph


def graph_ms_per_call(fn, calls: int = 10) -> float:
    """Median milliseconds of one fn() call, replayed from a CUDA graph of `calls` back-to-back
    calls: times the kernels rather than Python launch overhead (a decode-sized call takes a few
    microseconds)."""
    graph = graph_of(fn, calls)
    ms = measure(graph.replay).ms / calls
    del graph
    return ms


def host_us(fn, n: int = 100) -> float:
    """Microseconds of host time per fn() call over n calls queued back to back (no device syncs
    inside the timed loop): what a call costs the host, whatever its kernels cost the GPU."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us


def paired_graph_ms(baseline, ours, calls: int = 10, rounds: int = 5) -> tuple[float, float]:
    """Milliseconds of one call of each side, as graph_ms_per_call times them, but measured in
    `rounds` alternating turns (baseline, ours, baseline, ...) and the median turn of each side
    kept: a drift of the GPU's clocks or of its neighbours during the measurement falls on both
    sides instead of on whichever side happened to run then."""
    graphs = graph_of(baseline, calls), graph_of(ours, calls)
    turns: tuple[list, list] = ([], [])
    for _ in range(rounds):
        for graph, times in zip(graphs, turns):
            times.append(measure(graph.replay, warmup=2, iters=10).ms / calls)
    del graphs
    return tuple(sorted(times)[rounds // 2] for times in turns)


def markdown_table(title: str, columns: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    out = [f"### {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(out) + "\n"
