"""vLLM rollout engine (one Ray actor per engine; `rollout.num_engines` of them round-robin).

Every sample is its own vLLM request with its own seed (per-sample seeds, batch-independent).
Logprobs come from vLLM with `logprobs_mode=processed_logprobs`: the sampled token's entry is
lockstep's logprob when the rollout's logp module is R (the plugin's sampler hook), and the
finite entries of the top window are the sampler's exact top-p/top-k support, which the trainer
replays. Weights arrive as versioned, checksummed HF-named payloads and are reloaded in place.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import vllm  # noqa: F401  (an environment without vLLM reports this backend unavailable)

from lockstep.framework.consistency.readback import write_readback
from lockstep.framework.models.ops import Selection
from lockstep.framework.models.qwen3 import CONFIG_FILE, Qwen3Config, hf_groups
from lockstep.framework.rollout.base import Rollout, RolloutEngine, SamplingParams
from lockstep.framework.rollout.faults import check_fault
from lockstep.framework.rollout.vllm_plugin import ENV
from lockstep.framework.weights import sync as sync_errors
from lockstep.framework.weights.sync import Bucket, WeightSyncError

log = logging.getLogger(__name__)
WORKER_EXTENSION = "lockstep.framework.rollout.vllm_plugin.worker.LockstepWorkerExtension"


def vllm_env(device: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set in the engine process, inherited by the processes vLLM spawns. The model runner is the
    one the plugin's sampler hook was run on, named rather than left to vLLM's choice: V2 on CUDA
    (what stock vLLM 0.26 runs dense models with; a configuration V2 cannot run is then vLLM's
    error, not a silent switch), V1 on vLLM's CPU build (whose weight reload repacks its oneDNN
    handles). A VLLM_USE_V2_MODEL_RUNNER the user set in `environ` is kept, and logged: the plugin
    hooks both runners."""
    env = {"VLLM_USE_V2_MODEL_RUNNER": "1" if device == "cuda" else "0",
           # vLLM's compile cache key knows neither the plugin's code nor the determinism config: a
           # cached graph could be another configuration's
           "VLLM_DISABLE_COMPILE_CACHE": "1"}
    user = (os.environ if environ is None else environ).get("VLLM_USE_V2_MODEL_RUNNER")
    if user is not None and user != env["VLLM_USE_V2_MODEL_RUNNER"]:
        log.warning("VLLM_USE_V2_MODEL_RUNNER=%s is set: kept (lockstep's default on %s is %s)", user, device,
                    env["VLLM_USE_V2_MODEL_RUNNER"])
        env["VLLM_USE_V2_MODEL_RUNNER"] = user
    return env


def engine_kwargs(device: str, *, tensor_parallel_size: int, max_model_len: int, max_logprobs: int,
                  max_batch: int, gpu_memory_utilization: float, dtype: str, seed: int, enforce_eager: bool,
                  lockstep_attention: bool) -> dict:
    """vLLM engine arguments. Compiled unless enforce_eager; on CUDA also sleep mode for colocation
    and one CUDA graph per decode batch size 1..max_batch (exact-batch FULL_DECODE_ONLY capture: no
    decode batch is padded to a larger graph size), and lockstep's attention backend by name."""
    kwargs = dict(skip_tokenizer_init=True, load_format="dummy", dtype=dtype, seed=seed,
                  tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
                  enable_prefix_caching=False, logprobs_mode="processed_logprobs", max_logprobs=max_logprobs,
                  worker_extension_cls=WORKER_EXTENSION, max_num_seqs=max_batch, enforce_eager=enforce_eager)
    if device == "cuda":
        kwargs.update(enable_sleep_mode=True, gpu_memory_utilization=gpu_memory_utilization)
        if lockstep_attention:
            kwargs["attention_backend"] = "CUSTOM"  # the plugin registered lockstep's backend under it
        if not enforce_eager:
            kwargs["compilation_config"] = {"cudagraph_mode": "FULL_DECODE_ONLY",
                                            "cudagraph_capture_sizes": list(range(1, max_batch + 1)),
                                            # keep every rounding the eager code does (Inductor would fuse
                                            # a downcast into the next op and skip it)
                                            "inductor_compile_config": {"emulate_precision_casts": True}}
    return kwargs


class VllmRolloutEngine(RolloutEngine):
    def __init__(self, model_config: dict, *, determinism: dict, real_vocab_size: int, eos_ids: list[int], pad_id: int,
                 num_threads: int = 1, tensor_parallel_size: int = 1, max_support: int = 64,
                 max_batch: int = 256, gpu_memory_utilization: float = 0.4, kv_cache_gib: float = 1.0,
                 max_model_len: int | None = None, seed: int = 0, engine_index: int = 0, dtype: str = "float32",
                 enforce_eager: bool | str = "auto"):
        check_fault(determinism.get("inject_fault", "none"))
        torch.set_num_threads(num_threads)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.cfg = Qwen3Config(**model_config)
        self.real_vocab_size, self.eos_ids, self.pad_id = real_vocab_size, list(eos_ids), pad_id
        self.window = min(max_support + 1, self.cfg.vocab_size)  # one past max_support detects overflow
        self.workdir = Path(tempfile.mkdtemp(prefix="lockstep-vllm-"))
        model_dir = self.workdir / "model"
        model_dir.mkdir()
        (model_dir / CONFIG_FILE).write_text(json.dumps({**self.cfg.to_hf(dtype), "lockstep_real_vocab_size": real_vocab_size}))
        # Read by the plugin in every vLLM process (inherited by the processes vLLM spawns).
        os.environ[ENV] = json.dumps(determinism)
        os.environ.update(vllm_env(self.device))
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(kv_cache_gib))))
        from vllm import LLM

        if enforce_eager == "auto":  # compiled with CUDA graphs on a GPU; eager on a CPU (faster start)
            enforce_eager = self.device != "cuda"
        t0 = time.perf_counter()
        self.llm = LLM(model=str(model_dir), **engine_kwargs(
            self.device, tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len or self.cfg.max_position_embeddings, max_logprobs=self.window,
            max_batch=max_batch, gpu_memory_utilization=gpu_memory_utilization, dtype=dtype, seed=seed,
            enforce_eager=bool(enforce_eager), lockstep_attention=Selection.for_side(determinism, "rollout").attention))
        self.llm.collective_rpc("lockstep_install", args=([n for g in hf_groups(self.cfg) for n in g],))
        self.startup_s = time.perf_counter() - t0
        self.tensor_parallel_size, self.engine_index = tensor_parallel_size, engine_index
        self.version, self.consistent = -1, True
        if self.device == "cpu":
            log.warning("vLLM's CPU build has no sleep mode: colocated sleep/wake is skipped, the KV cache stays allocated")

    # ---- weights -------------------------------------------------------------------------------
    def receive_bucket(self, bucket: Bucket) -> dict:
        """The bucket goes to every vLLM worker as one message (plain types: an IPC handle or the
        bytes), where it is verified and loaded into the worker's parameters (worker.py)."""
        answers = self.llm.collective_rpc("lockstep_receive", args=(bucket.as_message(),))
        self.consistent = all(a.pop("consistent") for a in answers)
        for a in answers:
            if "refused" in a:
                raise getattr(sync_errors, a["refused"])(a["message"])
        self.version = min(a.pop("version") for a in answers)
        return {k: max(a[k] for a in answers) for k in answers[0]}

    def write_readback(self, run_dir: str) -> list[str]:
        """One readback per vLLM worker process (they ran the ops), named by this engine's index."""
        return [write_readback(run_dir, {**rb, "instance": self.engine_index})
                for rb in self.llm.collective_rpc("lockstep_readback")]

    def sleep(self) -> str:
        if self.device != "cuda":
            return "sleep skipped: vLLM's CPU build has no sleep mode"
        self.llm.sleep(level=1)
        return "slept (level 1: weights offloaded to the host, KV cache freed)"

    def wake(self, what: str) -> str:
        if self.device != "cuda":
            return "wake skipped: vLLM's CPU build has no sleep mode"
        self.llm.wake_up(tags=[what])
        return f"woken: {what}"

    def shutdown(self) -> None:
        """Stop vLLM's engine-core processes (freeing their memory) and remove the work dir."""
        core = getattr(getattr(getattr(self, "llm", None), "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        shutil.rmtree(self.workdir, ignore_errors=True)

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seeds: list[list[int]]) -> Rollout:
        from vllm import SamplingParams as VllmSampling
        from vllm.inputs import TokensPrompt

        if self.version < 0:
            raise RuntimeError("generate called before the first weight sync")
        if not self.consistent:
            raise WeightSyncError("the engine's weights are partly one version and partly the next: a weight update "
                                  "failed in its load pass; sync again before generating")
        rows = [(p, s) for p, ss in zip(prompts, seeds) for s in ss]
        params = [VllmSampling(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                               top_k=sampling.top_k if sampling.top_k else 0, max_tokens=sampling.max_new_tokens,
                               seed=int(s) % (2**31), logprobs=self.window if sampling.restricts_support else 0,
                               stop_token_ids=self.eos_ids, detokenize=False, skip_special_tokens=False)
                  for _, s in rows]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p, _ in rows], params, use_tqdm=False)
        return self._assemble([p for p, _ in rows], [o.outputs[0] for o in outs], sampling)

    def _assemble(self, prompts, completions, sampling: SamplingParams) -> Rollout:
        b = len(prompts)
        responses = [list(c.token_ids) for c in completions]
        r_max = max(len(r) for r in responses)
        prompt_lens = torch.tensor([len(p) for p in prompts])
        response_lens = torch.tensor([len(r) for r in responses])
        tokens = torch.full((b, int((prompt_lens + response_lens).max())), self.pad_id, dtype=torch.long)
        logp = torch.zeros(b, r_max)
        supports: list[list[list[int]]] = []
        for i, (p, r, c) in enumerate(zip(prompts, responses, completions)):
            tokens[i, : len(p)] = torch.tensor(p)
            tokens[i, len(p): len(p) + len(r)] = torch.tensor(r, dtype=torch.long)
            row_support = []
            for j, (tok, entries) in enumerate(zip(r, c.logprobs)):
                logp[i, j] = entries[tok].logprob
                row_support.append([t for t, e in entries.items() if math.isfinite(e.logprob)])
            supports.append(row_support)
        support = None
        if sampling.restricts_support:
            width = max(len(s) for row in supports for s in row)
            support = torch.full((b, r_max, width), -1, dtype=torch.long)
            for i, row in enumerate(supports):
                for j, ids in enumerate(row):
                    support[i, j, : len(ids)] = torch.tensor(ids)
        finished = torch.tensor([c.finish_reason == "stop" for c in completions])
        return Rollout(tokens, prompt_lens, response_lens, logp, support, finished, self.version, sampling)
