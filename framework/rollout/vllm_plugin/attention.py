"""Lockstep attention on vLLM's paged KV cache: one backend for vLLM's CUDA and CPU builds.

`LockstepAttentionBackend` borrows nothing from vLLM's kernels: its metadata builder hands the
runner's own per-step tensors (query_start_loc, seq_lens, block table, slot mapping) to the
implementation, which writes each new key/value into its [block, head, slot] and computes the
attention with `lockstep.kernels.paged_attention` (the rollout ops' paged slot): the numerics of
training, so a token attends exactly as the trainer computes it, in a prefill, a chunked prefill or
a decode step alike.

Capturable: no host synchronisation and no data-dependent shapes in the cache write or the kernel
call (the maxima come from the metadata as Python ints), so vLLM's FULL_DECODE_ONLY CUDA graphs
capture decode steps; prefills run between the compiled pieces (attention is a splitting op).

KV cache, both vLLM versions (kv_layout.py): a per-layer [num_blocks, num_kv_heads, block_size,
2 * head_size] view (keys in [..., :D], values in [..., D:]); only the logical view is indexed, so
any physical layout vLLM picks works. Version differences are in the classmethods marked below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl, AttentionMetadataBuilder,
                                       AttentionType, CommonAttentionMetadata, MultipleOf)

from lockstep.framework.rollout.vllm_plugin.evidence import process_ops
from lockstep.framework.rollout.vllm_plugin.kv_layout import kv_cache_shape, split_kv_cache
from lockstep.kernels import write_paged_kv

try:  # vLLM 0.32 (CPU CI); 0.26 has no KV-cache layout negotiation
    from vllm.v1.kv_cache_layout import KVCacheLayout
except ImportError:  # pragma: no cover - vLLM 0.26
    KVCacheLayout = None


@dataclass
class LockstepAttentionMetadata:
    num_actual_tokens: int  # query rows to compute (the padded count inside a FULL CUDA graph)
    max_query_len: int  # upper bounds, as Python ints: they size the kernel grids without a sync
    max_seq_len: int
    query_start_loc: torch.Tensor  # [R+1] int32: the runner's persistent buffers, never copies (a
    seq_lens: torch.Tensor  # [R] int32          CUDA graph replays whatever the runner wrote there)
    block_table: torch.Tensor  # [R, max_pages] int32
    slot_mapping: torch.Tensor  # [T] int64, -1 = padding


class LockstepAttentionMetadataBuilder(AttentionMetadataBuilder[LockstepAttentionMetadata]):
    # Uniform single-token decode batches may be captured whole (FULL_DECODE_ONLY, FULL_AND_PIECEWISE)
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold: int | None = None  # any mix and order of prefills and decodes

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, **kwargs):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.max_model_len = vllm_config.model_config.max_model_len

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> LockstepAttentionMetadata:
        m = common_attn_metadata
        if not (isinstance(m.causal, bool) and m.causal):
            raise NotImplementedError("lockstep attention is causal decoder attention only")
        return LockstepAttentionMetadata(m.num_actual_tokens, m.max_query_len, m.max_seq_len, m.query_start_loc,
                                         m.seq_lens, m.block_table_tensor, m.slot_mapping)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> LockstepAttentionMetadata:
        md = self.build(0, common_attn_metadata)
        md.max_seq_len = max(md.max_seq_len, self.max_model_len)  # the graph serves every length
        return md


class LockstepAttentionImpl(AttentionImpl[LockstepAttentionMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 **extra_impl_args) -> None:
        unsupported = {"alibi slopes": alibi_slopes is not None, "a sliding window": sliding_window is not None,
                       "a logits soft cap": bool(logits_soft_cap), "attention sinks": extra_impl_args.get("sinks") is not None,
                       f"attn_type {attn_type}": attn_type != AttentionType.DECODER,
                       f"kv_cache_dtype {kv_cache_dtype}": kv_cache_dtype not in ("auto", "float16", "bfloat16", "float32")}
        if any(unsupported.values()):
            raise NotImplementedError(f"lockstep attention does not support {', '.join(k for k, v in unsupported.items() if v)}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype, self.attn_type = kv_cache_dtype, attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """key/value [T, Hkv, D] into their slots (slot = block * block_size + offset; -1 = a padding
        row, skipped): an exact copy, lockstep.kernels.write_paged_kv (one launch on the GPU)."""
        if kv_cache.numel() == 0:  # a placeholder before the cache is bound
            return
        write_paged_kv(key, value, *split_kv_cache(kv_cache), slot_mapping)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: LockstepAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, H, D]; output [T, H, D], allocated by vLLM's Attention layer at the padded token
        count, written in place. attn_metadata is None in the memory-profiling run and in warm-ups."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("lockstep attention does not fuse output quantization")
        if attn_metadata is None:
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        k_cache, v_cache = split_kv_cache(kv_cache)
        paged_attention = process_ops()[0].attention.paged_attention
        out = paged_attention(query[:n], k_cache, v_cache, attn_metadata.block_table, attn_metadata.seq_lens,
                              attn_metadata.query_start_loc, self.scale, attn_metadata.max_query_len,
                              attn_metadata.max_seq_len)
        output[:n].copy_(out.view(n, *output.shape[1:]))
        return output


class LockstepAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False  # vLLM calls do_kv_cache_update first
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", "float32"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM looks the name up in AttentionBackendEnum

    @staticmethod
    def get_impl_cls() -> type[LockstepAttentionImpl]:
        return LockstepAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[LockstepAttentionMetadataBuilder]:
        return LockstepAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]  # vLLM 0.26 calls this without arguments, 0.32 with the spec

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, num_kv_heads, block_size, head_size)  # vLLM 0.26 allocates this

    @classmethod
    def supported_kv_cache_layouts(cls):  # vLLM 0.32 negotiates a physical layout
        return None if KVCacheLayout is None else (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size >= 16 and head_size & (head_size - 1) == 0  # the Triton kernel's rule

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True
