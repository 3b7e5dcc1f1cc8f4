"""Build the Qwen3 GPTModel on lockstep's layer spec, load HF weights into it, run it to final
hidden states, and stream its weights back out under HF names."""
from __future__ import annotations

import logging
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from lockstep.framework.actor.megatron.convert import (Qwen3Layout, global_param_names, globals_to_hf,
                                                       globals_to_megatron, layer_param_names, layer_to_hf,
                                                       layer_to_megatron)
from lockstep.framework.actor.megatron.layers import SequenceShard, lockstep_block_spec, sum_grad_over_tp, zigzag_positions
from lockstep.framework.models.ops import ModelOps
from lockstep.framework.models.qwen3 import Qwen3Config, hf_groups


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
    return sum_grad_over_tp(input_, self.tp_group), None


def build_model(cfg: Qwen3Config, ops: ModelOps, tp: int, dtype: str, device: str) -> GPTModel:
    """The GPTModel; its `lockstep_shard` (a SequenceShard) says which positions a forward's tokens are."""
    shard = SequenceShard()
    spec = lockstep_block_spec(ops, cfg.num_hidden_layers, cfg.rope_theta, shard)
    model = GPTModel(transformer_config(cfg, tp, dtype, device), spec, vocab_size=cfg.vocab_size,
                     max_sequence_length=cfg.max_position_embeddings, position_embedding_type="none",
                     share_embeddings_and_output_weights=cfg.tie_word_embeddings, parallel_output=True)
    model.output_layer.forward = types.MethodType(_hidden_passthrough, model.output_layer)
    model.lockstep_shard = shard
    return model.to(torch.device("cuda") if device == "cuda" else torch.device("cpu"))


@torch.no_grad()
def load_hf(model: GPTModel, source, cfg: Qwen3Config, tp: int, rank: int) -> None:
    """Load HF weights group by group (the embeddings and norms, then one layer at a time), this
    rank's TP shard of each: source(names) -> {name: tensor} (a checkpoint reader opening only the
    shards that hold them), so the whole model is never in this process's memory at once."""
    lay = Qwen3Layout.from_config(cfg)
    lay.check_tp(tp)
    params = dict(model.named_parameters())
    loaded = set()
    for g, names in enumerate(hf_groups(cfg)):
        hf = source(list(names))
        part = globals_to_megatron(hf, lay, tp, rank) if g == 0 else layer_to_megatron(hf, g - 1, lay, tp, rank)
        for name, t in part.items():
            if name not in params or params[name].shape != t.shape:
                raise ValueError(f"HF -> megatron conversion does not match the model at {name}: "
                                 f"{tuple(t.shape)} vs {tuple(params[name].shape) if name in params else 'absent'}")
            params[name].copy_(t)
            loaded.add(name)
        del hf, part
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"HF -> megatron conversion left parameters unloaded: {missing[:5]}")


def packed_hidden_states(model: GPTModel, packed) -> torch.Tensor:
    """logp.Packed samples -> their final hidden states [b, width, h], each sample from position 0
    (one forward over the packed row; no context parallelism)."""
    shard = model.lockstep_shard
    shard.cp_group, shard.positions, shard.cu_seqlens = None, packed.positions[0], packed.cu_seqlens
    shard.max_seqlen = packed.width
    try:
        return packed.unpack(model(input_ids=packed.tokens, position_ids=None, attention_mask=None))
    finally:
        shard.positions, shard.cu_seqlens, shard.max_seqlen = None, None, None


def hidden_states(model: GPTModel, tokens: torch.Tensor, cp_group=None, cp: int = 1, cp_rank: int = 0):
    """tokens [b, s] (each row from position 0) -> (final hidden states [b, s_local, h], positions
    [s_local] they are of). With context parallelism (cp > 1) this rank runs only its share of the
    sequence (layers.zigzag_positions; the sequence padded to a multiple of 2 cp), attending over
    every rank's keys."""
    shard = model.lockstep_shard
    shard.cu_seqlens = shard.max_seqlen = None
    if cp == 1:
        shard.cp_group, shard.positions = None, None
        return model(input_ids=tokens, position_ids=None, attention_mask=None), torch.arange(tokens.shape[1])
    length = tokens.shape[1]
    positions = zigzag_positions(length, cp, cp_rank)
    full = 2 * cp * (-(-length // (2 * cp)))
    padded = torch.nn.functional.pad(tokens, (0, full - length))  # pad keys sit after every real query
    shard.cp_group, shard.positions = cp_group, positions
    shard.order = torch.cat([zigzag_positions(length, cp, r) for r in range(cp)]).argsort()
    return model(input_ids=padded[:, positions.to(tokens.device)], position_ids=None, attention_mask=None), positions


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


def hf_group(model: GPTModel, cfg: Qwen3Config, group: int, tp_group) -> dict[str, torch.Tensor]:
    """Sync group `group` (0: the embeddings and norms; i: layer i - 1) as full HF tensors: its TP
    shards gathered over tp_group (None: unsharded). Every rank of the TP group must call it."""
    lay = Qwen3Layout.from_config(cfg)
    params = {n: p.detach() for n, p in model.named_parameters()}
    if group == 0:
        return globals_to_hf(_gather({n: params[n] for n in global_param_names(lay)}, tp_group), lay)
    return layer_to_hf(_gather({n: params[n] for n in layer_param_names(group - 1)}, tp_group), group - 1, lay)
