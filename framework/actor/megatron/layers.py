"""The megatron-core adapter of the Qwen3 layer: megatron's structure, lockstep's math.

Megatron keeps the model structure (parameters and their TP sharding, DDP buckets, the distributed
optimizer): the spec builds megatron's own TransformerLayer / SelfAttention / MLP with its own
column- and row-parallel linears. They hold the weights only; the layer's forward is
`LockstepTransformerLayer.forward`, which hands views of those weights to the shared definition
(framework/models/layer.py) with the trainer's ops, megatron's [s, b] layout as the attention core
and the TP plumbing (gradients summed over TP where column-parallel inputs enter; the row-parallel
reduction is the ops' own `row_linear`).

Weight layout per TP rank (framework/actor/megatron/convert.py): linear_qkv holds [q_r; k_r; v_r]
(this rank's query heads, then its KV heads' keys and values), linear_fc1 [gate_r; up_r].
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from lockstep.framework.models.layer import AttentionWeights, LayerGeometry, MLPWeights, decoder_layer
from lockstep.framework.models.ops import ModelOps


def tp_size(group) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group)


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the TP group: where a replicated tensor
    enters TP-sharded computation (column-parallel inputs, the final hidden states before the
    vocab-sharded logprob), each rank's gradient is only its shard's part. (megatron's
    copy_to_tensor_model_parallel_region does this too, but its all-reduce works on a
    `.contiguous()` copy and returns the unreduced input when the gradient arrives non-contiguous,
    as a transposed one does.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _SumGradOverTP.apply(x, group) if tp_size(group) > 1 else x


class LockstepRMSNorm(torch.nn.Module):
    """A norm's weight, in megatron's norm slots (the math is the layer's)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)


class FinalRMSNorm(LockstepRMSNorm):
    """The decoder's final norm: the logp module's rms_norm (bound by lockstep_block_spec)."""
    op_rms_norm = None

    def forward(self, x):
        return type(self).op_rms_norm(x, self.weight, self.eps)


class NoCoreAttention(MegatronModule):
    """SelfAttention needs a core-attention module; the layer calls its own core instead."""

    def __init__(self, config, **_):
        super().__init__(config=config)

    def forward(self, *args, **kwargs):
        raise RuntimeError("lockstep's megatron layer computes attention in LockstepTransformerLayer.forward")


@dataclass
class SequenceShard:
    """Which positions of the sequence this rank's tokens are (context parallelism), set by the
    actor before each forward. positions [s_local]: the absolute positions of the local tokens, in
    order; cp_group None: the rank holds the whole sequence (positions 0..s-1)."""
    positions: torch.Tensor | None = None
    cp_group: object = None
    order: torch.Tensor | None = None  # sorts every rank's keys, gathered in rank order, into position order
    # packed sequences (one row of tokens, b = 1): sequence r is tokens cu[r]..cu[r+1]-1 and
    # `positions` holds each token's position in its sequence (context parallelism: not with packing)
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None  # their longest (varlen_attention then reads nothing back from the device)


class _GatherSequence(torch.autograd.Function):
    """Every CP rank's K (or V) [s_local, b, h, d] in rank order; the backward sums each rank's
    gradient of the gathered tensor over the CP group and keeps this rank's part."""

    @staticmethod
    def forward(ctx, t, group):
        import torch.distributed as dist

        ctx.group, ctx.rank, ctx.n = group, dist.get_rank(group), t.shape[0]
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


def zigzag_positions(length: int, cp: int, rank: int) -> torch.Tensor:
    """Load-balanced causal split: the sequence (padded to a multiple of 2 cp) in 2 cp chunks; rank r
    holds chunks r and 2 cp - 1 - r, so every rank has as many early (cheap) as late (costly) queries."""
    chunk = -(-length // (2 * cp))
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


class LockstepTransformerLayer(TransformerLayer):
    ops: ModelOps = None  # bound by lockstep_block_spec
    rope_theta: float = None
    shard: SequenceShard = None  # one per model, shared by its layers

    def forward(self, hidden_states, attention_mask=None, context=None, packed_seq_params=None,
                attention_bias=None, inference_context=None, **_):
        if packed_seq_params is not None or attention_bias is not None or inference_context is not None:
            raise NotImplementedError("lockstep's megatron layer runs unpacked training forwards only "
                                      "(no packed sequences, attention bias or inference context)")
        if self.config.sequence_parallel:
            raise NotImplementedError("lockstep's megatron actor does not run sequence parallelism yet")
        ops, cfg, shard = type(self).ops, self.config, type(self).shard
        s, b = hidden_states.shape[:2]
        d = cfg.kv_channels
        dev = hidden_states.device
        cp_group = shard.cp_group if shard is not None else None
        cu = shard.cu_seqlens if shard is not None else None
        if cu is not None and (cp_group is not None or b != 1):
            raise NotImplementedError("packed sequences run as one row (b = 1) without context parallelism")
        positions = shard.positions.to(dev) if cp_group is not None or cu is not None else torch.arange(s, device=dev)
        cos, sin = ops.attention.rope_cos_sin(positions[:, None].expand(s, b), d, type(self).rope_theta)
        scale = 1.0 / math.sqrt(d)
        q_pos = positions.expand(b, s)

        def core(q, k, v):  # [s, b, heads, d] -> megatron's [s, b] layout around the [b, s] op
            if cu is not None:
                return ops.attention.varlen_attention(q[:, 0], k[:, 0], v[:, 0], cu.to(dev), scale,
                                                      shard.max_seqlen)[:, None]
            if cp_group is not None:  # every key in position order: the same fixed KV blocks as CP 1
                order = shard.order.to(dev)
                k, v = (_GatherSequence.apply(t, cp_group)[order] for t in (k, v))
            out = ops.attention.attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), q_pos, scale)
            return out.transpose(0, 1)

        group = self.self_attention.linear_qkv.tp_group
        sharded = tp_size(group) > 1
        geometry = LayerGeometry(d, cfg.layernorm_epsilon, group if sharded else None,
                                 lambda x: sum_grad_over_tp(x, group))
        return decoder_layer(hidden_states, *self.weights(), ops, cos, sin, core, geometry), context

    def weights(self) -> tuple[AttentionWeights, MLPWeights]:
        a, m = self.self_attention, self.mlp
        d = self.config.kv_channels
        q, k, v = a.linear_qkv.weight.split([a.num_attention_heads_per_partition * d,
                                             a.num_query_groups_per_partition * d,
                                             a.num_query_groups_per_partition * d])
        gate, up = m.linear_fc1.weight.chunk(2)
        return (AttentionWeights(self.input_layernorm.weight, q, k, v, a.q_layernorm.weight, a.k_layernorm.weight,
                                 a.linear_proj.weight, a.linear_qkv.weight),
                MLPWeights(self.pre_mlp_layernorm.weight, gate, up, m.linear_fc2.weight, m.linear_fc1.weight))


def lockstep_block_spec(ops: ModelOps, num_layers: int, rope_theta: float, shard: SequenceShard) -> TransformerBlockSubmodules:
    # megatron builds modules from classes: the ops travel as class attributes of subclasses
    final_norm = type("FinalRMSNorm_bound", (FinalRMSNorm,), {"op_rms_norm": staticmethod(ops.logp.rms_norm)})
    layer = ModuleSpec(
        module=type("LockstepTransformerLayer_bound", (LockstepTransformerLayer,),
                    {"ops": ops, "rope_theta": float(rope_theta), "shard": shard}),
        submodules=TransformerLayerSubmodules(
            input_layernorm=LockstepRMSNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=NoCoreAttention,
                                                   linear_proj=RowParallelLinear, q_layernorm=LockstepRMSNorm,
                                                   k_layernorm=LockstepRMSNorm),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=LockstepRMSNorm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=final_norm)
