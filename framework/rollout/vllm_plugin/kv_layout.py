"""The paged KV cache that lockstep's vLLM backend asks vLLM for, and its key / value views.

One definition for the backend (attention.py) and for the benchmarks that time lockstep's attention
on the cache a rollout runs (benchmarks/bench_attention.py, sweep_attention.py). Imports no vLLM.

A layer's cache is [num_blocks, num_kv_heads, block_size, 2 * head_size]: a page holds each kv head's
slots together, and a slot its key ([..., :D]) beside its value ([..., D:]), so one kv head's keys and
values of a page are one contiguous run of block_size * 2 * head_size elements.
"""
from __future__ import annotations

import torch


def kv_cache_shape(num_blocks: int, num_kv_heads: int, block_size: int, head_size: int) -> tuple[int, ...]:
    """The shape vLLM allocates for a layer (LockstepAttentionBackend.get_kv_cache_shape)."""
    return (num_blocks, num_kv_heads, block_size, 2 * head_size)


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nb, Hkv, bs, 2*D] -> key, value views [nb, Hkv, bs, D] (equal strides, last dim contiguous)."""
    d = kv_cache.shape[-1] // 2
    return kv_cache[..., :d], kv_cache[..., d:]
