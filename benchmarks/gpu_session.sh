#!/usr/bin/env bash
# Calls on a GPU host that has torch/triton/transformers but no network: install what it lacks from
# carried files, make lockstep importable, run the requested stages, logging under $OUT. What one
# call installs under /tmp stays for the next call while the machine is warm.
#   bash benchmarks/gpu_session.sh STAGE ...
# Install stages (each carries its own files; see tools/gpu-vllm-carry.sh and tools/gpu-wheelhouse.sh):
#   vllm_a   carry .gpu-vllm/chunks/00: copied to /tmp/vc/chunks
#   vllm_b   carry .gpu-vllm/chunks/01, MANIFEST, install.sh: vLLM 0.26.0 installed into /tmp/site
#   (any other stage installs .gpu-wheels/a (Ray, Hydra, megatron-core) into /tmp/site-a on first use:
#    carry .gpu-wheels/a in that call)
# Run stages:
#   site        only the install of .gpu-wheels/a (a fresh machine's first call, before vllm_a)
#   tests       pytest -m gpu (kernels, attention, logp, CUDA-graph capture, TP emulation; $GPU_TESTS picks
#               the files, $TESTS_TIMEOUT the limit, default 400 s)
#   kernel_tests pytest -m gpu over the kernels' files alone (test_triton_kernels, test_triton_logp, test_attention;
#               $GPU_TESTS picks others), $TESTS_WORKERS processes (default 4: compiling is most of their time),
#               $TESTS_TIMEOUT s: they need only torch and triton, so the call may carry vLLM's first chunk instead
#   vllm_tests  pytest -m gpu tests/test_vllm_gpu.py (vLLM + lockstep, bf16, CUDA graphs, bitwise)
#   e2e         qwen3-1.7b-1gpu (megatron actor + native engine), strict and off
#   e2e_vllm    qwen3-1.7b-1gpu rollout=vllm, $E2E_MODES (default strict,off; top_p 0.9, temperature 0.7,
#               3 steps of 16 prompts x 8 samples x <= 128 new tokens)
#   e2e_ckpt    init-model --like qwen3-1.7b, then qwen3-1.7b from it: native engine, then vLLM (strict)
#   train_memory benchmarks/bench_train_memory.py (peak training memory vs max_tokens_per_gpu and batch)
#   resume      benchmarks/resume_1gpu.py (4 steps straight vs 2 + resume, bf16 megatron, bitwise)
#   rollout     benchmarks/bench_rollout.py (stock vLLM, batch-invariant, lockstep, native)
#   rollout_ab  bench_rollout.py's lockstep config twice in one call (vLLM installed by vllm_a, vllm_b): first with
#               $AB_KERNELS (another revision's kernels/ folder inside the tree, e.g. `git archive REV kernels |
#               tar -x -C .ab/old`, carried; default .ab/old/kernels)
#               linked in place of this tree's, then with this tree's; $ROLLOUT_AB_ARGS (default --shapes 8b)
#   ab_decode   benchmarks/ab_decode.py $AB_OLD (default OLD.py: another revision's attention module, carried
#               untracked; several, comma-separated, each in turn) against this tree's attention, $AB_CASES
#               the cases (decode BxC, paged prefill BxCxQ, mixed BxC+P, training forward trainN[xS])
#   decode      benchmarks/bench_decode.py (where a strict decode step spends its time; split-K vs cuBLAS)
#               (decode, kernels and sweeps need only torch and triton: no carried wheels)
#   kernels     benchmarks/kernels.py (all kernel tables; the attention tables add vLLM's FA3 as a baseline
#               where vLLM is installed in /tmp/site: run vllm_a, vllm_b earlier on the same machine)
#   matmul      benchmarks/bench_matmul.py (kernels.py's GEMM tables alone: the done-means GEMM rows)
#   sweep_rowtree benchmarks/sweep_rowtree.py $SWEEP_ARGS (K-chunk tree GEMM: tile x kernel x split vs cuBLAS
#               and `linear`; default the row-parallel shapes, `--shapes column --chunks 2` the column ones,
#               `--gluon-only` the Gluon tiles alone (`--shapes column --chunks 1`: `linear`'s Gluon buckets);
#               logs named after the args, so one call can run several; $SWEEP_TIMEOUT, default 560 s)
#   attention   benchmarks/bench_attention.py (tables $ATTENTION_TABLES, default training,prefill,decode)
#   host_attention benchmarks/host_attention.py (host time a call of the attention ops and their pieces)
#   host_logp   benchmarks/host_logp.py $HOST_LOGP_ARGS (host and GPU time a decode step of the sampler's logprob path)
#   sweep_attention benchmarks/sweep_attention.py (attention: tile, load schedule x stages; forwards bitwise-checked,
#               backward tiles checked against the table's gradients; entries $SWEEP_ENTRIES, default decode,prefill;
#               also prefill_linear, bwd_dkdv, bwd_dq: training's forward and backward on 4 x 4,096 packed tokens;
#               $SWEEP_ARGS="--train-seqs 1": on one; "--contract KV_CHUNK=1024": the forward tables under another
#               contract against the current one, in place of the candidates)
#   sweep_logp  benchmarks/sweep_logp.py (linear-logp forwards: the tl kernel, the Gluon one's stages; T = 256, 4096)
#   sweep_logp_each  the same, each candidate of $SWEEP_EACH in its own process under a timeout (a hung kernel costs
#               one candidate, not the call)
#   logp        benchmarks/bench_logp.py (kernels.py's linear-logp section alone)
#   logp_support bench_logp.py's top-p replay table alone (the support kernel's bits against the reference first)
#   sweep_support sweep_logp.py support: the support kernel's warps x slots against the reference's expression
#   probe_limits benchmarks/probe_limits.py $PROBE_ARGS (default logp decode: linear-logp's weight traffic at
#               T = 256, decode programs a pair forced; clocks: clocks and power; mma: mma.sync's bits against wgmma's)
#   probe_decode benchmarks/probe_decode.py $PROBE_ARGS (a timeline of the split decode path's programs: where a
#               small batch's step waits; default batch 1 and 16 at 1k / 4k / 16k keys)
#   probe_merge benchmarks/probe_merge.py (the split decode's merge alone, a state at a time and in two passes)
#   probe_prefill benchmarks/probe_prefill.py $PROBE_ARGS (the Gluon forward with parts of its work left out: its
#               softmax, row sums, rescale, MMAs, loads or device-made descriptors, each timed against the whole;
#               --seq / --seqs: where a program's fixed cost goes; --blocks 64,128: 128-key blocks)
#   probe_partial benchmarks/probe_partial_tiles.py $PROBE_ARGS (each projection at M = 80-128 rows as is, and padded
#               to the decode buckets' full 128-row tile with the copy timed in: whether part-full tiles cost)
#   sweep_gemm_column benchmarks/sweep_gemm.py --column $COLUMN_ARGS (tiles up to 256 rows, swapped ones too, on qkv and
#               gate_up; bits checked against the table's kernel; COLUMN_ARGS="--block-m 128": the 128-row tiles alone)
#   sweep_gemm_large benchmarks/sweep_gemm.py --large (warp-specialised tiles vs the table at M = 256 .. 4096 on
#               qkv and gate_up; bits checked against the table's kernel)
#   sweep_gemm_m benchmarks/sweep_gemm.py --m $GEMM_M (default 128: the decode batch; a comma list: each M), each
#               shape on its own; $GEMM_ARGS more (--shapes gate_up,lm_head: those alone; --rows128: the swapped
#               tiles of 128 x rows alone against the table's config)
set -uo pipefail
OUT=${OUT:-/tmp/lockstep-out}
mkdir -p "$OUT"
SITE=/tmp/site-a

link_lockstep() {
  # lockstep's folders are mapped into the lockstep.* namespace by setup.py; here, by links, and vLLM
  # finds the plugin's entry point only in installed metadata
  mkdir -p $SITE/lockstep $SITE/lockstep_rl-0.1.0.dist-info
  for root in framework kernels launch configs recipes; do ln -sfn "$PWD/$root" "$SITE/lockstep/$root"; done
  printf 'Metadata-Version: 2.1\nName: lockstep-rl\nVersion: 0.1.0\n' > $SITE/lockstep_rl-0.1.0.dist-info/METADATA
  printf '[vllm.general_plugins]\nlockstep = lockstep.framework.rollout.vllm_plugin:register\n' \
    > $SITE/lockstep_rl-0.1.0.dist-info/entry_points.txt
  export PYTHONPATH=$SITE:/tmp/site:$PWD/benchmarks:$PWD/tests:${PYTHONPATH:-}
  export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 LOCKSTEP_REQUIRE_OPTIONAL=1
}

need_site() {  # Ray, Hydra, megatron-core (carried wheels), then lockstep
  if [ ! -f $SITE/.installed ]; then
    [ -d .gpu-wheels/a ] || { echo "wheels .gpu-wheels/a not carried and $SITE not installed"; exit 1; }
    rm -rf $SITE
    python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE .gpu-wheels/a/*.whl > "$OUT/install.log" 2>&1 \
      || { tail -20 "$OUT/install.log"; exit 1; }
    touch $SITE/.installed
  fi
  link_lockstep
  python3 -c "import hydra.core, omegaconf, ray, megatron.core, pytest" || { echo "carried wheels do not import"; exit 1; }
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
rc=0
for stage in "$@"; do
  echo "=== $stage $(date +%T) ==="
  case $stage in
    site)    need_site ;;
    vllm_a)  mkdir -p /tmp/vc/chunks && cp .gpu-vllm/chunks/00 /tmp/vc/chunks/ && ls -la /tmp/vc/chunks ;;
    vllm_b)  mkdir -p /tmp/vc/chunks && cp .gpu-vllm/chunks/01 .gpu-vllm/chunks/MANIFEST /tmp/vc/chunks/ \
               && cp .gpu-vllm/install.sh /tmp/vc/ && (cd /tmp/vc && TARGET=/tmp/site bash install.sh) 2>&1 | tail -5 ;;
    tests)   need_site; timeout ${TESTS_TIMEOUT:-400} python3 -m pytest -q -m gpu ${GPU_TESTS:-tests/test_triton_kernels.py tests/test_triton_logp.py \
               tests/test_attention.py tests/test_tp_invariance.py} -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    kernel_tests) link_lockstep; timeout ${TESTS_TIMEOUT:-400} python3 -m pytest -q -m gpu -n ${TESTS_WORKERS:-4} \
               ${GPU_TESTS:-tests/test_triton_kernels.py tests/test_triton_logp.py tests/test_attention.py} -p no:cacheprovider \
               2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    vllm_tests) need_site; timeout 400 python3 -m pytest -q -m gpu tests/test_vllm_gpu.py -p no:cacheprovider -x 2>&1 \
               | tee "$OUT/vllm_gpu_tests.log" | grep -v "Logging error\|I/O operation" | tail -30 ;;
    e2e)     need_site; rm -rf /tmp/e2e; timeout 500 python3 benchmarks/e2e_1gpu.py /tmp/e2e > "$OUT/e2e.log" 2>&1
             cp /tmp/e2e/e2e.md "$OUT/e2e.md" 2>/dev/null; tail -45 "$OUT/e2e.log" ;;
    e2e_vllm) need_site; rm -rf /tmp/e2e_vllm  # a run refuses a directory that holds one (a warm machine keeps /tmp)
             timeout ${E2E_TIMEOUT:-560} python3 benchmarks/e2e_1gpu.py /tmp/e2e_vllm --modes ${E2E_MODES:-strict,off} \
               rollout=vllm rollout.top_p=0.9 rollout.temperature=0.7 rollout.prompts_per_step=16 rollout.n_samples=8 \
               rollout.max_new_tokens=128 trainer.steps=3 > "$OUT/e2e_vllm.log" 2>&1
             cp /tmp/e2e_vllm/e2e.md "$OUT/e2e_vllm.md" 2>/dev/null; grep -v "Logging error\|I/O operation" "$OUT/e2e_vllm.log" | tail -45 ;;
    e2e_ckpt) need_site; rm -rf /tmp/e2e_ckpt /tmp/e2e_ckpt_vllm
             [ -f /tmp/q17/config.json ] || timeout 200 python3 -m lockstep.launch.cli init-model --like qwen3-1.7b --out /tmp/q17 dtype=bfloat16
             timeout 560 python3 benchmarks/e2e_1gpu.py /tmp/e2e_ckpt --recipe qwen3-1.7b --modes strict model.init_from=/tmp/q17 \
               trainer.steps=3 rollout.max_new_tokens=128 > "$OUT/e2e_ckpt.log" 2>&1
             timeout 560 python3 benchmarks/e2e_1gpu.py /tmp/e2e_ckpt_vllm --recipe qwen3-1.7b --modes strict model.init_from=/tmp/q17 \
               trainer.steps=3 rollout.max_new_tokens=128 rollout=vllm > "$OUT/e2e_ckpt_vllm.log" 2>&1
             cp /tmp/e2e_ckpt/e2e.md "$OUT/e2e_ckpt.md"; cp /tmp/e2e_ckpt_vllm/e2e.md "$OUT/e2e_ckpt_vllm.md"
             tail -30 "$OUT/e2e_ckpt.md" "$OUT/e2e_ckpt_vllm.md" ;;
    train_memory) need_site; timeout 400 python3 benchmarks/bench_train_memory.py "$OUT/train_memory.md" ${MEMORY_ARGS:-} \
               > "$OUT/train_memory.log" 2>&1; tail -20 "$OUT/train_memory.log" ;;
    resume)  need_site; timeout 500 python3 benchmarks/resume_1gpu.py /tmp/resume ${RESUME_ARGS:-} > "$OUT/resume.log" 2>&1
             cp /tmp/resume/resume.md "$OUT/resume.md" 2>/dev/null; grep -v "Logging error\|I/O operation" "$OUT/resume.log" | tail -20 ;;
    rollout) need_site; timeout 590 python3 benchmarks/bench_rollout.py "$OUT/rollout.md" ${ROLLOUT_ARGS:-} > "$OUT/rollout.log" 2>&1
             tail -20 "$OUT/rollout.log" ;;
    rollout_ab) need_site; other=${AB_KERNELS:-.ab/old/kernels}
             [ -d "$other" ] || { echo "rollout_ab: $other not carried"; rc=1; continue; }
             for side in other this; do
               ln -sfn "$PWD/$([ $side = other ] && echo "$other" || echo kernels)" $SITE/lockstep/kernels
               timeout 280 python3 benchmarks/bench_rollout.py "$OUT/rollout_ab_$side.md" ${ROLLOUT_AB_ARGS:---shapes 8b} \
                 --configs lockstep --timeout 150 > "$OUT/rollout_ab_$side.log" 2>&1
               echo "kernels: $side"; tail -3 "$OUT/rollout_ab_$side.md"
             done
             ln -sfn "$PWD/kernels" $SITE/lockstep/kernels ;;
    ab_decode) link_lockstep; timeout 300 python3 benchmarks/ab_decode.py "${AB_OLD:-OLD.py}" ${AB_CASES:-} > "$OUT/ab_decode.log" 2>&1
             tail -16 "$OUT/ab_decode.log" ;;
    decode)  link_lockstep; timeout 300 python3 benchmarks/bench_decode.py "$OUT/decode.md" > "$OUT/decode.log" 2>&1; tail -40 "$OUT/decode.log" ;;
    sweep_rowtree) link_lockstep; tag=$(printf %s "${SWEEP_ARGS:-}" | tr -cs 'a-z0-9' '_')
             timeout ${SWEEP_TIMEOUT:-560} python3 benchmarks/sweep_rowtree.py "$OUT/sweep_rowtree$tag.md" ${SWEEP_ARGS:-} \
               > "$OUT/sweep_rowtree$tag.log" 2>&1
             tail -40 "$OUT/sweep_rowtree$tag.log" ;;
    sweep_attention) link_lockstep; timeout 330 python3 benchmarks/sweep_attention.py --entries "${SWEEP_ENTRIES:-decode,prefill}" ${SWEEP_ARGS:-} \
               > "$OUT/sweep_attention.log" 2>&1; grep -E "BEST|DIFFER|failed|CONTRACT" "$OUT/sweep_attention.log" ;;
    host_attention) link_lockstep; timeout 200 python3 benchmarks/host_attention.py > "$OUT/host_attention.log" 2>&1
             tail -14 "$OUT/host_attention.log" ;;
    host_logp) link_lockstep; timeout 200 python3 benchmarks/host_logp.py ${HOST_LOGP_ARGS:-} > "$OUT/host_logp.log" 2>&1
             tail -14 "$OUT/host_logp.log" ;;
    attention) link_lockstep; timeout 330 python3 benchmarks/bench_attention.py --tables "${ATTENTION_TABLES:-training,prefill,decode}" \
               > "$OUT/attention.log" 2>&1; tail -40 "$OUT/attention.log" ;;
    sweep_logp) link_lockstep; timeout 300 python3 benchmarks/sweep_logp.py > "$OUT/sweep_logp.log" 2>&1; tail -12 "$OUT/sweep_logp.log" ;;
    sweep_logp_each) link_lockstep  # each of $SWEEP_EACH (candidate indices) in its own process, $SWEEP_EACH_TIMEOUT s each
             for i in ${SWEEP_EACH:-1 2}; do SWEEP_CANDIDATES=0,$i timeout ${SWEEP_EACH_TIMEOUT:-90} python3 benchmarks/sweep_logp.py \
               >> "$OUT/sweep_logp_each.log" 2>&1 || echo "candidate $i: exit $?" >> "$OUT/sweep_logp_each.log"; done
             tail -30 "$OUT/sweep_logp_each.log" ;;
    sweep_gemm_column) link_lockstep; timeout ${SWEEP_TIMEOUT:-300} python3 benchmarks/sweep_gemm.py --column ${COLUMN_ARGS:-} \
               > "$OUT/sweep_gemm_column.log" 2>&1; tail -16 "$OUT/sweep_gemm_column.log" ;;
    sweep_gemm_large) link_lockstep; timeout ${SWEEP_TIMEOUT:-300} python3 benchmarks/sweep_gemm.py --large \
               > "$OUT/sweep_gemm_large.log" 2>&1; tail -40 "$OUT/sweep_gemm_large.log" ;;
    sweep_gemm_m) link_lockstep; timeout 330 python3 benchmarks/sweep_gemm.py --m "${GEMM_M:-128}" ${GEMM_ARGS:-} \
               > "$OUT/sweep_gemm_m.log" 2>&1; grep "current" "$OUT/sweep_gemm_m.log" | tail -12 ;;
    logp_support) link_lockstep; timeout 200 python3 -c "import lockstep.kernels as K, bench_logp as b; K.set_backend('triton'); print(b.support_table())" \
               > "$OUT/logp_support.log" 2>&1; tail -8 "$OUT/logp_support.log" ;;
    sweep_support) link_lockstep; timeout 300 python3 benchmarks/sweep_logp.py support > "$OUT/sweep_support.log" 2>&1
             tail -14 "$OUT/sweep_support.log" ;;
    probe_limits) link_lockstep; timeout 400 python3 benchmarks/probe_limits.py ${PROBE_ARGS:-logp decode} \
               > "$OUT/probe_limits.log" 2>&1; tail -30 "$OUT/probe_limits.log" ;;
    probe_decode) link_lockstep; timeout 300 python3 benchmarks/probe_decode.py ${PROBE_ARGS:-} \
               > "$OUT/probe_decode.log" 2>&1; tail -30 "$OUT/probe_decode.log" ;;
    probe_merge) link_lockstep; timeout 200 python3 benchmarks/probe_merge.py > "$OUT/probe_merge.log" 2>&1
             tail -10 "$OUT/probe_merge.log" ;;
    probe_partial) link_lockstep; timeout 200 python3 benchmarks/probe_partial_tiles.py "$OUT/probe_partial.md" ${PROBE_ARGS:-} \
               > "$OUT/probe_partial.log" 2>&1; tail -24 "$OUT/probe_partial.log" ;;
    probe_prefill) link_lockstep; timeout 240 python3 benchmarks/probe_prefill.py ${PROBE_ARGS:-} \
               > "$OUT/probe_prefill.log" 2>&1; tail -20 "$OUT/probe_prefill.log" ;;
    logp)    link_lockstep; timeout 300 python3 benchmarks/bench_logp.py > "$OUT/logp.log" 2>&1; tail -30 "$OUT/logp.log" ;;
    kernels) link_lockstep; timeout 330 python3 benchmarks/kernels.py "$OUT/kernels.md" > "$OUT/kernels.log" 2>&1; tail -80 "$OUT/kernels.log" ;;
    matmul)  link_lockstep; timeout 200 python3 benchmarks/bench_matmul.py > "$OUT/matmul.log" 2>&1; tail -60 "$OUT/matmul.log" ;;
    *)       echo "unknown stage $stage"; rc=2 ;;
  esac
done
exit $rc
