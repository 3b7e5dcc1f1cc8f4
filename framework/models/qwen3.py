"""Qwen3 decoder (RMSNorm, GQA with q/k norm, RoPE, SwiGLU, optional tied embeddings).

One definition serves the trainer and the native rollout engine. All arithmetic goes through the
`ModelOps` the instance was built with, parameter names are Hugging Face's (so checkpoints load
and save as HF safetensors), and keys are addressed by absolute position: a forward with a KV cache
(prefill, decode) and one without (teacher forcing) compute each token identically.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import lockstep.kernels as K
from lockstep.framework.models.ops import AttentionOps, FFNOps, ModelOps

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


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
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def tiny(cls, vocab_size: int) -> "Qwen3Config":
        return cls(vocab_size=vocab_size)

    def to_hf(self) -> dict:
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
                "attention_bias": False, "torch_dtype": "float32", **asdict(self)}

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3Config":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class Linear(nn.Module):
    def __init__(self, linear: Callable, in_features: int, out_features: int):
        super().__init__()
        self.linear = linear
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x):
        return self.linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, rms_norm: Callable, dim: int, eps: float):
        super().__init__()
        self.rms_norm, self.eps = rms_norm, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.rms_norm(x, self.weight, self.eps)


class KVCache:
    """Contiguous per-layer cache [B, max_len, Hkv, D]; token t of row b lives at [b, pos]."""

    def __init__(self, cfg: Qwen3Config, batch: int, max_len: int, dtype=torch.float32, device=None):
        shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(positions)
        self.k[layer][rows, positions] = k
        self.v[layer][rows, positions] = v
        return self.k[layer], self.v[layer]


class Attention(nn.Module):
    def __init__(self, ops: AttentionOps, cfg: Qwen3Config, layer: int):
        super().__init__()
        self.ops, self.cfg, self.layer = ops, cfg, layer
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(ops.linear, h, cfg.num_attention_heads * d)
        self.k_proj = Linear(ops.linear, h, cfg.num_key_value_heads * d)
        self.v_proj = Linear(ops.linear, h, cfg.num_key_value_heads * d)
        self.o_proj = Linear(ops.linear, cfg.num_attention_heads * d, h)
        self.q_norm = RMSNorm(ops.rms_norm, d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(ops.rms_norm, d, cfg.rms_norm_eps)

    def forward(self, x, positions, cos, sin, cache: KVCache | None):
        b, t, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_norm(self.q_proj(x).view(b, t, -1, d))
        k = self.k_norm(self.k_proj(x).view(b, t, -1, d))
        v = self.v_proj(x).view(b, t, -1, d)
        q, k = K.apply_rope(q, cos, sin), K.apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.write(self.layer, positions, k, v)
        out = self.ops.attention(q, k, v, positions, 1.0 / math.sqrt(d))
        return self.o_proj(out.reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, ops: FFNOps, cfg: Qwen3Config):
        super().__init__()
        self.ops = ops
        self.gate_proj = Linear(ops.linear, cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(ops.linear, cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(ops.linear, cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        return self.down_proj(self.ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, ops: ModelOps, cfg: Qwen3Config, layer: int):
        super().__init__()
        self.self_attn = Attention(ops.attention, cfg, layer)
        self.mlp = MLP(ops.ffn, cfg)
        self.input_layernorm = RMSNorm(ops.attention.rms_norm, cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(ops.ffn.rms_norm, cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, cos, sin, cache):
        x = x + self.self_attn(self.input_layernorm(x), positions, cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, ops: ModelOps, cfg: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(ops, cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(ops.logp.rms_norm, cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen3Config, ops: ModelOps):
        super().__init__()
        self.config, self.ops = cfg, ops
        self.model = Qwen3Model(ops, cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(ops.logp.linear, cfg.hidden_size, cfg.vocab_size)

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

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under their HF names (a tied LM head is stored once, as HF does)."""
        return {k: v for k, v in self.state_dict().items()}

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        tensors = dict(tensors)
        if self.lm_head is None:
            tensors.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {sorted(missing)}, "
                             f"unexpected {sorted(unexpected)}")

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_FILE).write_text(json.dumps(self.config.to_hf(), indent=2))
        save_file({k: v.detach().contiguous() for k, v in self.hf_state_dict().items()},
                  str(path / WEIGHTS_FILE))

    @classmethod
    def from_pretrained(cls, path: str | Path, ops: ModelOps) -> "Qwen3ForCausalLM":
        path = Path(path)
        if not (path / CONFIG_FILE).exists() or not (path / WEIGHTS_FILE).exists():
            raise FileNotFoundError(f"{path} is not a Qwen3 checkpoint: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
        cfg = Qwen3Config.from_hf(json.loads((path / CONFIG_FILE).read_text()))
        model = cls(cfg, ops)
        model.load_hf_state_dict(load_file(str(path / WEIGHTS_FILE)))
        return model

    # ---- compute -------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        """input_ids, positions [B, T] -> final hidden states [B, T, H] (after the last norm).

        Without a cache, row b must hold its sequence from position 0 (teacher forcing)."""
        cos, sin = K.rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, cos, sin, cache)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.logp.linear(hidden, self.lm_head_weight).float()

    def token_logp(self, hidden: torch.Tensor, targets: torch.Tensor, *, temperature=None,
                   real_vocab_size=None, with_entropy=False, support_ids=None):
        """Log-probability of `targets` given final hidden states [T, H] (the bitwise boundary).
        Returns an object with .logp [T] and .entropy [T] | None."""
        return self.ops.logp.linear_logp(hidden, self.lm_head_weight, targets, temperature=temperature,
                                    real_vocab_size=real_vocab_size, with_entropy=with_entropy,
                                    support_ids=support_ids)
