"""Qwen3 weights between Hugging Face names and megatron-core's GPTModel, per tensor-parallel rank.

Layouts (lockstep's megatron layer, framework/actor/megatron/layers.py):
- linear_qkv: rank r holds KV groups [r * G/tp, (r + 1) * G/tp) (so tp must divide the number of KV
  heads) as [q_r; k_r; v_r]: the query heads of its groups, then their keys, then their values
  (contiguous row blocks, so the layer takes q/k/v as views; megatron's own SelfAttention would
  interleave them per group, but its forward never runs here);
- linear_fc1: per rank [gate_r; up_r], not a slice of the fused tensor;
- linear_proj / linear_fc2: split along the input dimension; word embeddings and an untied output
  layer: split along the vocab; norms (including q/k norms) replicated.
Conversion is exact (views, slices and concatenations only), layer by layer so weights can stream.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Qwen3Layout:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, c) -> "Qwen3Layout":
        return cls(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size,
                   c.intermediate_size, c.vocab_size, c.tie_word_embeddings)

    def check_tp(self, tp: int) -> None:
        for what, n in (("KV heads", self.num_kv_heads), ("vocab", self.vocab), ("intermediate size", self.intermediate)):
            if n % tp:
                raise ValueError(f"tensor parallel size {tp} must divide the model's {what} ({n})")


def _rows(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    n = t.shape[0] // tp
    return t[rank * n:(rank + 1) * n]


def _cols(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    n = t.shape[1] // tp
    return t[:, rank * n:(rank + 1) * n]


def layer_to_megatron(hf: dict, i: int, lay: Qwen3Layout, tp: int, rank: int) -> dict[str, torch.Tensor]:
    p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    qkv = torch.cat([_rows(hf[p + f"self_attn.{n}_proj.weight"], tp, rank) for n in "qkv"])
    return {
        m + "input_layernorm.weight": hf[p + "input_layernorm.weight"],
        m + "self_attention.linear_qkv.weight": qkv,
        m + "self_attention.q_layernorm.weight": hf[p + "self_attn.q_norm.weight"],
        m + "self_attention.k_layernorm.weight": hf[p + "self_attn.k_norm.weight"],
        m + "self_attention.linear_proj.weight": _cols(hf[p + "self_attn.o_proj.weight"], tp, rank),
        m + "pre_mlp_layernorm.weight": hf[p + "post_attention_layernorm.weight"],
        m + "mlp.linear_fc1.weight": torch.cat([_rows(hf[p + "mlp.gate_proj.weight"], tp, rank),
                                                _rows(hf[p + "mlp.up_proj.weight"], tp, rank)]),
        m + "mlp.linear_fc2.weight": _cols(hf[p + "mlp.down_proj.weight"], tp, rank),
    }


def layer_to_hf(shards: list[dict], i: int, lay: Qwen3Layout) -> dict[str, torch.Tensor]:
    """shards: rank-ordered local tensors of one layer (megatron names) -> HF tensors."""
    p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    tp = len(shards)
    q_rows, kv_rows = lay.num_heads * lay.head_dim // tp, lay.num_kv_heads * lay.head_dim // tp
    q, k, v = (torch.cat(parts) for parts in zip(*(s[m + "self_attention.linear_qkv.weight"].split(
        [q_rows, kv_rows, kv_rows]) for s in shards)))
    fc1 = [s[m + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
    first = shards[0]
    return {
        p + "input_layernorm.weight": first[m + "input_layernorm.weight"],
        p + "self_attn.q_proj.weight": q,
        p + "self_attn.k_proj.weight": k,
        p + "self_attn.v_proj.weight": v,
        p + "self_attn.q_norm.weight": first[m + "self_attention.q_layernorm.weight"],
        p + "self_attn.k_norm.weight": first[m + "self_attention.k_layernorm.weight"],
        p + "self_attn.o_proj.weight": torch.cat([s[m + "self_attention.linear_proj.weight"] for s in shards], 1),
        p + "post_attention_layernorm.weight": first[m + "pre_mlp_layernorm.weight"],
        p + "mlp.gate_proj.weight": torch.cat([gate for gate, _ in fc1]),
        p + "mlp.up_proj.weight": torch.cat([up for _, up in fc1]),
        p + "mlp.down_proj.weight": torch.cat([s[m + "mlp.linear_fc2.weight"] for s in shards], 1),
    }


def globals_to_megatron(hf: dict, lay: Qwen3Layout, tp: int, rank: int) -> dict[str, torch.Tensor]:
    out = {"embedding.word_embeddings.weight": _rows(hf["model.embed_tokens.weight"], tp, rank),
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not lay.tied:
        out["output_layer.weight"] = _rows(hf["lm_head.weight"], tp, rank)
    return out


def globals_to_hf(shards: list[dict], lay: Qwen3Layout) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": torch.cat([s["embedding.word_embeddings.weight"] for s in shards]),
           "model.norm.weight": shards[0]["decoder.final_layernorm.weight"]}
    if not lay.tied:
        out["lm_head.weight"] = torch.cat([s["output_layer.weight"] for s in shards])
    return out


def hf_to_megatron(hf: dict, lay: Qwen3Layout, tp: int = 1, rank: int = 0) -> dict[str, torch.Tensor]:
    lay.check_tp(tp)
    out = globals_to_megatron(hf, lay, tp, rank)
    for i in range(lay.num_layers):
        out.update(layer_to_megatron(hf, i, lay, tp, rank))
    return {k: v.contiguous() for k, v in out.items()}


def megatron_to_hf(shards: list[dict], lay: Qwen3Layout) -> dict[str, torch.Tensor]:
    out = globals_to_hf(shards, lay)
    for i in range(lay.num_layers):
        out.update(layer_to_hf(shards, i, lay))
    return {k: v.contiguous() for k, v in out.items()}


def layer_param_names(i: int) -> list[str]:
    m = f"decoder.layers.{i}."
    return [m + n for n in ("input_layernorm.weight", "self_attention.linear_qkv.weight",
                            "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
                            "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight",
                            "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")]


def global_param_names(lay: Qwen3Layout) -> list[str]:
    return ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"] + \
           ([] if lay.tied else ["output_layer.weight"])
