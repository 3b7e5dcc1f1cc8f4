"""All kernel benchmarks in one process on one CUDA device, as markdown ratio tables.

    python benchmarks/kernels.py [OUT.md]

Sections: GEMM / RMSNorm / SwiGLU (bench_matmul), fused linear-logp (bench_logp), attention
(bench_attention). A section that fails is reported with its error and the others still run.
"""
from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _harness import emit  # noqa: E402
import bench_attention  # noqa: E402
import bench_logp  # noqa: E402
import bench_matmul  # noqa: E402

SECTIONS = [("GEMM, RMSNorm, SwiGLU", bench_matmul), ("fused linear-logp", bench_logp), ("attention", bench_attention)]


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("the kernel benchmarks need a CUDA device")
    lines = [f"Device: {torch.cuda.get_device_name()}, torch {torch.__version__}\n"]
    for title, module in SECTIONS:
        t0 = time.perf_counter()
        try:
            module.run(lines)
        except Exception:  # noqa: BLE001 - one failing section must not hide the others
            lines.append(f"### {title}: FAILED\n\n```\n{traceback.format_exc()}```\n")
        lines.append(f"({title}: {time.perf_counter() - t0:.0f} s)\n")
        print("\n".join(lines[-2:]), flush=True)
    emit(lines, sys.argv[1] if len(sys.argv) > 1 else None)


if __name__ == "__main__":
    main()
