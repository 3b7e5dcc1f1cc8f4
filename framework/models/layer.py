"""A Qwen3 decoder layer's math, written once for every backend.

The native model (models/qwen3.py), the megatron-core layer (actor/megatron/layers.py) and the
vLLM model class (rollout/vllm_plugin/model.py) are adapters over these functions: each supplies
the layer's weight tensors (views of its own parameters, in the shapes below), the ops its side
selected (models/ops.py) and its attention core (a contiguous KV cache, megatron's [s, b] layout,
vLLM's paged cache). The wiring that decides bits lives here only: which norm sees which tensor,
the q/k/v split, the per-head q/k norms, RoPE, SwiGLU, the order of the residual adds and the
tensor-parallel reduction of the row-parallel projections.

Shapes: x is [..., T, hidden] (any leading dims; the ops are row-wise, so the layout does not
change a token's bits). Per tensor-parallel rank, q/k/v/gate/up hold that rank's output rows and
o/down that rank's input columns; `tp_group` is None when unsharded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from lockstep.framework.models.ops import AttentionOps, FFNOps, ModelOps

# (q [..., T, H, D], k [..., T, Hkv, D], v [..., T, Hkv, D]) -> [..., T, H, D], RoPE already applied
AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class AttentionWeights(NamedTuple):
    input_norm: torch.Tensor  # [hidden]
    q: torch.Tensor  # [H * D, hidden]
    k: torch.Tensor  # [Hkv * D, hidden]
    v: torch.Tensor  # [Hkv * D, hidden]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    o: torch.Tensor  # [hidden, H * D]
    qkv: torch.Tensor | None = None  # q, k, v stacked, where the adapter holds them as one tensor


class MLPWeights(NamedTuple):
    post_norm: torch.Tensor  # [hidden]
    gate: torch.Tensor  # [intermediate, hidden]
    up: torch.Tensor  # [intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    gate_up: torch.Tensor | None = None  # gate and up stacked, where the adapter holds them as one tensor


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class LayerGeometry:
    head_dim: int
    eps: float  # rms_norm_eps: the layer norms and the per-head q/k norms alike
    tp_group: object = None  # row-parallel outputs are reduced over it
    # column-parallel inputs pass through this (megatron's copy-to-tensor-parallel-region: identity
    # forward, gradients summed over the TP ranks backward)
    enter: Callable[[torch.Tensor], torch.Tensor] = _identity


def attention_block(x: torch.Tensor, w: AttentionWeights, ops: AttentionOps, cos: torch.Tensor, sin: torch.Tensor,
                    core: AttentionCore, g: LayerGeometry) -> torch.Tensor:
    """Input norm, q/k/v, per-head q/k norms, RoPE, the attention core, o projection (reduced over
    TP): the attention branch's output, before the residual add."""
    h = g.enter(ops.rms_norm(x, w.input_norm, g.eps))
    d = g.head_dim
    if w.qkv is not None:  # one launch; the same bits as three (kernels.linear_rows)
        q, k, v = ops.linear_rows(h, w.qkv, (w.q.shape[0], w.k.shape[0], w.v.shape[0]))
    else:
        q, k, v = ops.linear(h, w.q), ops.linear(h, w.k), ops.linear(h, w.v)
    q = ops.rms_norm(q.unflatten(-1, (-1, d)), w.q_norm, g.eps)
    k = ops.rms_norm(k.unflatten(-1, (-1, d)), w.k_norm, g.eps)
    v = v.unflatten(-1, (-1, d))
    q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
    return ops.row_linear(core(q, k, v).flatten(-2), w.o, g.tp_group)


def mlp_block(x: torch.Tensor, w: MLPWeights, ops: FFNOps, g: LayerGeometry) -> torch.Tensor:
    """Post-attention norm, gate/up, SwiGLU, down projection (reduced over TP)."""
    h = g.enter(ops.rms_norm(x, w.post_norm, g.eps))
    if w.gate_up is not None:
        gate, up = ops.linear_rows(h, w.gate_up, (w.gate.shape[0], w.up.shape[0]))
    else:
        gate, up = ops.linear(h, w.gate), ops.linear(h, w.up)
    return ops.row_linear(ops.silu_mul(gate, up), w.down, g.tp_group)


def decoder_layer(x: torch.Tensor, attn: AttentionWeights, mlp: MLPWeights, ops: ModelOps, cos: torch.Tensor,
                  sin: torch.Tensor, core: AttentionCore, g: LayerGeometry) -> torch.Tensor:
    """One Qwen3 decoder layer: x + attention(x), then + mlp(.)."""
    x = x + attention_block(x, attn, ops.attention, cos, sin, core, g)
    return x + mlp_block(x, mlp, ops.ffn, g)
