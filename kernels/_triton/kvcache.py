"""Writing new keys and values into a paged KV cache: one launch per layer and step (the torch
reference's gather / where / scatter is a dozen small kernels)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(key, value, k_cache, v_cache, slots, stride_kt, stride_kh, stride_vt, stride_vh, stride_block,
                     stride_head, stride_slot, page_size, hkv, d, HKV: tl.constexpr, D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    if slot < 0:  # a padding row of a CUDA-graph batch
        return
    heads = tl.arange(0, HKV)[:, None]
    cols = tl.arange(0, D)[None, :]
    t = t.to(tl.int64)
    dst = (slot // page_size) * stride_block + heads * stride_head + (slot % page_size) * stride_slot + cols
    inside = (heads < hkv) & (cols < d)
    k_src = key + t * stride_kt + heads * stride_kh + cols
    v_src = value + t * stride_vt + heads * stride_vh + cols
    tl.store(k_cache + dst, tl.load(k_src, mask=inside).to(k_cache.dtype.element_ty), mask=inside)
    tl.store(v_cache + dst, tl.load(v_src, mask=inside).to(v_cache.dtype.element_ty), mask=inside)


def write_paged_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    n = min(slot_mapping.shape[0], key.shape[0])
    if n == 0:
        return
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError(f"write_paged_kv: k/v cache views need equal strides with a unit last one, got "
                         f"{k_cache.stride()} and {v_cache.stride()}")
    hkv, d = key.shape[1], key.shape[2]
    # read in place (a value that is a row view of the fused q/k/v output among them)
    key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (key, value))
    _write_kv_kernel[(n,)](key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1),
                           value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1),
                           k_cache.stride(2), k_cache.shape[2], hkv, d,
                           HKV=triton.next_power_of_2(hkv), D=triton.next_power_of_2(d))
