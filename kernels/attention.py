"""Causal attention with one numerics for training, prefill and decode (torch reference).

Rule: keys are visited in fixed blocks of KV_BLOCK positions, in order, and each block's
online-softmax state is merged into the running state in that order. A query at absolute position
p sees keys 0..p of its own sequence; blocks beyond p are exact no-ops (rescale by exp(0) = 1, add
exact zeros), so the result for a token is the same whether it is computed with the whole sequence
(training), with its prompt (prefill) or alone against a KV cache (decode), and whatever the batch.

Three entry points share that numerics: `causal_attention` (padded batch / contiguous cache),
`varlen_attention` (packed training sequences) and `paged_attention` (vLLM's paged cache, prefill,
chunked prefill and decode). The reference builds the last two by gathering into a padded batch for
the same core, which is batch-invariant, so all three give a token the same bits. The Triton backend
(kernels/_triton/attention.py) keeps the same rule with its own block sizes plus a chunk level that
lets decode split the keys; the two backends agree with float64, not bit for bit with each other.
Triton backend limits: head_dim a power of two >= 16; q, k, v of one dtype; its backward needs each
sequence's query positions consecutive (always true in training).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lockstep.kernels._backend import KernelOp, value_checks_enabled
from lockstep.kernels._invariant import ROW_TILE, tree_sum

KV_BLOCK = 16  # the reference's block; the Triton backend's is kernels/_triton/attention.py:KV_BLOCK


def _check_heads(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hkv: int) -> None:
    h = q.shape[-2]
    if h % hkv:
        raise ValueError(f"{name}: {h} query heads is not a multiple of {hkv} kv heads")
    if k.shape != v.shape or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{name}: shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """q [B, Tq, H, D]; k, v [B, S, Hkv, D] (keys at absolute positions 0..S-1);
    q_pos [B, Tq] absolute position of each query (it attends to keys <= q_pos).
    Returns [B, Tq, H, D]. GQA: H must be a multiple of Hkv.
    """
    _check_heads("attention", q, k, v, k.shape[-2])
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"attention: shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if value_checks_enabled() and int(q_pos.max()) >= k.shape[1]:
        raise ValueError(f"attention: query position {int(q_pos.max())} has no key (cache holds {k.shape[1]})")
    return _causal(q, k, v, q_pos, scale)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float | None = None, max_seqlen: int | None = None) -> torch.Tensor:
    """Causal attention over packed sequences: q [N, H, D]; k, v [N, Hkv, D]; cu_seqlens [B+1] int32
    (sequence r is tokens cu[r]..cu[r+1]-1, its token i at position i). Returns [N, H, D].
    max_seqlen: the longest sequence (or any larger bound) when the caller knows it, as flash-attn's
    varlen API takes it (Packed.width in the trainers). The op then reads nothing back from the
    device, forward or backward (no host sync: the host keeps queueing work while the GPU runs), and
    so does not check cu_seqlens' values: the caller vouches that they cover the N tokens. Without
    it, the op checks them and reads the longest sequence. It never changes a bit."""
    _check_heads("varlen_attention", q, k, v, k.shape[-2])
    if k.shape[0] != q.shape[0] or cu_seqlens.dim() != 1:
        raise ValueError(f"varlen_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must hold the same "
                         f"tokens, and cu_seqlens {tuple(cu_seqlens.shape)} must be a vector")
    if max_seqlen is None and int(cu_seqlens[-1]) != q.shape[0]:
        raise ValueError(f"varlen_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must hold the same "
                         f"tokens, all of them in the sequences of cu_seqlens {cu_seqlens.tolist()}")
    return _varlen(q, k, v, cu_seqlens, scale, max_seqlen)


def _reference_varlen(q, k, v, cu_seqlens, scale, max_seqlen=None):
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    idx, valid = _ragged_index(cu_seqlens[:-1], lens)
    pos = torch.arange(idx.shape[1], device=q.device).expand_as(idx)
    return _reference(q[idx], k[idx], v[idx], pos, scale)[valid]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float | None = None,
                    max_query_len: int | None = None, max_seq_len: int | None = None) -> torch.Tensor:
    """Attention of the queries of R requests against a paged cache (forward only).

    q [N, H, D]; k_cache, v_cache [num_blocks, Hkv, page_size, D]; block_table [R, max_pages] int32
    (position p of request r lives in page block_table[r, p // page_size], slot p % page_size);
    seq_lens [R] int32 (keys in the cache, the new ones included); query_start_loc [R+1] int32: the
    queries of request r are rows qsl[r]..qsl[r+1]-1, its last tokens, at positions
    seq_len - n_queries .. seq_len - 1 (a prefill, a chunk of one, or a decode step). Returns [N, H, D].
    max_query_len, max_seq_len: the largest n_queries and seq_len (or any larger bound) when the
    caller knows them, as vLLM's metadata does; the Triton backend then needs no device-to-host sync
    and can be captured in a CUDA graph. They never change a bit.
    """
    if k_cache.dim() != 4 or q.dim() != 3 or block_table.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} k_cache {tuple(k_cache.shape)} "
                         f"block_table {tuple(block_table.shape)} seq_lens {tuple(seq_lens.shape)}")
    _check_heads("paged_attention", q, k_cache, v_cache, k_cache.shape[1])
    return _paged(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, max_query_len, max_seq_len)


def write_paged_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, Hkv, D] into a paged cache (k_cache, v_cache [num_blocks, Hkv, page_size, D],
    views with equal strides) at slot_mapping [T'] (slot = block * page_size + offset; -1: a padding
    row, skipped; only the first min(T, T') rows are written). An exact copy, in place, with no
    data-dependent shape and no host sync (capturable in a CUDA graph). Slot 0 of block 0 must not
    be a real slot of a batch with padding rows (vLLM never hands out its null block 0): the torch
    reference parks padding rows there."""
    if key.shape != value.shape or key.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape \
            or key.shape[1:] != (k_cache.shape[1], k_cache.shape[3]):
        raise ValueError(f"write_paged_kv: key {tuple(key.shape)} value {tuple(value.shape)} do not fit the cache "
                         f"k {tuple(k_cache.shape)} v {tuple(v_cache.shape)} ([blocks, kv heads, page, head dim])")
    _write_kv(key, value, k_cache, v_cache, slot_mapping)


def _reference_write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Padding rows go to slot 0 of block 0 and write back what is there (no masked shape)."""
    bs = k_cache.shape[2]
    n = min(slot_mapping.shape[0], key.shape[0])
    slots = slot_mapping[:n].long()
    valid = (slots >= 0)[:, None, None]
    safe = slots.clamp_min(0)
    block, offset = safe // bs, safe % bs
    k_cache[block, :, offset] = torch.where(valid, key[:n].to(k_cache.dtype), k_cache[block, :, offset])
    v_cache[block, :, offset] = torch.where(valid, value[:n].to(v_cache.dtype), v_cache[block, :, offset])


def _reference_paged(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, max_query_len, max_seq_len):
    n_queries = query_start_loc[1:] - query_start_loc[:-1]
    if q.shape[0] == 0:
        return torch.empty_like(q)
    q_idx, q_valid = _ragged_index(query_start_loc[:-1], n_queries)
    q_pos = seq_lens[:, None] - n_queries[:, None] + torch.arange(q_idx.shape[1], device=q.device)
    k, v = _gather_pages(k_cache, v_cache, block_table, seq_lens)
    return _reference(q[q_idx], k, v, torch.where(q_valid, q_pos, 0), scale)[q_valid]


def _ragged_index(begin: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, max count] row indices of ragged sequences (padding points at row 0) and their mask."""
    width = max(int(count.max()), 1) if count.numel() else 1
    offs = torch.arange(width, device=begin.device)
    valid = offs < count[:, None]
    return torch.where(valid, begin[:, None].long() + offs, 0), valid


def _gather_pages(k_cache, v_cache, block_table, seq_lens) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's keys and values in position order, [R, max seq_len, Hkv, D]; zero past its
    length (a cache slot never written may hold anything, and 0 * NaN is NaN)."""
    page_size = k_cache.shape[2]
    pos = torch.arange(max(int(seq_lens.max()), 1), device=k_cache.device)
    pages = block_table[:, pos // page_size].long()
    valid = (pos < seq_lens[:, None])[..., None, None]
    k = torch.where(valid, k_cache[pages, :, pos % page_size], 0)
    v = torch.where(valid, v_cache[pages, :, pos % page_size], 0)
    return k, v


def _reference(q, k, v, q_pos, scale):
    b, tq, h, d = q.shape
    s_len, hkv = k.shape[1], k.shape[2]
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


_causal = KernelOp("causal_attention", _reference, "attention:causal_attention")
_varlen = KernelOp("varlen_attention", _reference_varlen, "attention:varlen_attention")
_paged = KernelOp("paged_attention", _reference_paged, "attention:paged_attention")
_write_kv = KernelOp("write_paged_kv", _reference_write_kv, "kvcache:write_paged_kv")
