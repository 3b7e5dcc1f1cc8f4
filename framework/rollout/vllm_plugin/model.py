"""vLLM's Qwen3 with the modules the rollout side runs as lockstep (R) routed through
`lockstep.kernels`, and the sampled rows' hidden states kept for the logprob replacement.

Parameter names and weight loading stay vLLM's (a subclass of its Qwen3ForCausalLM). For every R
module the fused vLLM weights are split back into the trainer's shapes (q/k/v, gate/up) so that
each GEMM sees exactly the shapes the trainer's GEMMs see. P modules stay vLLM's own CPU/GPU path.
"""
from __future__ import annotations

from functools import partial

import torch
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

import lockstep.kernels as K
from lockstep.framework.consistency.readback import ProcessEvidence
from lockstep.framework.models.ops import AttentionOps, FFNOps
from lockstep.framework.rollout.vllm_plugin import plugin_determinism
from lockstep.framework.rollout.vllm_plugin.evidence import set_evidence


def _keep_weights(module: torch.nn.Module) -> None:
    """vLLM's CPU build packs linear weights into oneDNN handles and empties `weight`; lockstep
    kernels read `weight`, so R modules opt out (the flag vLLM itself uses for MLA's kv_b_proj)."""
    for m in module.modules():
        if isinstance(m, LinearBase):
            m._cpu_skip_gemm_dispatch = True


def _norm_forward(norm, rms_norm, x, residual=None):
    eps = norm.variance_epsilon
    if residual is None:
        return rms_norm(x, norm.weight, eps)
    summed = x + residual
    return rms_norm(summed, norm.weight, eps), summed


def _attention_forward(attn, ops: AttentionOps, theta: float, positions, hidden_states):
    t, d = hidden_states.shape[0], attn.head_dim
    wq, wk, wv = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size], 0)
    q = ops.rms_norm(ops.linear(hidden_states, wq).view(t, -1, d), attn.q_norm.weight, attn.q_norm.variance_epsilon)
    k = ops.rms_norm(ops.linear(hidden_states, wk).view(t, -1, d), attn.k_norm.weight, attn.k_norm.variance_epsilon)
    v = ops.linear(hidden_states, wv)
    cos, sin = K.rope_cos_sin(positions, d, theta)
    q, k = K.apply_rope(q, cos, sin), K.apply_rope(k, cos, sin)
    out = attn.attn(q.reshape(t, -1), k.reshape(t, -1), v)
    return ops.linear(out.reshape(t, -1), attn.o_proj.weight)


def _mlp_forward(mlp, ops: FFNOps, x):
    gate_w, up_w = mlp.gate_up_proj.weight.chunk(2, 0)
    return ops.linear(ops.silu_mul(ops.linear(x, gate_w), ops.linear(x, up_w)), mlp.down_proj.weight)


def rope_theta(config) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    if theta is None:
        raise ValueError("the Qwen3 config has no rope_theta")
    return float(theta)


class LockstepQwen3ForCausalLM(Qwen3ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        det = plugin_determinism()
        if det is None:
            raise RuntimeError("LockstepQwen3ForCausalLM built without the lockstep vLLM engine")
        self.evidence = ProcessEvidence(det, "rollout", "vllm", rank=get_tensor_model_parallel_rank())
        set_evidence(self.evidence)
        ops, sel = self.evidence.ops, self.evidence.selection
        if get_tensor_model_parallel_world_size() > 1 and (sel.attention or sel.ffn or sel.logp):
            raise NotImplementedError("lockstep kernels inside vLLM need tensor_parallel_size=1: a sharded "
                                      "R module needs lockstep's fixed-order TP reduction, not NCCL's")
        self.real_vocab_size = int(getattr(self.config, "lockstep_real_vocab_size", self.config.vocab_size))
        theta = rope_theta(self.config)
        for layer in self.model.layers:
            if sel.attention:
                _keep_weights(layer.self_attn)
                layer.self_attn.forward = partial(_attention_forward, layer.self_attn, ops.attention, theta)
                layer.input_layernorm.forward = partial(_norm_forward, layer.input_layernorm, ops.attention.rms_norm)
            if sel.ffn:
                _keep_weights(layer.mlp)
                layer.mlp.forward = partial(_mlp_forward, layer.mlp, ops.ffn)
                layer.post_attention_layernorm.forward = partial(_norm_forward, layer.post_attention_layernorm,
                                                                 ops.ffn.rms_norm)
        if sel.logp:
            self.model.norm.forward = partial(_norm_forward, self.model.norm, ops.logp.rms_norm)
        self.lockstep_hidden: torch.Tensor | None = None

    @property
    def lockstep_lm_head_weight(self) -> torch.Tensor:
        # vLLM pads the LM head to a multiple of 64 rows; the trainer's head has vocab_size rows.
        return self.lm_head.weight[: self.config.vocab_size]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits for sampling, in plain ops from the current LM-head weight (vLLM's CPU head keeps
        a handle packed at load time that a weight reload does not refresh). The rows are the
        sampled positions: kept for the sampler's logprob replacement."""
        self.lockstep_hidden = hidden_states
        logits = self.evidence.ops.logp.linear(hidden_states, self.lockstep_lm_head_weight).float()
        logits[:, self.real_vocab_size:] = float("-inf")
        return logits

    def token_logp(self, hidden, targets, *, temperature=None, support_ids=None):
        return self.evidence.ops.logp.linear_logp(hidden, self.lockstep_lm_head_weight, targets,
                                                  temperature=temperature, real_vocab_size=self.real_vocab_size,
                                                  support_ids=support_ids)

    def lockstep_hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The weights under HF names and shapes (fused q/k/v and gate/up split, vocab padding
        cut), for the post-load checksum; None where vLLM packed a weight away (P modules on CPU)."""
        out, v = {}, self.config.vocab_size
        out["model.embed_tokens.weight"] = self.model.embed_tokens.weight[:v]
        for i, layer in enumerate(self.model.layers):
            p, a, m = f"model.layers.{i}.", layer.self_attn, layer.mlp
            if a.qkv_proj.weight.numel() == 0 or m.gate_up_proj.weight.numel() == 0:
                return None
            for name, w in zip(("q_proj", "k_proj", "v_proj"), a.qkv_proj.weight.split([a.q_size, a.kv_size, a.kv_size])):
                out[f"{p}self_attn.{name}.weight"] = w
            out[f"{p}self_attn.o_proj.weight"] = a.o_proj.weight
            out[f"{p}self_attn.q_norm.weight"] = a.q_norm.weight
            out[f"{p}self_attn.k_norm.weight"] = a.k_norm.weight
            gate, up = m.gate_up_proj.weight.chunk(2, 0)
            out[f"{p}mlp.gate_proj.weight"], out[f"{p}mlp.up_proj.weight"] = gate, up
            out[f"{p}mlp.down_proj.weight"] = m.down_proj.weight
            out[f"{p}input_layernorm.weight"] = layer.input_layernorm.weight
            out[f"{p}post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
            if out[f"{p}self_attn.o_proj.weight"].numel() == 0 or out[f"{p}mlp.down_proj.weight"].numel() == 0:
                return None
        out["model.norm.weight"] = self.model.norm.weight
        if not self.config.tie_word_embeddings:
            out["lm_head.weight"] = self.lockstep_lm_head_weight
        return out
