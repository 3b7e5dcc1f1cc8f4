"""Native actor: plain PyTorch training of the shared Qwen3 definition (the embedded default).

Teacher forcing runs the whole prompt + response once and scores every response token with the
model's `token_logp` on the hidden state that predicted it, with the rollout's temperature and
support ids, i.e. exactly the call the rollout engine made, on exactly the same rows.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from lockstep.framework.actor.base import Actor, LogpResult
from lockstep.framework.actor.logp import model_logp, sample_groups, warmup_lr
from lockstep.framework.algo.grpo import LOSS_STATS, GRPOConfig, group_advantages, grpo_loss
from lockstep.framework.consistency.readback import readback, write_readback
from lockstep.framework.models.ops import ops_for_side
from lockstep.framework.models.qwen3 import Qwen3Config, Qwen3ForCausalLM, group_bytes, hf_groups
from lockstep.framework.rollout.base import Rollout
from lockstep.framework.weights.sync import Bucket, WeightSender

STATE_FILE = "actor_state.pt"


class NativeActor(Actor):
    def __init__(self, model_config: dict, *, determinism: dict, real_vocab_size: int, optim: dict, algo: dict,
                 seed: int, weights: dict, init_from: str | None = None, num_threads: int = 1, device: str = "cpu",
                 dtype: str = "float32", max_tokens_per_gpu: int | None = None, pack_sequences: bool = False):
        torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.ops = ops = ops_for_side(determinism, "trainer")
        if init_from:
            self.model = Qwen3ForCausalLM.from_pretrained(init_from, ops)
        else:
            self.model = Qwen3ForCausalLM(Qwen3Config(**model_config), ops)
            self.model.init_weights(seed)
        self.model.to(self.device, getattr(torch, dtype)).train()
        self.real_vocab_size = real_vocab_size
        self.max_tokens = max_tokens_per_gpu  # None: the whole batch in one forward
        self.pack = pack_sequences
        self.algo = GRPOConfig(**algo)
        # Frozen copy of the initial policy, only when the KL term is on.
        self.ref = copy.deepcopy(self.model).eval().requires_grad_(False) if self.algo.kl_coef > 0 else None
        self.optim_cfg = dict(optim)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim["lr"], betas=tuple(optim["betas"]),
                                           eps=optim["eps"], weight_decay=optim["weight_decay"])
        self.optim_steps = 0
        self.version = 0
        cfg = self.model.config
        self.sender = WeightSender(group_bytes(cfg, getattr(torch, dtype)), int(weights["bucket_mb"] * 2**20),
                                   weights["transport"])
        self.hf_groups = [list(g) for g in hf_groups(cfg)]

    # ---- logprobs ------------------------------------------------------------------------------
    def compute_logp(self, rollout: Rollout) -> LogpResult:
        if rollout.weights_version != self.version:
            raise RuntimeError(f"rollout was generated with weights version {rollout.weights_version} "
                               f"but the actor holds version {self.version}")
        with torch.no_grad():
            out = model_logp(self.model, rollout, torch.arange(rollout.batch_size), real_vocab_size=self.real_vocab_size,
                             with_entropy=False, max_tokens=self.max_tokens, pack=self.pack)
        return LogpResult(out.logp.cpu(), self.version)

    # ---- training ------------------------------------------------------------------------------
    def train(self, rollout: Rollout, rewards: torch.Tensor, group_ids: torch.Tensor,
              old_logp: torch.Tensor) -> dict:
        adv = group_advantages(rewards, group_ids, self.algo.norm_adv_by_std, self.algo.adv_eps).to(self.device)
        mask, old_logp = rollout.response_mask().to(self.device), old_logp.to(self.device)
        rollout_logp = rollout.logp.to(self.device)
        sums = dict.fromkeys(LOSS_STATS + ("loss", "grad_norm", "lr"), 0.0)
        n = self.algo.num_minibatches
        for rows in torch.arange(rollout.batch_size).chunk(n):
            self.optimizer.zero_grad(set_to_none=True)
            loss = torch.zeros((), device=self.device)
            stats = dict.fromkeys(LOSS_STATS, 0.0)
            # one backward per micro-batch: its tokens' share of the minibatch loss (weights from the
            # whole minibatch's mask), gradients accumulating, so only one micro-batch's graph is alive
            for idx in sample_groups(rollout, rows, self.max_tokens, self.pack):
                cur = model_logp(self.model, rollout, idx, real_vocab_size=self.real_vocab_size, with_entropy=True,
                                 pack=self.pack)
                ref_logp = None
                if self.ref is not None:
                    with torch.no_grad():
                        ref_logp = model_logp(self.ref, rollout, idx, real_vocab_size=self.real_vocab_size,
                                              with_entropy=False, pack=self.pack).logp
                share, share_stats = grpo_loss(cur.logp, old_logp, adv, mask, self.algo, ref_logp, rows=rows,
                                               owned=cur.owned, entropy=cur.entropy, rollout_logp=rollout_logp)
                share.backward()
                loss = loss + share.detach()
                stats = {k: stats[k] + share_stats[k] for k in LOSS_STATS}
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg["grad_clip"])
            lr = warmup_lr(self.optim_cfg, self.optim_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.optim_steps += 1
            for k, v in {**stats, "loss": loss, "grad_norm": grad_norm, "lr": lr}.items():
                sums[k] += float(v) / n
        self.version += 1
        sums["advantage_abs_mean"] = float(adv.abs().mean())
        return sums

    def offload_tensors(self) -> list[torch.Tensor]:
        from lockstep.framework.actor.offload import device_tensors

        return device_tensors(self.model, self.ref, self.optimizer, device_type=self.device.type)

    def write_readback(self, run_dir: str) -> str:
        return write_readback(run_dir, readback(self.ops, side="trainer", backend="native"))

    # ---- weights -------------------------------------------------------------------------------
    def sync_plan(self) -> int:
        return len(self.sender.plan)

    def sync_bucket(self, phase: str, index: int) -> Bucket:
        params = self.model.hf_state_dict(keep_vars=True)
        return self.sender.bucket(self.version, phase, index,
                                  lambda groups: [(n, params[n].detach()) for g in groups for n in self.hf_groups[g]])

    def sync_done(self) -> None:
        self.sender.release()

    def save_weights(self, path: str) -> None:
        self.model.save_pretrained(path)

    def save(self, path: str) -> None:
        self.save_weights(path)
        torch.save({"optimizer": self.optimizer.state_dict(), "optim_steps": self.optim_steps,
                    "version": self.version}, Path(path) / STATE_FILE)

    def load(self, path: str) -> None:
        loaded = Qwen3ForCausalLM.from_pretrained(path, self.model.ops)
        self.model.load_hf_state_dict(loaded.hf_state_dict())
        state = torch.load(Path(path) / STATE_FILE)
        self.optimizer.load_state_dict(state["optimizer"])
        self.optim_steps = state["optim_steps"]
        self.version = state["version"]
