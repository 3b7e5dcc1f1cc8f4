"""A megatron-core layer spec whose every op is a lockstep op.

Megatron keeps the model structure (parameters, TP sharding, DDP buckets, the distributed
optimizer, checkpoint layout); each leaf module here only replaces the arithmetic:
- column/row-parallel linears call the module's `linear` (row-parallel partials are summed in a
  fixed rank-ordered tree, lockstep.kernels.collectives, never by NCCL's all-reduce);
- norms call `rms_norm`; the MLP calls `silu_mul` on fc1's [gate | up] halves;
- the core attention applies RoPE itself (the GPTModel is built with position_embedding_type="none")
  and calls `attention`, so the rotation is lockstep's too.
Which function each slot calls comes from the trainer's ModelOps (R = lockstep.kernels, P = stock
torch), bound into small subclasses because Megatron builds modules from classes.
"""
from __future__ import annotations

import math

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

import lockstep.kernels as K
from lockstep.framework.models.ops import ModelOps
from lockstep.kernels.collectives import tree_all_reduce


def _tp_size(group) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group)


class LockstepColumnParallelLinear(ColumnParallelLinear):
    op_linear = None  # bound by lockstep_block_spec

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if self.config.sequence_parallel:
            raise NotImplementedError("lockstep's megatron actor does not run sequence parallelism yet")
        if _tp_size(self.tp_group) > 1:  # identity forward; the backward sums input grads over TP
            input_ = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        out = type(self).op_linear(input_, self.weight if weight is None else weight)
        if self.bias is not None and not self.skip_bias_add:
            out = out + self.bias
        return out, (self.bias if self.skip_bias_add else None)


class LockstepRowParallelLinear(RowParallelLinear):
    op_linear = None

    def forward(self, input_):
        out = tree_all_reduce(type(self).op_linear(input_, self.weight), self.tp_group)
        if self.bias is not None and not self.skip_bias_add:
            out = out + self.bias
        return out, (self.bias if self.skip_bias_add else None)


class LockstepRMSNorm(torch.nn.Module):
    op_rms_norm = None

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x):
        return type(self).op_rms_norm(x, self.weight, self.eps)


class LockstepMLP(MLP):
    op_silu_mul = None

    def __init__(self, config, submodules, tp_group=None, ffn_hidden_size=None, pg_collection=None,
                 is_mtp_layer=False, name=None, **kwargs):
        # megatron-core 0.19 builds any MLP class but its own with pg_collection/is_mtp_layer/name;
        # 0.16 passes only the spec params. Both reach MLP's own constructor here.
        if pg_collection is not None:
            tp_group = pg_collection.tp
        super().__init__(config=config, submodules=submodules, tp_group=tp_group, ffn_hidden_size=ffn_hidden_size,
                         **kwargs)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        fc1, _ = self.linear_fc1(hidden_states)
        gate, up = torch.chunk(fc1, 2, dim=-1)  # per TP rank fc1 holds [gate_r | up_r]
        return self.linear_fc2(type(self).op_silu_mul(gate, up))


class LockstepCoreAttention(MegatronModule):
    """RoPE + causal attention on q [sq, b, np, hn], k/v [sk, b, ng, hn] (q/k already normed)."""
    op_attention = None
    rope_theta = None

    def __init__(self, config, layer_number=None, attn_mask_type=None, attention_type=None, cp_comm_type=None,
                 softmax_scale=None, pg_collection=None, **_):
        super().__init__(config=config)
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("packed sequences / attention bias are not supported by lockstep's core attention")
        sq, b, _, hn = query.shape
        positions = torch.arange(sq, device=query.device).expand(b, sq)
        cos, sin = K.rope_cos_sin(positions, hn, type(self).rope_theta)
        q = K.apply_rope(query.transpose(0, 1), cos, sin)
        k = K.apply_rope(key.transpose(0, 1), cos, sin)
        out = type(self).op_attention(q, k, value.transpose(0, 1), positions, self.scale)
        return out.transpose(0, 1).reshape(sq, b, -1)


def _bound(base: type, tag: str, **ops) -> type:
    """A subclass of `base` whose op slots call the given functions."""
    return type(f"{base.__name__}_{tag}", (base,), {k: staticmethod(v) if callable(v) else v for k, v in ops.items()})


def lockstep_block_spec(ops: ModelOps, num_layers: int, rope_theta: float, ffn_hidden_size: int,
                        tp_group=None) -> TransformerBlockSubmodules:
    a, f = ops.attention, ops.ffn
    attn_norm = _bound(LockstepRMSNorm, "attention", op_rms_norm=a.rms_norm)
    layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=attn_norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=_bound(LockstepColumnParallelLinear, "attention", op_linear=a.linear),
                    core_attention=_bound(LockstepCoreAttention, "attention", op_attention=a.attention,
                                          rope_theta=float(rope_theta)),
                    linear_proj=_bound(LockstepRowParallelLinear, "attention", op_linear=a.linear),
                    q_layernorm=attn_norm,
                    k_layernorm=attn_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=_bound(LockstepRMSNorm, "ffn", op_rms_norm=f.rms_norm),
            mlp=ModuleSpec(
                module=_bound(LockstepMLP, "ffn", op_silu_mul=f.silu_mul),
                # what TransformerLayer passes to megatron's own MLP class (it does not know ours)
                params={"tp_group": tp_group, "ffn_hidden_size": ffn_hidden_size},
                submodules=MLPSubmodules(
                    linear_fc1=_bound(LockstepColumnParallelLinear, "ffn", op_linear=f.linear),
                    linear_fc2=_bound(LockstepRowParallelLinear, "ffn", op_linear=f.linear),
                ),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers,
                                      layer_norm=_bound(LockstepRMSNorm, "logp", op_rms_norm=ops.logp.rms_norm))
