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
from lockstep.framework.algo.grpo import GRPOConfig, group_advantages, grpo_loss
from lockstep.framework.consistency.readback import ProcessEvidence
from lockstep.framework.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from lockstep.framework.rollout.base import Rollout
from lockstep.framework.weights.sync import WeightPayload

STATE_FILE = "actor_state.pt"


class NativeActor(Actor):
    def __init__(self, model_config: dict, *, determinism: dict, real_vocab_size: int, optim: dict, algo: dict,
                 seed: int, init_from: str | None = None, num_threads: int = 1, device: str = "cpu",
                 dtype: str = "float32"):
        torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.evidence = ProcessEvidence(determinism, "trainer", "native")
        ops = self.evidence.ops
        if init_from:
            self.model = Qwen3ForCausalLM.from_pretrained(init_from, ops)
        else:
            self.model = Qwen3ForCausalLM(Qwen3Config(**model_config), ops)
            self.model.init_weights(seed)
        self.model.to(self.device, getattr(torch, dtype)).train()
        self.real_vocab_size = real_vocab_size
        self.algo = GRPOConfig(**algo)
        # Frozen copy of the initial policy, only when the KL term is on.
        self.ref = copy.deepcopy(self.model).eval().requires_grad_(False) if self.algo.kl_coef > 0 else None
        self.optim_cfg = dict(optim)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim["lr"], betas=tuple(optim["betas"]),
                                           eps=optim["eps"], weight_decay=optim["weight_decay"])
        warmup = max(1, int(optim.get("warmup_steps", 0)))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))
        self.version = 0

    # ---- logprobs ------------------------------------------------------------------------------
    def _teacher_forced(self, model, rollout: Rollout, rows: torch.Tensor, with_entropy: bool):
        dev = self.device
        tokens, prompt_lens = rollout.tokens[rows].to(dev), rollout.prompt_lens[rows].to(dev)
        b, length = tokens.shape
        hidden = model(tokens, torch.arange(length, device=dev).expand(b, length))
        mask = rollout.response_mask()[rows].to(dev)
        bi, ri = mask.nonzero(as_tuple=True)
        src = prompt_lens[bi] + ri - 1  # the hidden state at src predicts the token at src + 1
        support = rollout.support_ids[rows].to(dev)[bi, ri] if rollout.support_ids is not None else None
        out = model.token_logp(hidden[bi, src], tokens[bi, src + 1],
                               temperature=rollout.sampling.logp_temperature,
                               real_vocab_size=self.real_vocab_size, with_entropy=with_entropy,
                               support_ids=support)
        shape = mask.shape
        logp = torch.zeros(shape, device=dev).index_put((bi, ri), out.logp)
        entropy = torch.zeros(shape, device=dev).index_put((bi, ri), out.entropy.detach()) if with_entropy else None
        return logp, entropy

    def compute_logp(self, rollout: Rollout) -> LogpResult:
        if rollout.weights_version != self.version:
            raise RuntimeError(f"rollout was generated with weights version {rollout.weights_version} "
                               f"but the actor holds version {self.version}")
        with torch.no_grad():
            logp, _ = self._teacher_forced(self.model, rollout, torch.arange(rollout.batch_size), False)
        return LogpResult(logp.cpu(), self.version)

    # ---- training ------------------------------------------------------------------------------
    def train(self, rollout: Rollout, rewards: torch.Tensor, group_ids: torch.Tensor,
              old_logp: torch.Tensor) -> dict:
        adv = group_advantages(rewards, group_ids, self.algo.norm_adv_by_std, self.algo.adv_eps).to(self.device)
        mask, old_logp = rollout.response_mask().to(self.device), old_logp.to(self.device)
        sums: dict[str, float] = {}
        for rows in torch.arange(rollout.batch_size).chunk(self.algo.num_minibatches):
            logp, entropy = self._teacher_forced(self.model, rollout, rows, with_entropy=True)
            ref_logp = None
            if self.ref is not None:
                with torch.no_grad():
                    ref_logp, _ = self._teacher_forced(self.ref, rollout, rows, False)
            loss, stats = grpo_loss(logp, old_logp[rows], adv[rows], mask[rows], self.algo, ref_logp)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg["grad_clip"])
            stats.update(loss=loss.item(), grad_norm=float(grad_norm),
                         entropy=float(entropy[mask[rows]].mean()), lr=self.scheduler.get_last_lr()[0])
            self.optimizer.step()
            self.scheduler.step()
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v / self.algo.num_minibatches
        self.version += 1
        sums["advantage_abs_mean"] = float(adv.abs().mean())
        return sums

    def write_readback(self, run_dir: str) -> str:
        return self.evidence.write(run_dir)

    # ---- weights -------------------------------------------------------------------------------
    def weights_for_sync(self) -> WeightPayload:
        return WeightPayload.pack(self.model.hf_state_dict().items(), self.version)

    def save(self, path: str) -> None:
        self.model.save_pretrained(path)
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "version": self.version}, Path(path) / STATE_FILE)

    def load(self, path: str) -> None:
        loaded = Qwen3ForCausalLM.from_pretrained(path, self.model.ops)
        self.model.load_hf_state_dict(loaded.hf_state_dict())
        state = torch.load(Path(path) / STATE_FILE)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]
