"""Native rollout engine: batched generation with a KV cache on the shared Qwen3 definition.

Prefill runs every prompt at once (right-padded, positions from 0); decode then advances every
row one token per step. The logprob of each sampled token is computed by the model's
`token_logp` (lockstep.kernels.linear_logp in lockstep modes) on the final hidden state of the
row that produced it, with the same temperature and support the trainer will use.

Tensor parallelism (`rollout.tensor_parallel_size`): an engine is that many ranks (Ray actors
joined by a process group, set up in two phases as the megatron actor's); each holds its heads and
intermediate channels and every rank runs every call: the row-parallel projections meet in
lockstep's canonical reduction, so each rank holds the same hidden states, samples the same tokens
from the same seeds, and rank 0 answers.
"""
from __future__ import annotations

import torch

from lockstep.framework.actor.offload import DeviceOffload, device_tensors
from lockstep.framework.consistency.readback import readback, write_readback
from lockstep.framework.placement import rendezvous_address
from lockstep.framework.models.ops import ops_for_side
from lockstep.framework.models.qwen3 import KVCache, Qwen3Config, Qwen3ForCausalLM, hf_groups, tp_shard
from lockstep.framework.rollout.base import Rollout, RolloutEngine, SamplingParams
from lockstep.framework.rollout.faults import check_fault, faulty_logp
from lockstep.framework.rollout.sampling import pad_supports, sample_row
from lockstep.framework.weights.sync import Bucket, WeightReceiver


class NativeRolloutEngine(RolloutEngine):
    def __init__(self, model_config: dict, *, determinism: dict, real_vocab_size: int, eos_ids: list[int], pad_id: int,
                 num_threads: int = 1, engine_index: int = 0, device: str = "cpu", dtype: str = "float32",
                 tensor_parallel_size: int = 1, rank: int = 0):
        torch.set_num_threads(num_threads)
        self.device, self.dtype = torch.device(device), getattr(torch, dtype)
        self.inject_fault = check_fault(determinism.get("inject_fault", "none"))
        self.ops, self.engine_index = ops_for_side(determinism, "rollout"), engine_index
        self.cfg = Qwen3Config(**model_config)
        self.real_vocab_size, self.pad_id = real_vocab_size, pad_id
        self.eos_ids = torch.tensor(list(eos_ids), device=self.device)
        self.tp, self.rank = tensor_parallel_size, rank
        self._offload: DeviceOffload | None = None
        if self.tp == 1:
            self._build(None)

    # ---- set-up of a tensor-parallel engine (rank 0 names the rendezvous, every rank joins) ------
    def rendezvous(self) -> tuple[str, int]:
        return rendezvous_address()

    def setup(self, address: str, port: int) -> None:
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=self.rank, world_size=self.tp)
        self._build(dist.group.WORLD)

    def _build(self, tp_group) -> None:
        self.model = Qwen3ForCausalLM(self.cfg, self.ops, tp_group).to(self.device, self.dtype).eval().requires_grad_(False)
        self.receiver = WeightReceiver([n for g in hf_groups(self.cfg) for n in g])

    @property
    def version(self) -> int:
        return self.receiver.version

    def sleep(self) -> str:
        if self.device.type != "cuda":
            return super().sleep()
        self._offload = self._offload or DeviceOffload(device_tensors(self.model))
        self._offload.offload(keep=False)  # the next weight sync rewrites every weight
        return f"slept: {self._offload.total_gib:.2f} GiB of weights released (the KV cache lives only in generate)"

    def wake(self, what: str) -> str:
        if self.device.type != "cuda" or what != "weights" or self._offload is None:
            return super().wake(what)
        self._offload.reload(restore=False)
        return "woken: weights re-allocated for the sync"

    def write_readback(self, run_dir: str) -> str:
        return write_readback(run_dir, readback(self.ops, side="rollout", backend="native", rank=self.rank,
                                                instance=self.engine_index))

    # ---- weights -------------------------------------------------------------------------------
    def receive_bucket(self, bucket: Bucket) -> dict:
        """Every rank takes every bucket and keeps its shard of each tensor; a sharded rank's
        parameters are not the bucket's tensors, so only an unsharded engine checksums them after
        loading (reported as load_post_load_checked)."""
        params = self.model.hf_state_dict(keep_vars=True)

        @torch.no_grad()
        def load(named):
            for name, t in named:
                params[name].copy_(tp_shard(name, t, self.model.tp_rank, self.model.tp))

        def loaded(names):
            return [(n, params[n].detach()) for n in names] if self.model.tp == 1 else None

        return self.receiver.receive(bucket, load, loaded, device=self.device)

    # ---- generation ----------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seeds: list[list[int]]) -> Rollout:
        self.receiver.check_ready()
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seed lists")
        dev = self.device
        rows = [p for p, s in zip(prompts, seeds) for _ in s]
        gens = [torch.Generator(device=dev).manual_seed(int(s)) for ss in seeds for s in ss]
        prompt_lens = torch.tensor([len(p) for p in rows])
        tokens = torch.full((len(rows), int(prompt_lens.max()) + sampling.max_new_tokens), self.pad_id, dtype=torch.long)
        for i, p in enumerate(rows):
            tokens[i, : len(p)] = torch.tensor(p)

        def pick(logits, r):
            picked = [sample_row(logits[i], sampling, gens[i]) for i in range(len(rows))]
            nxt = torch.tensor([t for t, _ in picked], device=dev)
            return nxt, pad_supports([s for _, s in picked]).to(dev) if sampling.restricts_support else None

        return self._decode(tokens, prompt_lens, sampling, pick, lambda nxt, r: torch.isin(nxt, self.eos_ids))

    @torch.inference_mode()
    def replay(self, rollout: Rollout) -> torch.Tensor:
        """Teacher-forced generation of a recorded rollout: the batch generate ran, its sampled
        tokens and supports fed back instead of drawn. The logprobs [B, R] this engine reports for
        them (the rollout side of `lockstep bisect`)."""
        ro, dev = rollout, self.device
        b, r_max = ro.logp.shape
        tokens = torch.full((b, int(ro.prompt_lens.max()) + ro.sampling.max_new_tokens), self.pad_id, dtype=torch.long)
        tokens[:, : ro.tokens.shape[1]] = ro.tokens
        response, alive = ro.response_tokens().to(dev), ro.response_mask().to(dev)

        def pick(logits, r):
            if ro.support_ids is None:
                return response[:, r], None
            width = max(1, int((ro.support_ids[:, r] >= 0).sum(1).max()))  # generate padded each step's supports
            return response[:, r], ro.support_ids[:, r, :width].to(dev)

        out = self._decode(tokens, ro.prompt_lens, ro.sampling, pick,
                           lambda nxt, r: ~alive[:, r + 1] if r + 1 < r_max else torch.ones_like(alive[:, 0]))
        return out.logp

    def _decode(self, tokens, prompt_lens, sampling: SamplingParams, pick, ends) -> Rollout:
        """The generation loop. tokens [B, prompt + max_new_tokens]: the prompts, right-padded.
        pick(logits [B, V], r) -> (the ids of response token r [B], their supports [B, k] | None);
        ends(ids, r) -> [B] bool: those ids end their rows."""
        dev = self.device
        b = tokens.shape[0]
        if tokens.shape[1] > self.cfg.max_position_embeddings:
            raise ValueError(f"prompt + max_new_tokens = {tokens.shape[1]} exceeds max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        tokens, prompt_lens = tokens.to(dev), prompt_lens.to(dev)
        cache = KVCache(self.cfg, b, tokens.shape[1], dtype=self.dtype, device=dev, tp=self.model.tp)
        lp = int(prompt_lens.max())
        hidden = self.model(tokens[:, :lp], torch.arange(lp, device=dev).expand(b, lp), cache)
        last = hidden[torch.arange(b, device=dev), prompt_lens - 1]  # [B, H]: the state that predicts token 0
        pos = prompt_lens.clone()  # where each row's next token goes
        alive = torch.ones(b, dtype=torch.bool, device=dev)
        step_logp, step_support, step_alive = [], [], []
        for r in range(sampling.max_new_tokens):
            logits = self.model.logits(last)
            logits[:, self.real_vocab_size:] = float("-inf")  # the logprob masks the same columns itself
            nxt, support = pick(logits, r)
            step_logp.append(self._token_logp(last, nxt, sampling, support, logits))
            step_support.append(support)
            step_alive.append(alive.clone())
            tokens[alive, pos[alive]] = nxt[alive]
            still = alive & ~ends(nxt, r)
            if not still.any():
                break
            # Feed each new token at its own position; finished rows recompute their last slot and
            # their outputs are discarded (they never reach the cache of a live row).
            last = self.model(nxt[:, None], pos[:, None], cache)[:, 0]
            pos = torch.where(still, pos + 1, pos)
            alive = still
        return self._assemble(tokens, prompt_lens, step_logp, step_support, step_alive, sampling)

    def _token_logp(self, hidden, targets, sampling: SamplingParams, support, logits):
        if self.inject_fault != "none":
            return faulty_logp(self.inject_fault, hidden, self.model.lm_head_weight, targets,
                               temperature=sampling.logp_temperature, real_vocab_size=self.real_vocab_size,
                               support_ids=support)
        return self.model.token_logp(hidden, targets, temperature=sampling.logp_temperature,
                                     real_vocab_size=self.real_vocab_size, support_ids=support, logits=logits).logp

    def _assemble(self, tokens, prompt_lens, step_logp, step_support, step_alive, sampling) -> Rollout:
        # Everything leaves the engine on the host (it crosses processes through Ray).
        tokens, prompt_lens = tokens.cpu(), prompt_lens.cpu()
        alive = torch.stack(step_alive, 1).cpu()  # [B, R]: token r was produced by a live row
        response_lens = alive.sum(1)
        logp = torch.where(alive, torch.stack(step_logp, 1).float().cpu(), torch.zeros(()))
        support = None
        if sampling.restricts_support:
            width = max(s.shape[1] for s in step_support)
            support = torch.full((*alive.shape, width), -1, dtype=torch.long)
            for r, s in enumerate(step_support):
                support[:, r, : s.shape[1]] = torch.where(alive[:, r, None], s.cpu(), -1)
        last_tok = tokens.gather(1, (prompt_lens + response_lens - 1)[:, None])[:, 0]
        finished = torch.isin(last_tok, self.eos_ids.cpu())
        total = int((prompt_lens + response_lens).max())
        return Rollout(tokens[:, :total].clone(), prompt_lens, response_lens, logp, support, finished,
                       self.version, sampling)
