"""lockstep's vLLM plugin (entry point group `vllm.general_plugins`, name `lockstep`).

vLLM calls `register()` in every one of its processes. It does nothing unless the lockstep vLLM
engine asked for it by setting LOCKSTEP_VLLM_DETERMINISM (the run's determinism config as JSON),
so installing lockstep never changes a plain vLLM user's model. When asked, it
- registers `LockstepQwen3ForCausalLM` for the Qwen3ForCausalLM architecture (model registry);
- when the rollout side runs lockstep attention, registers `LockstepAttentionBackend` as the
  CUSTOM backend (which the engine selects on CUDA with attention_backend="CUSTOM") and as CPU_ATTN
  (vLLM's CPU platform always takes that one).
The sampler hook lives in the worker extension (worker.py), installed by the engine through
`collective_rpc` after start-up.

Internal hooks used (checked on the versions in TESTED_VLLM_VERSIONS): the CPU linear flag
`_cpu_skip_gemm_dispatch` (0.32), `worker.model_runner.sampler` of the V2 model runner (CUDA, 0.26:
its `sampling_states`) and of the V1 runner with its `reload_weights` (vLLM's CPU build, 0.32); the
engine names the runner (VLLM_USE_V2_MODEL_RUNNER), the attention backend interface (attention.py).
"""
from __future__ import annotations

import json
import os

ENV = "LOCKSTEP_VLLM_DETERMINISM"
ATTENTION_BACKEND = "lockstep.framework.rollout.vllm_plugin.attention.LockstepAttentionBackend"
TESTED_VLLM_VERSIONS = ("0.26.0", "0.32.0")
_registered = False


def plugin_determinism() -> dict | None:
    raw = os.environ.get(ENV)
    return json.loads(raw) if raw else None


def check_vllm_version(version: str, mode: str) -> None:
    if version not in TESTED_VLLM_VERSIONS and mode in ("strict", "audit"):
        raise RuntimeError(f"lockstep's vLLM plugin was tested on vLLM {', '.join(TESTED_VLLM_VERSIONS)}; "
                           f"found {version}. Its internal hooks may have moved: run with "
                           f"determinism.mode=auto or off, or pin a tested version.")


def register() -> None:
    global _registered
    det = plugin_determinism()
    if det is None or _registered:
        return
    import vllm
    from vllm import ModelRegistry

    check_vllm_version(vllm.__version__, det["mode"])
    ModelRegistry.register_model("Qwen3ForCausalLM",
                                 "lockstep.framework.rollout.vllm_plugin.model:LockstepQwen3ForCausalLM")
    from lockstep.framework.models.ops import Selection

    if Selection.for_side(det, "rollout").attention:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        for backend in (AttentionBackendEnum.CUSTOM, AttentionBackendEnum.CPU_ATTN):
            register_backend(backend, ATTENTION_BACKEND)
    _registered = True
