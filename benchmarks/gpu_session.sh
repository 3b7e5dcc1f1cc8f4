#!/usr/bin/env bash
# One call on a GPU host that has torch/triton but no network: make lockstep importable from the
# carried wheels, then run the requested stages, logging under $OUT.
#   bash benchmarks/gpu_session.sh tests kernels e2e
# Stages: tests (pytest -m gpu on the kernel tests), kernels (benchmarks/kernels.py, all tables),
#         sweep (GEMM tile configs), logp (the linear-logp table alone),
#         e2e (benchmarks/e2e_1gpu.py: the 1-GPU recipe, strict and off).
set -uo pipefail
OUT=${OUT:-/tmp/lockstep-out}
mkdir -p "$OUT"
# A fresh target every call: pip --target never replaces what an earlier call left half-installed.
rm -rf .site
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .gpu-wheels/a/*.whl > "$OUT/install.log" 2>&1 \
  || { tail -20 "$OUT/install.log"; exit 1; }
# lockstep's folders are mapped into the lockstep.* namespace by setup.py; here, by links.
mkdir -p .site/lockstep
for root in framework kernels launch configs recipes; do ln -sfn "$PWD/$root" ".site/lockstep/$root"; done
export PYTHONPATH=$PWD/.site:$PWD/benchmarks:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
python3 -c "import hydra.core, omegaconf, ray, megatron.core, pytest" || { echo "carried wheels do not import"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
rc=0
for stage in "$@"; do
  echo "=== $stage ==="
  case $stage in
    tests)   timeout 240 python3 -m pytest -q -m gpu tests/test_triton_kernels.py tests/test_triton_logp.py \
               tests/test_attention.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    kernels) timeout 330 python3 benchmarks/kernels.py "$OUT/kernels.md" > "$OUT/kernels.log" 2>&1; tail -80 "$OUT/kernels.log" ;;
    sweep)   timeout 300 python3 benchmarks/sweep_gemm.py > "$OUT/sweep.log" 2>&1; grep -E "BEST|failed" "$OUT/sweep.log" ;;
    sweep_logp) timeout 180 python3 benchmarks/sweep_logp.py 2>&1 | grep "BLOCK_T" ;;
    logp)    timeout 240 python3 -c "import bench_logp; l=[]; bench_logp.run(l); print(chr(10).join(l))" > "$OUT/logp.md" 2>&1; tail -40 "$OUT/logp.md" ;;
    e2e)     timeout 540 python3 benchmarks/e2e_1gpu.py /tmp/lockstep-e2e > "$OUT/e2e.log" 2>&1
             cp /tmp/lockstep-e2e/e2e_1gpu.md "$OUT/" 2>/dev/null; tail -30 "$OUT/e2e.log" ;;
    *)       echo "unknown stage $stage"; rc=2 ;;
  esac
done
exit $rc
