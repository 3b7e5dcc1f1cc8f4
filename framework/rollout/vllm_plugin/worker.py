"""Worker-side hooks, reached by the engine through `collective_rpc` on vLLM's
`worker_extension_cls`: the sampler replacement, weight loading with a post-load checksum, and
the readback of this worker process."""
from __future__ import annotations

import torch
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


def replace_sampled_logprob(model, fault: str, lt, sampled: torch.Tensor, temperature: torch.Tensor | None,
                            restricted: bool) -> None:
    """Write the lockstep logprob of each row's sampled token into every column of vLLM's logprob
    tensors that holds that token (in place). temperature: None for a greedy batch, else [rows]
    float32; restricted: a request of the batch has a top-p/top-k support, read from the finite
    entries of vLLM's processed logprob window and replayed exactly (the window-overflow check then
    reads one flag on the host; an unrestricted batch never waits for the device)."""
    support = support_from_logprobs(lt.logprob_token_ids.long(), lt.logprobs, model.real_vocab_size) if restricted else None
    if fault != "none":
        logp = faulty_logp(fault, model.lockstep_hidden, model.lockstep_lm_head_weight, sampled,
                           temperature=temperature, real_vocab_size=model.real_vocab_size, support_ids=support)
    else:
        # the targets are vLLM's own sampled ids: no range check, which would stop the host
        # until the device catches up (and with it vLLM's overlap of scheduling and decoding)
        with skipping_value_checks():
            logp = model.token_logp(model.lockstep_hidden, sampled, temperature=temperature, support_ids=support).logp
    holds = lt.logprob_token_ids.long() == sampled[:, None]
    lt.logprobs.copy_(torch.where(holds, logp[:, None].to(lt.logprobs.dtype), lt.logprobs))


def _replaces(model, fault: str) -> bool:
    return bool(model.lockstep_ops.selection.logp) or fault != "none"  # P and no fault: vLLM's own logprob stands


def _all_greedy(all_greedy: bool, any_greedy: bool) -> bool:
    """Whether the batch is greedy (no temperature to replay); a batch of both kinds is refused."""
    if any_greedy and not all_greedy:
        raise RuntimeError("a batch mixing greedy and sampled requests is not supported by lockstep")
    return all_greedy


class LockstepSampler(Sampler):
    """The V1 model runner's sampler (vLLM's CPU build), followed by the lockstep logprob of each
    sampled token (when the logp module is R)."""

    def __init__(self, base: Sampler, model, fault: str):
        super().__init__(logprobs_mode=base.logprobs_mode, use_fp64_gumbel=base.use_fp64_gumbel)
        self.lockstep_model, self.fault = model, fault

    def forward(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
        out = super().forward(logits, sampling_metadata, predict_bonus_token, logprobs_mode_override)
        lt = out.logprobs_tensors
        if lt is None or not _replaces(self.lockstep_model, self.fault):  # no logprobs requested (vLLM's profiling batch among them)
            return out
        temperature, restricted = None, False
        md = sampling_metadata
        if not _all_greedy(md.all_greedy, not md.all_random):
            temperature = md.temperature.float()
            # vLLM leaves top_p / top_k None when no request of the batch restricts its support
            restricted = md.top_p is not None or md.top_k is not None
        replace_sampled_logprob(self.lockstep_model, self.fault, lt, out.sampled_token_ids[:, 0].long(), temperature,
                                restricted)
        return out


def sampler_v2(base, model, fault: str):
    """The V2 model runner's sampler (what vLLM 0.26 runs dense models with on CUDA: input
    preparation on the GPU, every request of a step drawn in one Gumbel-max launch keyed by its seed
    and position), followed by the lockstep logprob of each sampled token. A subclass built around
    the runner's own sampler object: its per-request states are shared, not copied."""
    from vllm.v1.worker.gpu.sample.sampler import Sampler as V2Sampler

    class LockstepSamplerV2(V2Sampler):
        def __init__(self):  # adopts base's states (requests already added stay added)
            self.__dict__.update(base.__dict__)
            self.lockstep_model, self.fault = model, fault

        def __call__(self, logits, input_batch):
            out = super().__call__(logits, input_batch)
            lt = out.logprobs_tensors
            if lt is None or not _replaces(model, fault):
                return out
            states, rows = self.sampling_states, input_batch.idx_mapping_np
            greedy = states.temperature.np[rows] == 0.0
            temperature, restricted = None, False
            if not _all_greedy(bool(greedy.all()), bool(greedy.any())):
                temperature = states.temperature.gpu[input_batch.expanded_idx_mapping]
                restricted = bool((states.top_k.np[rows] != states.vocab_size).any() or (states.top_p.np[rows] != 1.0).any())
            replace_sampled_logprob(model, fault, lt, out.sampled_token_ids[:, 0].long(), temperature, restricted)
            return out

    return LockstepSamplerV2()


class LockstepWorkerExtension:
    """Mixed into vLLM's worker class (engine arg `worker_extension_cls`)."""

    def lockstep_install(self, weight_names: list[str]) -> dict:
        """After start-up: the sampler hook, and the weight receiver expecting these HF names."""
        runner = self.model_runner
        fault = (plugin_determinism() or {}).get("inject_fault", "none")
        if runner.vllm_config.speculative_config is not None:  # checked once here, not per sampled batch
            raise RuntimeError("speculative decoding is not covered by lockstep's logprob replacement")
        if isinstance(runner.sampler, Sampler):  # the V1 runner's (an nn.Module)
            runner.sampler = LockstepSampler(runner.sampler, runner.get_model(), fault)
        elif hasattr(runner.sampler, "sampling_states"):  # the V2 runner's
            runner.sampler = sampler_v2(runner.sampler, runner.get_model(), fault)
        else:
            raise RuntimeError(f"{type(runner).__name__}.sampler is a {type(runner.sampler).__name__}, neither the V1 "
                               f"nor the V2 runner's sampler this plugin hooks: a vLLM outside TESTED_VLLM_VERSIONS")
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
        return readback(ops, side="rollout", backend="vllm", rank=rank,
                        extra={"compiled_forward": compiled, "sampler": type(self.model_runner.sampler).__name__})
