"""Rollout throughput side by side on one GPU: stock vLLM, vLLM's batch-invariant mode, vLLM with
lockstep (strict) and lockstep's native engine (strict), on dummy (random) weights.

    python benchmarks/bench_rollout.py OUT.md [--shapes 1.7b,8b] [--configs stock,batch_invariant,lockstep,native]
                                              [--profile-steps N]

Workloads (the issue's): 1.7b = Qwen3-1.7B shape, 128 requests x (64 prompt + 256 new tokens);
8b = Qwen3-8B shape, 128 x (64 + 1024) (the reference workload's batch). Every request samples at
temperature 1 with its own seed and returns its sampled token's logprob (what RL needs); generation
never stops early (ignore_eos), so every config generates the same number of tokens. Each config
runs in its own process (vLLM's batch-invariant switch is read at import): engine start-up is timed
apart from the generation. Baselines at their best: vLLM 0.26's defaults (torch.compile + CUDA
graphs FULL_AND_PIECEWISE, FlashAttention 3 on Hopper), gpu_memory_utilization 0.85 for every vLLM
config. The native engine runs a shorter generation at the 8B shape (--native-new-8b) and says so.
Each row also gives the GPU's median SM clock and board power over its timed generation
(_harness.PowerLog): a config at the board's power limit runs at a lowered clock, so its speed
follows its energy a token, and two hosts with different limits or cooling read differently.

--profile-steps N (vLLM configs): after the timed generation, the same requests generate 1 token and
then N tokens under torch.profiler, with vLLM's engine core in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), and OUT.<shape>-<config>.profile.md gets the difference per decode
step (the prefill step taken out): wall and GPU-busy time, kernels by GPU time and host ops by CPU time,
i.e. where a decode step spends its time inside the real engine.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import PowerLog, emit

SHAPES = {
    "1.7b": dict(model="qwen3-1.7b", prompt=64, new=256, requests=128),
    "8b": dict(model="qwen3-8b", prompt=64, new=1024, requests=128),
}
CONFIGS = ("stock", "batch_invariant", "lockstep", "native")


def model_shape(name: str) -> dict:
    import yaml

    group = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "model" / f"{name}.yaml").read_text())
    from lockstep.framework.models.qwen3 import SHAPE_KEYS

    return {k: group[k] for k in SHAPE_KEYS}


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(10, min(vocab, 150000), (n, length), generator=g).tolist()


def _profiled(llm, ps, steps: int):
    """One generate of `steps` new tokens per request under torch.profiler: (wall s, {kernel: (calls,
    GPU us)}, {host op: (calls, self CPU us)})."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, max_tokens=steps, ignore_eos=True, seed=i, logprobs=0, detokenize=False)
              for i in range(len(ps))]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(ps, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    gpu = {e.key: (e.count, e.device_time_total) for e in events
           if e.device_time_total > 0 and e.device_type.name == "CUDA"}
    cpu = {e.key: (e.count, e.self_cpu_time_total) for e in events if e.device_type.name == "CPU"}
    return wall, gpu, cpu


def profile_generate(llm, ps, steps: int, path: str) -> None:
    """Where a decode step spends its time: the same requests generate 1 token (the prefill step)
    and then `steps` tokens under torch.profiler; the difference over the steps - 1 decode steps is
    each kernel's and host op's cost per decode step, without the prefill (which at a long prompt
    batch dominates a short profile). A first profiled generate is thrown away: the profiler's own
    start-up lands in it (stock vLLM's profiled 1-token generate once took longer than the 16-token
    one, which made its per-step wall negative)."""
    _profiled(llm, ps, 1)
    wall1, gpu1, cpu1 = _profiled(llm, ps, 1)
    wall, gpu, cpu = _profiled(llm, ps, steps)
    n = steps - 1

    def per_step(now: dict, prefill: dict) -> list[tuple[str, float, float]]:
        rows = [(k, (c - prefill.get(k, (0, 0))[0]) / n, (t - prefill.get(k, (0, 0))[1]) / 1e3 / n)
                for k, (c, t) in now.items()]
        return sorted(rows, key=lambda r: -r[2])

    kernels = per_step(gpu, gpu1)
    busy = sum(ms for _, _, ms in kernels)
    lines = [f"{len(ps)} requests: generating {steps} tokens minus generating 1 (the prefill step), per decode step "
             f"of {n}: wall {(wall - wall1) * 1e3 / n:.2f} ms, GPU busy {busy:.2f} ms (prefill step alone: wall "
             f"{wall1 * 1e3:.1f} ms)", "",
             "| kernel | calls per step | GPU ms per step | share of busy |", "|---|---|---|---|"]
    lines += [f"| `{k[:90]}` | {c:.1f} | {ms:.3f} | {ms / busy:.1%} |" for k, c, ms in kernels[:30]]
    lines += ["", "| host op (self CPU) | calls per step | ms per step |", "|---|---|---|"]
    lines += [f"| `{k[:90]}` | {c:.1f} | {ms:.3f} |" for k, c, ms in per_step(cpu, cpu1)[:25]]
    emit(lines, path)


def run_vllm(config: str, shape: dict, out: dict, profile_steps: int = 0, profile_path: str | None = None) -> None:
    from lockstep.framework.models.qwen3 import Qwen3Config

    if profile_steps:  # the engine core in this process, where torch.profiler sees its kernels
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    cfg = Qwen3Config(**model_shape(shape["model"]))
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    (work / "config.json").write_text(json.dumps(cfg.to_hf("bfloat16")))
    if config == "lockstep":
        from lockstep.framework.rollout.vllm_engine import engine_kwargs, vllm_env

        det = dict(mode="strict", case="R/R", attention=1, ffn=1, logp=1, on_mismatch="auto", inject_fault="none",
                   provider="lockstep.kernels.provider:linear_logp_provider")
        os.environ.update(vllm_env("cuda"), LOCKSTEP_VLLM_DETERMINISM=json.dumps(det))
        kwargs = engine_kwargs("cuda", tensor_parallel_size=1, max_model_len=shape["prompt"] + shape["new"] + 16,
                               max_logprobs=1, max_batch=shape["requests"], gpu_memory_utilization=0.85,
                               dtype="bfloat16", seed=0, enforce_eager=False, lockstep_attention=True)
        kwargs.pop("enable_sleep_mode")
    else:
        if config == "batch_invariant":
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
        kwargs = dict(skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16", seed=0,
                      max_model_len=shape["prompt"] + shape["new"] + 16, enable_prefix_caching=False,
                      max_num_seqs=shape["requests"], gpu_memory_utilization=0.85, max_logprobs=1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=str(work), **kwargs)
    if config == "lockstep":
        from lockstep.framework.models.qwen3 import hf_groups

        llm.collective_rpc("lockstep_install", args=([n for g in hf_groups(cfg) for n in g],))
    out["startup_s"] = time.perf_counter() - t0
    ps = [TokensPrompt(prompt_token_ids=p) for p in prompts(shape["requests"], shape["prompt"], cfg.vocab_size)]
    params = [SamplingParams(temperature=1.0, max_tokens=shape["new"], ignore_eos=True, seed=i, logprobs=0,
                             detokenize=False) for i in range(len(ps))]
    # Warm-up: the timed batch and sampling (logprobs included), 8 tokens, so that every Triton kernel
    # either side JIT-compiles on first use (prefill at 128 x 64 rows, the logprob path) does so here,
    # not inside the timing: an RL run pays it once in its first step.
    llm.generate(ps, [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=i, logprobs=0,
                                     detokenize=False) for i in range(len(ps))], use_tqdm=False)
    with PowerLog() as power:
        t0 = time.perf_counter()
        res = llm.generate(ps, params, use_tqdm=False)
        out["gen_s"] = time.perf_counter() - t0
    out["power"] = power.summary()
    out["tokens"] = sum(len(r.outputs[0].token_ids) for r in res)
    assert all(r.outputs[0].logprobs for r in res), "no logprobs returned"
    if config == "lockstep":  # evidence that lockstep's attention and logprob ran in the worker
        calls = llm.collective_rpc("lockstep_readback")[0]["kernel_calls"]
        out["note"] = f"paged_attention calls {calls['paged_attention']}, linear_logp calls {calls['linear_logp']}"
    if profile_steps:
        out["note"] = (out.get("note", "") + " engine core in this process (profiled run)").strip()
        profile_generate(llm, ps, profile_steps, profile_path)


def run_native(shape: dict, out: dict, new_tokens: int) -> None:
    import torch

    from lockstep.framework.models.qwen3 import Qwen3Config
    from lockstep.framework.rollout.base import SamplingParams
    from lockstep.framework.rollout.native import NativeRolloutEngine

    cfg = Qwen3Config(**model_shape(shape["model"]))
    det = dict(mode="strict", case="R/R", attention=1, ffn=1, logp=1, on_mismatch="auto", inject_fault="none",
               provider="lockstep.kernels.provider:linear_logp_provider")
    t0 = time.perf_counter()
    engine = NativeRolloutEngine({**model_shape(shape["model"])}, determinism=det, real_vocab_size=cfg.vocab_size,
                                 eos_ids=[-1], pad_id=0, device="cuda", dtype="bfloat16")
    with torch.no_grad():
        for p in engine.model.parameters():
            p.normal_(0, 0.02)
    engine.receiver.version = 0  # random weights stand in for a sync
    out["startup_s"] = time.perf_counter() - t0
    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    ps = prompts(shape["requests"], shape["prompt"], cfg.vocab_size)
    engine.generate(ps, SamplingParams(temperature=1.0, max_new_tokens=4), [[i] for i in range(len(ps))])  # warm-up
    torch.cuda.synchronize()
    with PowerLog() as power:
        t0 = time.perf_counter()
        ro = engine.generate(ps, sp, [[i] for i in range(len(ps))])
        torch.cuda.synchronize()
        out["gen_s"] = time.perf_counter() - t0
    out["power"] = power.summary()
    out["tokens"] = int(ro.response_lens.sum())
    out["new_tokens"] = new_tokens


def child(args) -> None:
    out = {"config": args.child, "shape": args.shape}
    shape = SHAPES[args.shape]
    try:
        if args.child == "native":
            run_native(shape, out, shape["new"] if args.shape != "8b" else args.native_new_8b)
        else:
            run_vllm(args.child, shape, out, args.profile_steps,
                     f"{args.profile_out}.{args.shape}-{args.child}.profile.md" if args.profile_out else None)
    except Exception as e:  # noqa: BLE001 - reported in the table
        out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", nargs="?")
    p.add_argument("--shapes", default="1.7b,8b")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--native-new-8b", type=int, default=128)
    p.add_argument("--timeout", type=int, default=400, help="seconds per config")
    p.add_argument("--profile-steps", type=int, default=0, help="vLLM configs: profile this many more steps")
    p.add_argument("--profile-out", help=argparse.SUPPRESS)
    p.add_argument("--child")
    p.add_argument("--shape")
    args = p.parse_args()
    if args.profile_steps == 1:
        p.error("--profile-steps needs at least 2: the profile subtracts a 1-token (prefill) generate")
    if args.child:
        return child(args)
    rows = []
    for shape in args.shapes.split(","):
        for config in args.configs.split(","):
            cmd = [sys.executable, __file__, "--child", config, "--shape", shape, "--native-new-8b", str(args.native_new_8b),
                   "--profile-steps", str(args.profile_steps)]
            if args.out:
                cmd += ["--profile-out", str(Path(args.out).with_suffix(""))]
            t0 = time.perf_counter()
            # its own session: a timed-out config's vLLM engine-core process dies with it (else it keeps
            # the GPU's memory and every later config fails to start)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            try:
                stdout, stderr = proc.communicate(timeout=args.timeout)
                if args.out:  # each config's own log, for the root cause of a failure
                    Path(args.out).with_suffix(f".{shape}-{config}.log").write_text(stdout + stderr)
                lines = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
                r = json.loads(lines[-1][7:]) if lines else {"config": config, "shape": shape,
                                                             "error": (stderr or stdout)[-300:]}
                import re

                seen = re.findall(r"Using (?:AttentionBackendEnum\.)?(\w+) (?:attention )?backend", stderr + stdout)
                if seen:
                    r["note"] = (r.get("note", "") + f" attention backend {seen[-1]}").strip()
            except subprocess.TimeoutExpired:
                r = {"config": config, "shape": shape, "error": f"timed out after {args.timeout} s"}
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            r["wall_s"] = time.perf_counter() - t0
            rows.append(r)
            print(json.dumps(r), flush=True)
    lines = ["| shape | config | tokens | gen s | tok/s | vs stock | start-up s | SM clock, power (median, generation) | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for shape in args.shapes.split(","):
        stock = next((r for r in rows if r["shape"] == shape and r["config"] == "stock" and "error" not in r), None)
        base = stock["tokens"] / stock["gen_s"] if stock else None
        for r in (r for r in rows if r["shape"] == shape):
            if "error" in r:
                lines.append(f"| {shape} | {r['config']} | | | | | | | {r['error'][:120]} |")
                continue
            tps = r["tokens"] / r["gen_s"]
            note = r.get("note", "")
            if r.get("new_tokens") not in (None, SHAPES[shape]["new"]):
                note += f" {r['new_tokens']} new tokens per request"
            vs = f"{tps / base:.3f}" if base else ""
            lines.append(f"| {shape} | {r['config']} | {r['tokens']} | {r['gen_s']:.2f} | {tps:,.0f} | {vs} | "
                         f"{r['startup_s']:.0f} | {r.get('power', '')} | {note} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
