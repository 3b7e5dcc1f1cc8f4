"""Build the Qwen3 GPTModel on lockstep's layer spec, load HF weights into it, run it to final
hidden states, and stream its weights back out under HF names."""
from __future__ import annotations

import logging
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer import TransformerConfig

from lockstep.framework.actor.megatron.convert import (Qwen3Layout, global_param_names, globals_to_hf, hf_to_megatron,
                                                       layer_param_names, layer_to_hf)
from lockstep.framework.actor.megatron.layers import lockstep_block_spec, tp_size
from lockstep.framework.models.ops import ModelOps
from lockstep.framework.models.qwen3 import Qwen3Config


# TransformerLayer warns "Unknown MLP type" for any MLP class but its own; ours receives the same
# kwargs through its spec params (layers.py), so the warning carries no information here.
logging.getLogger("megatron.core.transformer.transformer_layer").setLevel(logging.ERROR)


def transformer_config(cfg: Qwen3Config, tp: int, dtype: str, device: str) -> TransformerConfig:
    dt = getattr(torch, dtype)
    return TransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim, ffn_hidden_size=cfg.intermediate_size,
        layernorm_epsilon=cfg.rms_norm_eps, normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
        # megatron's fused kernels would replace lockstep's arithmetic: all off
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=tp, params_dtype=dt, pipeline_dtype=dt, bf16=dt == torch.bfloat16,
        use_cpu_initialization=device == "cpu", perform_initialization=False,  # HF weights are loaded next
        init_method_std=cfg.initializer_range)


def _hidden_passthrough(self, input_, weight=None, runtime_gather_output=None, **_):
    """The output layer's slot returns the final hidden states: logprobs are computed by
    linear_logp on (hidden, LM-head shard), never from full logits. As the column-parallel LM head
    would, it sums the hidden states' gradients over TP (each rank's vocab shard contributes its
    own part)."""
    if tp_size(self.tp_group) > 1:
        input_ = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
    return input_, None


def build_model(cfg: Qwen3Config, ops: ModelOps, tp: int, dtype: str, device: str) -> GPTModel:
    spec = lockstep_block_spec(ops, cfg.num_hidden_layers, cfg.rope_theta)
    model = GPTModel(transformer_config(cfg, tp, dtype, device), spec, vocab_size=cfg.vocab_size,
                     max_sequence_length=cfg.max_position_embeddings, position_embedding_type="none",
                     share_embeddings_and_output_weights=cfg.tie_word_embeddings, parallel_output=True)
    model.output_layer.forward = types.MethodType(_hidden_passthrough, model.output_layer)
    return model.to(torch.device("cuda") if device == "cuda" else torch.device("cpu"))


def load_hf(model: GPTModel, hf: dict[str, torch.Tensor], cfg: Qwen3Config, tp: int, rank: int) -> None:
    weights = hf_to_megatron(hf, Qwen3Layout.from_config(cfg), tp, rank)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"HF -> megatron conversion does not match the model: missing {missing}, unexpected {unexpected}")


def hidden_states(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [b, s] (each row from position 0) -> final hidden states [b, s, h]."""
    return model(input_ids=tokens, position_ids=None, attention_mask=None)


def lm_head_shard(model: GPTModel, tp_rank: int) -> tuple[torch.Tensor, int]:
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights \
        else model.output_layer.weight
    return weight, tp_rank * weight.shape[0]


def _gather(tensors: dict[str, torch.Tensor], group) -> list[dict[str, torch.Tensor]]:
    if group is None:
        return [tensors]
    world = dist.get_world_size(group)
    out = [{} for _ in range(world)]
    for name, t in tensors.items():
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=group)
        for r in range(world):
            out[r][name] = parts[r]
    return out


def iter_hf_weights(model: GPTModel, cfg: Qwen3Config, tp_group, gather_here: bool, emit: bool):
    """Yield (hf_name, tensor) on the emitting rank, one layer's TP shards gathered at a time (the
    buckets a weight sync streams). Ranks with gather_here=False take no part."""
    if not gather_here:
        return
    lay = Qwen3Layout.from_config(cfg)
    params = {n: p.detach() for n, p in model.named_parameters()}
    shards = _gather({n: params[n] for n in global_param_names(lay)}, tp_group)
    if emit:
        yield from globals_to_hf(shards, lay).items()
    for i in range(lay.num_layers):
        shards = _gather({n: params[n] for n in layer_param_names(i)}, tp_group)
        if emit:
            yield from layer_to_hf(shards, i, lay).items()
