"""Worker-side hooks, reached by the engine through `collective_rpc` on vLLM's
`worker_extension_cls`: the sampler replacement, weight loading with a post-load checksum, and
the readback of this worker process."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from vllm.platforms import current_platform
from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler, apply_top_k_top_p
from vllm.v1.sample.sampler import Sampler

from lockstep.framework.consistency.readback import readback
from lockstep.framework.rollout.faults import faulty_logp
from lockstep.framework.rollout.vllm_plugin import plugin_determinism
from lockstep.framework.rollout.vllm_plugin.evidence import process_ops
from lockstep.framework.weights.sync import Bucket, WeightReceiver, WeightSyncError
from lockstep.kernels import skipping_value_checks


class SupportWindowError(RuntimeError):
    pass


def support_from_logprobs(ids: torch.Tensor, logprobs: torch.Tensor, real_vocab: int) -> torch.Tensor:
    """The sampler's kept ids per row from processed logprobs (ids outside the top-k/top-p support
    are -inf there) -> [rows, k] with -1 in unused slots. Column 0 (the sampled token) is skipped:
    it reappears among the top columns whenever it is in the support."""
    top_ids, top_lp = ids[:, 1:], logprobs[:, 1:]
    kept = torch.isfinite(top_lp)
    window = top_ids.shape[1]
    if window < real_vocab and bool(kept.all(1).any()):
        raise SupportWindowError(f"a top-p/top-k support fills the whole {window}-id logprob window, so it "
                                 f"may hold more ids: raise rollout.max_support")
    return torch.where(kept, top_ids, torch.full_like(top_ids, -1))


class SeededTopKTopP(TopKTopPSampler):
    """vLLM's V1 top-k/top-p sampler whose random draw, on CUDA, takes every request of the batch in
    one launch: the Gumbel-max kernel of vLLM's V2 model runner (what stock vLLM 0.26 samples with),
    its noise a function of the request's seed and the position of its last input token, instead
    of V1's loop of one exponential_ launch per seeded request (at a batch of 128 that loop was half
    of a decode step's host launches). The same seed and position draw the same token whatever else
    is in the batch. A batch with a request that has no seed of its own, and vLLM's CPU build, keep
    V1's own draw; top-k/top-p filtering and the processed logprobs are V1's."""

    def __init__(self, base: TopKTopPSampler, positions: Callable[[int], np.ndarray]):
        super().__init__(base.logprobs_mode, base.use_fp64_gumbel)
        self.positions = positions  # tokens held by each of the batch's first n requests (host)
        self.batched_draws = 0
        self._rows = self._ones = None  # arange / ones of the largest batch seen (device), sliced per step
        if current_platform.is_cuda():
            from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

            self._gumbel_sample, self._v1_forward, self.forward = gumbel_sample, self.forward, self.forward_seeded

    def forward_seeded(self, logits, generators, k, p):
        n = logits.shape[0]
        if len(generators) != n:  # a request without its own seed: V1's draw (global RNG for it)
            return self._v1_forward(logits, generators, k, p)
        logits = apply_top_k_top_p(logits, k, p)
        processed = None
        if self.logprobs_mode == "processed_logits":
            processed = logits
        elif self.logprobs_mode == "processed_logprobs":
            processed = logits.log_softmax(dim=-1, dtype=torch.float32)
        host = np.empty((2, n), dtype=np.int64)
        host[0] = [generators[i].initial_seed() for i in range(n)]
        host[1] = self.positions(n) - 1  # the last input token's position, as the V2 runner keys it
        seed, pos = torch.from_numpy(host).pin_memory().to(logits.device, non_blocking=True)
        if self._rows is None or self._rows.numel() < n:
            self._rows = torch.arange(n, device=logits.device)
            # the temperature was applied by the caller (Sampler.sample); ones make the kernel add noise to every row
            self._ones = torch.ones(n, device=logits.device, dtype=torch.float32)
        self.batched_draws += 1
        return self._gumbel_sample(logits, self._rows[:n], self._ones[:n], seed, pos, apply_temperature=False,
                                   use_fp64=self.use_fp64_gumbel), processed


class LockstepSampler(Sampler):
    """vLLM's sampler (its random draw batched on CUDA: SeededTopKTopP), followed by the lockstep
    logprob of each sampled token (when the logp module is R) written into every column that holds
    the sampled token."""

    def __init__(self, base: Sampler, model, fault: str, positions: Callable[[int], np.ndarray]):
        super().__init__(logprobs_mode=base.logprobs_mode, use_fp64_gumbel=base.use_fp64_gumbel)
        self.lockstep_model, self.fault = model, fault
        self.topk_topp_sampler = SeededTopKTopP(self.topk_topp_sampler, positions)

    def forward(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
        if predict_bonus_token:
            raise RuntimeError("speculative decoding is not covered by lockstep's logprob replacement")
        out = super().forward(logits, sampling_metadata, predict_bonus_token, logprobs_mode_override)
        lt = out.logprobs_tensors
        if lt is None:  # no logprobs requested (vLLM's profiling batch among them)
            return out
        model = self.lockstep_model
        if not model.lockstep_ops.selection.logp and self.fault == "none":
            return out  # P: vLLM's own processed logprob stands
        sampled = out.sampled_token_ids[:, 0].long()
        temperature, support = None, None
        if not sampling_metadata.all_greedy:
            if not sampling_metadata.all_random:
                raise RuntimeError("a batch mixing greedy and sampled requests is not supported by lockstep")
            temperature = sampling_metadata.temperature.float()
            # vLLM leaves top_p / top_k None when no request of the batch restricts its support
            if sampling_metadata.top_p is not None or sampling_metadata.top_k is not None:
                support = support_from_logprobs(lt.logprob_token_ids.long(), lt.logprobs, model.real_vocab_size)
        if self.fault != "none":
            logp = faulty_logp(self.fault, model.lockstep_hidden, model.lockstep_lm_head_weight, sampled,
                               temperature=temperature, real_vocab_size=model.real_vocab_size, support_ids=support)
        else:
            # the targets are vLLM's own sampled ids: no range check, which would stop the host
            # until the device catches up (and with it vLLM's overlap of scheduling and decoding)
            with skipping_value_checks():
                logp = model.token_logp(model.lockstep_hidden, sampled, temperature=temperature,
                                        support_ids=support).logp
        holds = lt.logprob_token_ids.long() == sampled[:, None]
        lt.logprobs.copy_(torch.where(holds, logp[:, None].to(lt.logprobs.dtype), lt.logprobs))  # no host sync
        return out


class LockstepWorkerExtension:
    """Mixed into vLLM's worker class (engine arg `worker_extension_cls`)."""

    def lockstep_install(self, weight_names: list[str]) -> dict:
        """After start-up: the sampler hook, and the weight receiver expecting these HF names."""
        runner = self.model_runner
        fault = (plugin_determinism() or {}).get("inject_fault", "none")
        batch = getattr(runner, "input_batch", None)
        if not hasattr(batch, "num_tokens_no_spec"):
            raise RuntimeError(f"{type(runner).__name__} has no input_batch.num_tokens_no_spec (the V1 runner's "
                               f"token counts, which the seeded sampler keys its draws by): a vLLM outside "
                               f"TESTED_VLLM_VERSIONS, or its V2 runner (the engine sets VLLM_USE_V2_MODEL_RUNNER=0)")
        runner.sampler = LockstepSampler(runner.sampler, runner.get_model(), fault,
                                         positions=lambda n: runner.input_batch.num_tokens_no_spec[:n])
        self._lockstep_receiver = WeightReceiver(weight_names)
        return {"logprobs_mode": runner.sampler.logprobs_mode}

    def lockstep_receive(self, message: dict) -> dict:
        """One bucket of a weight sync (framework/weights/sync.py), loaded in place into vLLM's own
        (fused) parameters: `model.load_weights` where the weights are plain tensors; vLLM's
        `reload_weights` on its CPU build, which repacks the weights it packed into oneDNN handles."""
        runner, model = self.model_runner, self.model_runner.get_model()
        device = next(model.parameters()).device

        def load(named):
            if device.type == "cpu":
                runner.reload_weights(weights_iterator=iter(named))
            else:
                model.load_weights(iter(named))

        def loaded(names):  # None where vLLM's CPU build packed weights away (P modules): not comparable
            now = model.lockstep_hf_state_dict()
            return None if now is None else [(n, now[n]) for n in names]

        try:
            timings = self._lockstep_receiver.receive(Bucket.from_message(message), load, loaded, device=device)
        except WeightSyncError as e:  # a refusal travels back as a value: the engine re-raises it as itself
            return {"refused": type(e).__name__, "message": str(e), "consistent": self._lockstep_receiver.consistent}
        return {**timings, "version": self._lockstep_receiver.version, "consistent": self._lockstep_receiver.consistent}

    def lockstep_readback(self) -> dict:
        ops, rank = process_ops()
        compiled = not self.model_runner.vllm_config.model_config.enforce_eager
        # Inside vLLM's compiled forward (and its CUDA graphs) Python does not run per call: the
        # counts of the decoder's ops are those of the trace and of eager prefills, not per step.
        draws = getattr(self.model_runner.sampler.topk_topp_sampler, "batched_draws", 0)
        return readback(ops, side="rollout", backend="vllm", rank=rank,
                        extra={"compiled_forward": compiled, "batched_seeded_draws": draws})
