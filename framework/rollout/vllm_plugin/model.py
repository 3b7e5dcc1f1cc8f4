"""The vLLM adapter of the Qwen3 layer: vLLM's parameters and weight loading, lockstep's math.

`LockstepQwen3ForCausalLM` subclasses vLLM's Qwen3ForCausalLM, so parameter names, the fused
qkv/gate_up weights and `load_weights` stay vLLM's. When the rollout side runs any module as
lockstep (R), every decoder layer is replaced by a `LockstepDecoderLayer` module that keeps vLLM's
submodules (same attribute paths, so the same parameters and the same registered Attention layer)
and computes the layer with the shared definition (framework/models/layer.py): the fused weights
enter as row views (q/k/v, gate/up), so each GEMM sees exactly the trainer's shapes, and vLLM's
Attention layer is the attention core (lockstep's paged backend when attention is R, vLLM's own
backend when it is P). The final norm is a module of the same kind. They are plain modules whose
ops are lockstep custom ops with fake implementations, so vLLM's torch.compile trace and its CUDA
graphs capture them as they are.

With every rollout module P (determinism.mode=off, or a P/x case), vLLM's own model runs unchanged.
"""
from __future__ import annotations

import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from lockstep.framework.models.layer import AttentionWeights, LayerGeometry, MLPWeights, decoder_layer
from lockstep.framework.models.ops import ModelOps, ops_for_side
from lockstep.framework.rollout.vllm_plugin import plugin_determinism
from lockstep.framework.rollout.vllm_plugin.evidence import set_process_ops


def _keep_weights(module: nn.Module) -> None:
    """vLLM's CPU build packs linear weights into oneDNN handles and empties `weight`; lockstep
    kernels read `weight`, so lockstep layers opt out (the flag vLLM itself uses for MLA's kv_b_proj)."""
    for m in module.modules():
        if isinstance(m, LinearBase):
            m._cpu_skip_gemm_dispatch = True


def rope_theta(config) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    if theta is None:
        raise ValueError("the Qwen3 config has no rope_theta")
    return float(theta)


class RopeTable(nn.Module):
    """cos/sin of every position the engine can reach (0 .. max_model_len - 1), computed once at
    build time by the side's rope_cos_sin op; a layer gathers its tokens' rows. The op is elementwise
    in the position, so a row of the table holds the bits the op gives that position alone (what the
    trainer computes per forward; tests/test_kernels_invariance.py): one gather per layer instead of
    the op's chain of elementwise kernels in each of the model's layers. One module, shared by every
    layer; its buffers are not part of the checkpoint."""

    def __init__(self, ops: ModelOps, head_dim: int, theta: float, positions: int):
        super().__init__()
        cos, sin = ops.attention.rope_cos_sin(torch.arange(positions), head_dim, theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


class LockstepDecoderLayer(nn.Module):
    """One vLLM Qwen3 decoder layer's submodules, computed by models/layer.py's decoder_layer."""

    def __init__(self, layer: nn.Module, ops: ModelOps, rope: RopeTable):
        super().__init__()
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.ops, self.rope = ops, rope
        self.geometry = LayerGeometry(layer.self_attn.head_dim, layer.input_layernorm.variance_epsilon)
        _keep_weights(self)

    def weights(self) -> tuple[AttentionWeights, MLPWeights]:
        """Row views of the fused weights (slicing: Dynamo cannot trace the Python-level
        Tensor.split/chunk on vLLM's parameter subclasses), and the fused weights themselves, which
        the layer multiplies in one launch each (the same bits: kernels.linear_rows)."""
        a, m = self.self_attn, self.mlp
        qkv, gate_up = a.qkv_proj.weight, m.gate_up_proj.weight
        q, k, v = qkv[:a.q_size], qkv[a.q_size:a.q_size + a.kv_size], qkv[a.q_size + a.kv_size:]
        half = gate_up.shape[0] // 2
        gate, up = gate_up[:half], gate_up[half:]
        return (AttentionWeights(self.input_layernorm.weight, q, k, v, a.q_norm.weight, a.k_norm.weight,
                                 a.o_proj.weight, qkv),
                MLPWeights(self.post_attention_layernorm.weight, gate, up, m.down_proj.weight, gate_up))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None):
        """vLLM's decoder-layer call: returns (hidden_states, residual) with the residual stream
        already added in (None), which the next layer and the final norm accept."""
        x = hidden_states if residual is None else hidden_states + residual
        d, attn = self.geometry.head_dim, self.self_attn.attn
        cos, sin = self.rope(positions)

        def core(q, k, v):  # vLLM's Attention layer takes and returns [T, heads * d]
            return attn(q.flatten(-2), k.flatten(-2), v.flatten(-2)).unflatten(-1, (-1, d))

        return decoder_layer(x, *self.weights(), self.ops, cos, sin, core, self.geometry), None


class LockstepFinalNorm(nn.Module):
    """vLLM's final RMSNorm weight, normed by the logp module's rms_norm; called as vLLM calls
    its norm: (hidden_states, residual) -> (normed, residual stream)."""

    def __init__(self, norm: nn.Module, ops: ModelOps):
        super().__init__()
        self.weight, self.eps, self.ops = norm.weight, norm.variance_epsilon, ops

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None):
        x = hidden_states if residual is None else hidden_states + residual
        return self.ops.logp.rms_norm(x, self.weight, self.eps), x


class LockstepQwen3ForCausalLM(Qwen3ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        det = plugin_determinism()
        if det is None:
            raise RuntimeError("LockstepQwen3ForCausalLM built without the lockstep vLLM engine")
        self.lockstep_ops = ops = ops_for_side(det, "rollout")
        self.lockstep_rank = get_tensor_model_parallel_rank()
        set_process_ops(ops, self.lockstep_rank)
        if get_tensor_model_parallel_world_size() > 1 and ops.selection.any:
            raise NotImplementedError("lockstep kernels inside vLLM need tensor_parallel_size=1: a sharded "
                                      "R module needs lockstep's fixed-order TP reduction, not NCCL's")
        self.real_vocab_size = int(getattr(self.config, "lockstep_real_vocab_size", self.config.vocab_size))
        if ops.selection.attention or ops.selection.ffn:
            rope = RopeTable(ops, self.model.layers[0].self_attn.head_dim, rope_theta(self.config),
                             vllm_config.model_config.max_model_len)
            for i, layer in enumerate(self.model.layers):
                self.model.layers[i] = LockstepDecoderLayer(layer, ops, rope)
        if ops.selection.any:
            self.model.norm = LockstepFinalNorm(self.model.norm, ops)
        self.lockstep_hidden: torch.Tensor | None = None
        self.lockstep_logits: torch.Tensor | None = None

    @property
    def lockstep_lm_head_weight(self) -> torch.Tensor:
        # vLLM pads the LM head to a multiple of 64 rows; the trainer's head has vocab_size rows.
        return self.lm_head.weight[: self.config.vocab_size]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits for sampling, in the logp module's ops from the current LM-head weight (vLLM's
        CPU head keeps a handle packed at load time that a weight reload does not refresh). The rows
        are the sampled positions: kept for the sampler's logprob replacement."""
        self.lockstep_hidden = hidden_states
        logits = self.lockstep_ops.logp.linear(hidden_states, self.lockstep_lm_head_weight).float()
        # lockstep's logits are kept for the logprob replay, which folds them instead of a second
        # pass over the LM head; vLLM's sampler gets a copy (it divides by the temperature in place)
        self.lockstep_logits = logits if self.lockstep_ops.logp.reuse_logits else None
        if self.lockstep_logits is not None:
            logits = logits.clone()
        logits[:, self.real_vocab_size:] = float("-inf")
        return logits

    def token_logp(self, hidden, targets, *, temperature=None, support_ids=None):
        logits = self.lockstep_logits
        if logits is not None and logits.shape[0] != hidden.shape[0]:
            logits = None  # not the rows being replayed
        return self.lockstep_ops.logp.linear_logp(hidden, self.lockstep_lm_head_weight, targets,
                                                  temperature=temperature, real_vocab_size=self.real_vocab_size,
                                                  support_ids=support_ids, logits=logits)

    def lockstep_hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The weights under HF names and shapes (fused q/k/v and gate/up split, vocab padding
        cut), for the post-load checksum; None where vLLM packed a weight away (P modules on CPU)."""
        out, v = {}, self.config.vocab_size
        out["model.embed_tokens.weight"] = self.model.embed_tokens.weight[:v]
        for i, layer in enumerate(self.model.layers):
            p, a, m = f"model.layers.{i}.", layer.self_attn, layer.mlp
            fused = (a.qkv_proj.weight, a.o_proj.weight, m.gate_up_proj.weight, m.down_proj.weight)
            if any(w.numel() == 0 for w in fused):
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
        out["model.norm.weight"] = self.model.norm.weight
        if not self.config.tie_word_embeddings:
            out["lm_head.weight"] = self.lockstep_lm_head_weight
        return out
