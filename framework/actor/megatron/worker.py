"""Megatron-core actor: one Ray actor per rank (TP x CP x DP; PP=1).

Per rank: a Qwen3 GPTModel built from lockstep's layer spec (every op a lockstep op), megatron's
DistributedDataParallel and distributed optimizer, dynamic micro-batching by max_tokens_per_gpu,
GRPO with an optional frozen reference, and HF-named weights gathered over TP for the engines.

Row ownership: data-parallel ranks own whole samples (strided); context-parallel ranks each run a
load-balanced share of every sequence (zigzag chunks; attention reads every rank's keys in position
order, so a token's bits do not depend on the split) and score the tokens whose predicting hidden
state they hold (CP is never a reduction axis of a logprob); tensor-parallel ranks hold vocab
shards and compute the same logprobs through linear_logp's sharded merge. Each logprob is computed by exactly one rank and
gathered; the loss is each rank's own tokens' share of the batch loss, so gradients reduced over
DP x CP add up to the gradient of the whole batch.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from lockstep.framework.actor.base import Actor, LogpResult
from lockstep.framework.actor.logp import BatchLogp, Packed, sample_groups, score_samples, warmup_lr
from lockstep.framework.algo.grpo import LOSS_STATS, GRPOConfig, group_advantages, grpo_loss
from lockstep.framework.consistency.readback import readback, write_readback
from lockstep.framework.models.ops import ops_for_side
from lockstep.framework.placement import rendezvous_address
from lockstep.framework.models.hf import CheckpointReader
from lockstep.framework.models.qwen3 import Qwen3Config, Qwen3ForCausalLM, group_bytes, write_checkpoint
from lockstep.framework.rollout.base import Rollout
from lockstep.framework.weights.sync import Bucket, WeightSender

OPTIM_DIR = "megatron_optimizer"


class MegatronActor(Actor):
    def __init__(self, model_config: dict, *, determinism: dict, real_vocab_size: int, optim: dict, algo: dict,
                 seed: int, parallel: dict, rank: int, world_size: int, max_tokens_per_gpu: int, weights: dict,
                 init_from: str | None = None, num_threads: int = 1, dtype: str = "float32",
                 pack_sequences: bool = False):
        self.device = parallel["device"]
        if self.device == "cpu":
            from lockstep.framework.actor.megatron import cpu_shims

            cpu_shims.apply()
        torch.set_num_threads(num_threads)
        self.args = dict(model_config=model_config, determinism=determinism, optim=optim, algo=algo, seed=seed,
                         parallel=parallel, init_from=init_from, dtype=dtype, weights=weights)
        self.rank, self.world_size = rank, world_size
        self.real_vocab_size, self.max_tokens = real_vocab_size, max_tokens_per_gpu
        if pack_sequences and parallel["cp"] > 1:
            raise ValueError("actor.pack_sequences=true runs without context parallelism: set parallel.cp=1 "
                             "or actor.pack_sequences=false")
        self.pack = pack_sequences
        self.algo = GRPOConfig(**algo)
        self.version = 0

    # ---- set-up (two phases: rank 0 names the rendezvous, then every rank joins it) -------------
    def rendezvous(self) -> tuple[str, int]:
        return rendezvous_address()

    def setup(self, address: str, port: int) -> None:
        from megatron.core import parallel_state as ps

        a, par = self.args, self.args["parallel"]
        backend = "nccl" if self.device == "cuda" else "gloo"
        if self.device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes this rank's GPU as device 0
            os.environ.setdefault("NCCL_ALGO", "Ring")  # fixed collective algorithm for the gradient reduce
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=self.rank,
                                world_size=self.world_size)
        ps.initialize_model_parallel(tensor_model_parallel_size=par["tp"], pipeline_model_parallel_size=par["pp"],
                                     context_parallel_size=par["cp"])
        self.tp_group, self.tp = ps.get_tensor_model_parallel_group(), par["tp"]
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.cp, self.cp_rank = par["cp"], ps.get_context_parallel_rank()
        self.cp_group = ps.get_context_parallel_group() if self.cp > 1 else None
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        if self.device == "cuda":
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(a["seed"])
        self.ops = ops_for_side(a["determinism"], "trainer")
        self.cfg = Qwen3Config(**a["model_config"])
        from lockstep.framework.actor.megatron.model import build_model, load_hf

        source = self._initial_weights()
        self.model = build_model(self.cfg, self.ops, self.tp, a["dtype"], self.device)
        load_hf(self.model, source, self.cfg, self.tp, self.tp_rank)
        self.ref = None
        if self.algo.kl_coef > 0:
            self.ref = build_model(self.cfg, self.ops, self.tp, a["dtype"], self.device)
            load_hf(self.ref, source, self.cfg, self.tp, self.tp_rank)
            self.ref.eval().requires_grad_(False)
        self._build_optimizer()
        w = a["weights"]
        self.sender = WeightSender(group_bytes(self.cfg, getattr(torch, a["dtype"])), int(w["bucket_mb"] * 2**20),
                                   w["transport"])

    def _initial_weights(self):
        """names -> HF tensors of the initial weights: read from the checkpoint's shards on demand,
        or the native model's seeded init (so native and megatron actors start from the same
        weights for the same seed)."""
        a = self.args
        if a["init_from"]:
            return CheckpointReader(a["init_from"]).tensors
        model = Qwen3ForCausalLM(self.cfg, self.ops)
        model.init_weights(a["seed"])
        hf = model.hf_state_dict()
        return lambda names: {n: hf[n] for n in names}

    def _build_optimizer(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o, bf16 = self.args["optim"], self.args["dtype"] == "bfloat16"
        self.ddp = DistributedDataParallel(self.model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False), module=self.model)
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=o["lr"], weight_decay=o["weight_decay"], adam_beta1=o["betas"][0],
            adam_beta2=o["betas"][1], adam_eps=o["eps"], clip_grad=o["grad_clip"], use_distributed_optimizer=True,
            bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32), [self.ddp])
        self.optim_steps = 0

    # ---- logprobs ------------------------------------------------------------------------------
    def _owned_samples(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[self.dp_rank::self.dp]

    def _score(self, model, rollout: Rollout, idx: torch.Tensor, out: BatchLogp) -> None:
        """One forward of micro-batch `idx` (this rank's share of its positions under CP), its
        tokens' logprobs scored into `out`."""
        from lockstep.framework.actor.megatron.model import hidden_states, lm_head_shard, packed_hidden_states

        dev = out.logp.device
        weight, vocab_start = lm_head_shard(model, self.tp_rank)

        def token_logp(h, targets, **kw):
            return self.ops.logp.linear_logp(h, weight, targets, real_vocab_size=self.real_vocab_size,
                                             with_entropy=out.entropy is not None, vocab_start=vocab_start,
                                             full_vocab_size=self.cfg.vocab_size,
                                             group=self.tp_group if self.tp > 1 else None, **kw)

        if self.pack:
            score_samples(out, packed_hidden_states(model, Packed.of(rollout, idx, dev)), rollout, idx, token_logp)
            return
        width = int(rollout.seq_lens[idx].max())
        hidden, positions = hidden_states(model, rollout.tokens[idx, :width].to(dev), self.cp_group, self.cp,
                                          self.cp_rank)  # [b, s_local, h]
        score_samples(out, hidden, rollout, idx, token_logp, positions if self.cp > 1 else None)

    def _device(self) -> torch.device:
        return torch.device("cuda") if self.device == "cuda" else torch.device("cpu")

    def _logp_of(self, model, rollout: Rollout, samples: torch.Tensor, with_entropy: bool) -> BatchLogp:
        """Logprobs of this rank's tokens of `samples`, over the whole batch ([B, R], `owned`
        marking what this rank computed), micro-batch by micro-batch."""
        out = BatchLogp(rollout, self._device(), with_entropy)
        for idx in sample_groups(rollout, samples, self.max_tokens, self.pack):
            self._score(model, rollout, idx, out)
        return out

    def _gather_owned(self, values: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
        """Assemble [B, R] from every rank's owned entries (each entry has exactly one owner among
        the DP x CP ranks; TP ranks hold identical copies)."""
        parts = [torch.empty_like(values) for _ in range(self.world_size)]
        flags = [torch.empty_like(owned) for _ in range(self.world_size)]
        dist.all_gather(parts, values.contiguous())
        dist.all_gather(flags, owned.contiguous())
        out = torch.zeros_like(values)
        for p, f in zip(parts, flags):
            out = torch.where(f, p, out)
        return out

    def compute_logp(self, rollout: Rollout) -> LogpResult:
        if rollout.weights_version != self.version:
            raise RuntimeError(f"rollout was generated with weights version {rollout.weights_version} "
                               f"but the actor holds version {self.version}")
        self.model.eval()
        with torch.no_grad():
            out = self._logp_of(self.model, rollout, self._owned_samples(torch.arange(rollout.batch_size)), False)
        return LogpResult(self._gather_owned(out.logp, out.owned).float().cpu(), self.version)

    # ---- training ------------------------------------------------------------------------------
    def train(self, rollout: Rollout, rewards: torch.Tensor, group_ids: torch.Tensor,
              old_logp: torch.Tensor) -> dict:
        from megatron.core.distributed import finalize_model_grads

        dev = self._device()
        adv = group_advantages(rewards, group_ids, self.algo.norm_adv_by_std, self.algo.adv_eps).to(dev)
        old_logp, mask, rollout_logp = old_logp.to(dev), rollout.response_mask().to(dev), rollout.logp.to(dev)
        # megatron's DDP averages gradients over DP x CP ranks; each rank's loss is its share of
        # the batch loss, so scale back to a sum.
        scale = self.dp * self.cp
        self.model.train()
        n = self.algo.num_minibatches
        totals = torch.zeros(len(LOSS_STATS) + 2, device=dev, dtype=torch.float64)
        lr = 0.0
        for rows in torch.arange(rollout.batch_size).chunk(n):
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            part = torch.zeros(len(LOSS_STATS) + 1, device=dev, dtype=torch.float64)
            # one backward per micro-batch (its tokens' share of the minibatch loss; gradients
            # accumulate in megatron's grad buffers), so only one micro-batch's graph is alive
            for idx in sample_groups(rollout, self._owned_samples(rows), self.max_tokens, self.pack):
                cur = BatchLogp(rollout, dev, True)
                self._score(self.model, rollout, idx, cur)
                ref_logp = None
                if self.ref is not None:
                    with torch.no_grad():
                        ref_logp = self._logp_of(self.ref, rollout, idx, False).logp
                loss, stats = grpo_loss(cur.logp, old_logp, adv, mask, self.algo, ref_logp, rows=rows,
                                        owned=cur.owned, entropy=cur.entropy, rollout_logp=rollout_logp)
                ((loss + cur.anchor) * scale).backward()
                part += torch.stack([*(stats[k] for k in LOSS_STATS), loss.detach()]).double()
            finalize_model_grads([self.ddp])
            lr = warmup_lr(self.args["optim"], self.optim_steps)
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            _, grad_norm, _ = self.optimizer.step()
            self.optim_steps += 1
            totals += torch.cat([part, torch.tensor([float(grad_norm or 0.0)], device=dev, dtype=torch.float64)]) / n
        # every token has one owner among DP x CP; TP ranks repeat the same numbers; the grad norm
        # is global already
        from megatron.core import parallel_state as ps

        dist.all_reduce(totals[:-1], group=ps.get_data_parallel_group(with_context_parallel=True))
        self.version += 1
        out = dict(zip(LOSS_STATS + ("loss", "grad_norm"), totals.tolist()))
        return {**out, "lr": lr, "advantage_abs_mean": float(adv.abs().mean())}

    # ---- weights -------------------------------------------------------------------------------
    def _hf_groups(self, groups: list[int]) -> list[tuple[str, torch.Tensor]]:
        """The HF tensors of sync groups (0: embeddings and norms, i: layer i - 1), one group's TP
        shards gathered at a time. Every rank takes part; only global rank 0 keeps the result."""
        from lockstep.framework.actor.megatron.model import hf_group

        gather_here = self.dp_rank == 0 and self.cp_rank == 0
        out = []
        for g in groups:
            named = hf_group(self.model, self.cfg, g, self.tp_group if self.tp > 1 else None) if gather_here else {}
            out.extend(named.items() if self.rank == 0 else [])
        return out

    def sync_plan(self) -> int:
        return len(self.sender.plan)

    def sync_bucket(self, phase: str, index: int) -> Bucket | None:
        return self.sender.bucket(self.version, phase, index, self._hf_groups, emit=self.rank == 0)

    def sync_done(self) -> None:
        self.sender.release()

    def offload_tensors(self) -> list[torch.Tensor]:
        """The model's (and reference's) parameters, megatron's contiguous param/grad buffers and
        the distributed optimizer's state and fp32 main-parameter shards."""
        from lockstep.framework.actor.offload import device_tensors

        buffers = [[b.param_data, b.grad_data] for b in getattr(self.ddp, "buffers", [])]
        optimizers = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return device_tensors(self.model, self.ref, buffers, [o.optimizer for o in optimizers], [vars(o) for o in optimizers],
                              device_type=self.device)

    def write_readback(self, run_dir: str) -> str:
        return write_readback(run_dir, readback(self.ops, side="trainer", backend="megatron", rank=self.rank))

    def save(self, path: str) -> None:
        """HF weights (rank 0) and, per rank, its shard of the optimizer under
        PATH/megatron_optimizer/rank{r}.pt (every rank writes: one shared file system)."""
        self.save_weights(path)
        d = Path(path) / OPTIM_DIR
        d.mkdir(exist_ok=True)
        torch.save({"shards": [{"state": inner.state_dict(), "main": [p.detach().cpu() for p in _main_params(inner)]}
                               for inner in self._inner_optimizers()],
                    "optim_steps": self.optim_steps, "version": self.version, "layout": self._layout()},
                   d / f"rank{self.rank}.pt")
        dist.barrier()

    def _inner_optimizers(self) -> list:
        """The torch optimizers over this rank's fp32 main-parameter shards. (Megatron's own
        save/load_parameter_state is not used: with torch's Adam, megatron-core 0.16's loader expects
        every state key, `step` included, in the saved tensors, and fails.)"""
        return [o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]

    def _layout(self) -> dict:
        return {"world": dist.get_world_size(), "tp": self.tp, "cp": self.cp, "dp": self.dp}

    def save_weights(self, path: str) -> None:
        """An HF directory written by rank 0 as the layers are gathered (never the whole model at once)."""
        groups = (self._hf_groups([g]) for g in range(self.cfg.num_hidden_layers + 1))
        named = (t for group in groups for t in group)
        if self.rank == 0:
            write_checkpoint(path, self.cfg, named)
        else:
            for _ in named:  # take part in every gather
                pass
        dist.barrier()

    @torch.no_grad()  # fp32 main parameters are views of the (leaf) model parameters
    def load(self, path: str) -> None:
        """What save wrote, into this actor's shards: resume needs the same parallel layout."""
        from lockstep.framework.actor.megatron.model import load_hf

        d = Path(path) / OPTIM_DIR
        file = d / f"rank{self.rank}.pt"
        if not file.exists():
            raise FileNotFoundError(f"{file}: no megatron optimizer state for rank {self.rank} in {path} "
                                    "(a checkpoint of another actor, or of fewer ranks)")
        state = torch.load(file, weights_only=False)
        if state["layout"] != self._layout():
            raise ValueError(f"{path}: written by a megatron actor with layout {state['layout']}, this run has "
                             f"{self._layout()}: resume with the checkpoint's parallel.tp / parallel.cp / GPUs")
        load_hf(self.model, CheckpointReader(path).tensors, self.cfg, self.tp, self.tp_rank)
        for inner, shard in zip(self._inner_optimizers(), state["shards"], strict=True):
            for p, saved in zip(_main_params(inner), shard["main"], strict=True):
                p.copy_(saved)  # fp32 main parameters (views of the model's own in fp32 runs)
            inner.load_state_dict(shard["state"])
        self.optim_steps, self.version = state["optim_steps"], state["version"]
        dist.barrier()


def _main_params(inner) -> list[torch.Tensor]:
    return [p for g in inner.param_groups for p in g["params"]]


__all__ = ["MegatronActor"]
