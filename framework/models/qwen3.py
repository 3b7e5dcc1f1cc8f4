"""Qwen3 (RMSNorm, GQA with q/k norm, RoPE, SwiGLU, optional tied embeddings): the config and the
native backend's model.

The native trainer and the native rollout engine share this module: HF parameter names (so
checkpoints load and save as HF safetensors) over the layer math of models/layer.py, computed
with the `ModelOps` the instance was built with. Keys are addressed by absolute position: a
forward with a KV cache (prefill, decode) and one without (teacher forcing) compute each token
identically.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from lockstep.framework.models.hf import CONFIG_FILE, CheckpointError, CheckpointReader, CheckpointWriter, read_json
from lockstep.framework.models.layer import AttentionWeights, LayerGeometry, MLPWeights, decoder_layer
from lockstep.framework.models.ops import ModelOps

# what lockstep's Qwen3 reads from an HF config.json (and what a model group may set)
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
              "max_position_embeddings")


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 512
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    def to_hf(self, dtype: str = "float32") -> dict:
        """An HF Qwen3 config.json (what transformers' Qwen3Config reads)."""
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
                "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": self.num_hidden_layers, "rope_scaling": None, "use_cache": True,
                "dtype": dtype, "torch_dtype": dtype, **asdict(self)}

    @classmethod
    def from_hf(cls, d: dict, where: str = CONFIG_FILE) -> "Qwen3Config":
        """From an HF config.json; what lockstep's Qwen3 does not implement is an error naming the key."""
        if d.get("model_type", "qwen3") != "qwen3":
            raise CheckpointError(f"{where}: model_type {d['model_type']!r} is not qwen3")
        rope = d.get("rope_parameters") or {}
        unsupported = {"attention_bias": bool(d.get("attention_bias")),
                       "hidden_act": d.get("hidden_act", "silu") != "silu",
                       "use_sliding_window": bool(d.get("use_sliding_window")),
                       "rope_scaling": d.get("rope_scaling") not in (None, {}),
                       "rope_parameters.rope_type": rope.get("rope_type", "default") != "default",
                       "layer_types": any(t != "full_attention" for t in d.get("layer_types") or [])}
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise CheckpointError(f"{where}: lockstep's Qwen3 does not implement {', '.join(bad)} "
                                  f"({', '.join(f'{k}={d.get(k.split(chr(46))[0])!r}' for k in bad)})")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise CheckpointError(f"{where}: missing {missing}")
        theta = d.get("rope_theta", rope.get("rope_theta", cls.rope_theta))
        values = {k: d[k] for k in SHAPE_KEYS if k in d and d[k] is not None}
        values.setdefault("num_key_value_heads", d["num_attention_heads"])
        values.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
        values["rope_theta"] = float(theta)
        if d.get("initializer_range") is not None:
            values["initializer_range"] = d["initializer_range"]
        return cls(**values)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Qwen3Config":
        return cls.from_hf(read_json(Path(path) / CONFIG_FILE), str(Path(path) / CONFIG_FILE))


def hf_groups(cfg: Qwen3Config) -> list[dict[str, tuple[int, ...]]]:
    """The HF tensors of a Qwen3 and their shapes, in sync order: the embeddings, final norm (and an
    untied LM head), then one group per decoder layer."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    first = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        first["lm_head.weight"] = (cfg.vocab_size, h)
    groups = [first]
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        groups.append({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (cfg.num_attention_heads * d, h),
                       p + "self_attn.k_proj.weight": (cfg.num_key_value_heads * d, h),
                       p + "self_attn.v_proj.weight": (cfg.num_key_value_heads * d, h),
                       p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                       p + "self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
                       p + "post_attention_layernorm.weight": (h,), p + "mlp.gate_proj.weight": (i, h),
                       p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i)})
    return groups


def group_bytes(cfg: Qwen3Config, dtype: torch.dtype) -> list[int]:
    return [sum(math.prod(s) for s in g.values()) * dtype.itemsize for g in hf_groups(cfg)]


def write_checkpoint(path: str | Path, cfg: Qwen3Config, named_tensors, max_shard_bytes: int = 5 * 2**30) -> None:
    """config.json (its dtype that of the tensors) and the weights, written as they come."""
    writer, dtype = CheckpointWriter(path, max_shard_bytes), None
    for name, t in named_tensors:
        dtype = dtype or str(t.dtype).removeprefix("torch.")
        writer.add(name, t)
    writer.close()
    (Path(path) / CONFIG_FILE).write_text(json.dumps(cfg.to_hf(dtype or "float32"), indent=2))


class Linear(nn.Module):
    """A weight under HF's name; the layer math (models/layer.py) decides which op multiplies it."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


# Tensor parallelism of the native model (an engine's ranks): which HF weights are sharded how
_ROW_SHARDED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.gate_proj.weight",
                "mlp.up_proj.weight")  # output rows: heads / intermediate channels
_COL_SHARDED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")  # input columns: row-parallel


def tp_shard(name: str, t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s part of the HF tensor `name` in a TP-`tp` native model (embeddings, norms and
    the LM head are replicated)."""
    if tp == 1:
        return t
    if name.endswith(_ROW_SHARDED):
        n = t.shape[0] // tp
        return t[rank * n:(rank + 1) * n]
    if name.endswith(_COL_SHARDED):
        n = t.shape[1] // tp
        return t[:, rank * n:(rank + 1) * n]
    return t


def check_tp(cfg: Qwen3Config, tp: int) -> None:
    for what, n in (("attention heads", cfg.num_attention_heads), ("KV heads", cfg.num_key_value_heads),
                    ("intermediate size", cfg.intermediate_size)):
        if n % tp:
            raise ValueError(f"tensor parallel size {tp} must divide the model's {what} ({n})")


class KVCache:
    """Contiguous per-layer cache [B, max_len, Hkv, D]; token t of row b lives at [b, pos]."""

    def __init__(self, cfg: Qwen3Config, batch: int, max_len: int, dtype=torch.float32, device=None, tp: int = 1):
        shape = (batch, max_len, cfg.num_key_value_heads // tp, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(positions)
        self.k[layer][rows, positions] = k
        self.v[layer][rows, positions] = v
        return self.k[layer], self.v[layer]


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, tp: int = 1):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, cfg.num_attention_heads // tp * d)
        self.k_proj = Linear(h, cfg.num_key_value_heads // tp * d)
        self.v_proj = Linear(h, cfg.num_key_value_heads // tp * d)
        self.o_proj = Linear(cfg.num_attention_heads // tp * d, h)
        self.q_norm = RMSNorm(d)
        self.k_norm = RMSNorm(d)


class MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config, tp: int = 1):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size // tp)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size // tp)
        self.down_proj = Linear(cfg.intermediate_size // tp, cfg.hidden_size)


class DecoderLayer(nn.Module):
    """HF's parameter layout; the math is models/layer.py's decoder_layer."""

    def __init__(self, cfg: Qwen3Config, tp: int = 1):
        super().__init__()
        self.self_attn = Attention(cfg, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)

    def weights(self) -> tuple[AttentionWeights, MLPWeights]:
        a, m = self.self_attn, self.mlp
        return (AttentionWeights(self.input_layernorm.weight, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight,
                                 a.q_norm.weight, a.k_norm.weight, a.o_proj.weight),
                MLPWeights(self.post_attention_layernorm.weight, m.gate_proj.weight, m.up_proj.weight,
                           m.down_proj.weight))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config, tp: int = 1):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen3Config, ops: ModelOps, tp_group=None):
        """tp_group: the process group of a tensor-parallel engine's ranks (None: unsharded); each
        rank holds its heads and intermediate channels (tp_shard), the row-parallel projections are
        reduced by the ops' row_linear, the embeddings and LM head are replicated."""
        super().__init__()
        import torch.distributed as dist

        self.tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        check_tp(cfg, self.tp)
        self.config, self.ops = cfg, ops
        self.model = Qwen3Model(cfg, self.tp)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.geometry = LayerGeometry(cfg.head_dim, cfg.rms_norm_eps, tp_group if self.tp > 1 else None)

    # ---- weights -------------------------------------------------------------------------------
    def init_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * self.config.initializer_range)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def hf_state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """Parameters under their HF names (a tied LM head is stored once, as HF does)."""
        return dict(self.state_dict(keep_vars=keep_vars))

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        tensors = dict(tensors)
        if self.lm_head is None:
            tensors.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {sorted(missing)}, "
                             f"unexpected {sorted(unexpected)}")

    def save_pretrained(self, path: str | Path, max_shard_bytes: int = 5 * 2**30) -> None:
        """An HF directory: config.json and the weights (sharded, with an index, past max_shard_bytes)."""
        write_checkpoint(path, self.config, self.hf_state_dict().items(), max_shard_bytes)

    @classmethod
    def from_pretrained(cls, path: str | Path, ops: ModelOps) -> "Qwen3ForCausalLM":
        model = cls(Qwen3Config.from_dir(path), ops)
        reader = CheckpointReader(path)
        expected = set(model.hf_state_dict())
        extra = sorted(reader.names - expected - {"lm_head.weight"})
        if extra:
            raise CheckpointError(f"{path}: tensors this Qwen3 does not have: {extra[:5]}")
        model.load_hf_state_dict(reader.tensors(sorted(expected)))
        return model

    # ---- compute -------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None) -> torch.Tensor:
        """input_ids, positions [B, T] -> final hidden states [B, T, H] (after the last norm).

        Without a cache, row b must hold its sequence from position 0 (teacher forcing). cu_seqlens
        [S+1] int32: packed sequences instead, input_ids and positions [1, N] holding sequence r's
        tokens at cu[r]..cu[r+1]-1 with positions from 0 (the same bits as each sequence on a row);
        max_seqlen: their longest, when the caller knows it (varlen_attention then reads nothing back
        from the device)."""
        ops, cfg = self.ops, self.config
        if cu_seqlens is not None and (cache is not None or input_ids.shape[0] != 1):
            raise ValueError("packed sequences (cu_seqlens) are one row of tokens, without a KV cache")
        cos, sin = ops.attention.rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        scale = 1.0 / math.sqrt(cfg.head_dim)
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            def core(q, k, v, i=i):
                if cu_seqlens is not None:
                    return ops.attention.varlen_attention(q[0], k[0], v[0], cu_seqlens, scale, max_seqlen)[None]
                if cache is not None:
                    k, v = cache.write(i, positions, k, v)
                return ops.attention.attention(q, k, v, positions, scale)

            x = decoder_layer(x, *layer.weights(), ops, cos, sin, core, self.geometry)
        return ops.logp.rms_norm(x, self.model.norm.weight, cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.logp.linear(hidden, self.lm_head_weight).float()

    def token_logp(self, hidden: torch.Tensor, targets: torch.Tensor, *, temperature=None,
                   real_vocab_size=None, with_entropy=False, support_ids=None, logits=None):
        """Log-probability of `targets` given final hidden states [T, H] (the bitwise boundary).
        Returns an object with .logp [T] and .entropy [T] | None. `logits`: what `logits(hidden)`
        gave, passed back where the ops allow it (the same bits, one LM-head pass fewer)."""
        return self.ops.logp.linear_logp(hidden, self.lm_head_weight, targets, temperature=temperature,
                                    real_vocab_size=real_vocab_size, with_entropy=with_entropy,
                                    support_ids=support_ids,
                                    logits=logits if self.ops.logp.reuse_logits else None)
