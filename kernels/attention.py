"""Causal attention with one numerics for training, prefill and decode (torch reference).

Rule: keys are visited in fixed blocks of KV_BLOCK positions, in order, and each block's
online-softmax state is merged into the running state in that order. A query at absolute position
p sees keys 0..p of its own sequence; blocks beyond p are exact no-ops (rescale by exp(0) = 1, add
exact zeros), so the result for a token is the same whether it is computed with the whole sequence
(training), with its prompt (prefill) or alone against a KV cache (decode), and whatever the batch.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lockstep.kernels._backend import get_backend
from lockstep.kernels._invariant import ROW_TILE, tree_sum

KV_BLOCK = 16


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """q [B, Tq, H, D]; k, v [B, S, Hkv, D] (keys at absolute positions 0..S-1);
    q_pos [B, Tq] absolute position of each query (it attends to keys <= q_pos).
    Returns [B, Tq, H, D]. GQA: H must be a multiple of Hkv.
    """
    b, tq, h, d = q.shape
    s_len, hkv = k.shape[1], k.shape[2]
    if h % hkv:
        raise ValueError(f"attention: {h} query heads is not a multiple of {hkv} kv heads")
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"attention: shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if int(q_pos.max()) >= s_len:
        raise ValueError(f"attention: query position {int(q_pos.max())} has no key (cache holds {s_len})")
    if get_backend() == "triton":
        from lockstep.kernels._triton.attention import causal_attention as triton_causal_attention

        return triton_causal_attention(q, k, v, q_pos, scale)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = h // hkv

    # One row per (query, head); rows of one kv head are grouped into fixed ROW_TILE tiles.
    rows = q.reshape(b, tq, hkv, group, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, tq * group, d)
    pos = q_pos[:, None, :, None].expand(b, hkv, tq, group).reshape(b, hkv, tq * group)
    pad = (-rows.shape[2]) % ROW_TILE
    if pad:
        rows = F.pad(rows, (0, 0, 0, pad))
        pos = F.pad(pos, (0, pad))  # padded rows attend to key 0 only: finite and discarded
    n_tiles = rows.shape[2] // ROW_TILE
    n = b * hkv * n_tiles
    q_tiles = rows.reshape(n, ROW_TILE, d)
    pos = pos.reshape(n, ROW_TILE, 1)

    n_blocks = (int(q_pos.max()) + KV_BLOCK) // KV_BLOCK
    kv_pad = n_blocks * KV_BLOCK - s_len
    if kv_pad > 0:
        k = F.pad(k, (0, 0, 0, 0, 0, kv_pad))
        v = F.pad(v, (0, 0, 0, 0, 0, kv_pad))

    m = q.new_full((n, ROW_TILE), float("-inf"), dtype=torch.float32)
    l = q.new_zeros((n, ROW_TILE), dtype=torch.float32)
    acc = q.new_zeros((n, ROW_TILE, d), dtype=torch.float32)
    for j in range(n_blocks):
        lo = j * KV_BLOCK
        kb = k[:, lo:lo + KV_BLOCK].permute(0, 2, 3, 1)  # [B, Hkv, D, KV_BLOCK]
        kb = kb[:, :, None].expand(b, hkv, n_tiles, d, KV_BLOCK).reshape(n, d, KV_BLOCK)
        scores = torch.bmm(q_tiles, kb).float() * scale
        key_pos = torch.arange(lo, lo + KV_BLOCK, device=q.device)
        scores = scores.masked_fill(key_pos > pos, float("-inf"))
        # The running max is only a stabiliser: the output does not depend on it mathematically.
        m_new = torch.maximum(m, scores.detach().amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(scores - m_new.unsqueeze(-1))
        l = l * alpha + tree_sum(p)
        vb = v[:, lo:lo + KV_BLOCK].permute(0, 2, 1, 3)  # [B, Hkv, KV_BLOCK, D]
        vb = vb[:, :, None].expand(b, hkv, n_tiles, KV_BLOCK, d).reshape(n, KV_BLOCK, d)
        acc = acc * alpha.unsqueeze(-1) + torch.bmm(p.to(v.dtype), vb).float()
        m = m_new
    out = (acc / l.unsqueeze(-1)).to(q.dtype)
    out = out.reshape(b, hkv, n_tiles * ROW_TILE, d)[:, :, : tq * group]
    return out.reshape(b, hkv, tq, group, d).permute(0, 2, 1, 3, 4).reshape(b, tq, h, d)
