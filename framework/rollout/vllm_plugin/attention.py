"""Attention on vLLM's paged KV cache through `lockstep.kernels.paged_attention`.

Subclasses vLLM's CPU backend for everything but the arithmetic (KV spec, block sizes, metadata
builder): the cache write is an exact copy into [block, head, slot], and paged_attention reads each
request's keys through its block table in the numerics of training, so a token attends exactly as
in training (prefill, chunked prefill and decode alike).
"""
from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from lockstep.framework.rollout.vllm_plugin.evidence import get_evidence
from lockstep.kernels import paged_attention


def _split_cache(kv_cache: torch.Tensor):
    """[num_blocks, Hkv, block_size, 2*D] -> key, value caches [num_blocks, Hkv, block_size, D]."""
    nb, hkv, bs, _ = kv_cache.shape
    return kv_cache.view(nb, hkv, 2 * bs, -1).chunk(2, dim=2)


class LockstepAttentionImpl(CPUAttentionBackendImpl):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = _split_cache(kv_cache)
        bs = key_cache.shape[2]
        n = slot_mapping.shape[0]
        valid = slot_mapping[:n] >= 0
        slots = slot_mapping[:n][valid]
        blocks, offsets = slots // bs, slots % bs
        key_cache[blocks, :, offsets] = key[:n][valid].to(key_cache.dtype)
        value_cache[blocks, :, offsets] = value[:n][valid].to(value_cache.dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if attn_metadata is None:  # profiling / warm-up
            return output
        evidence = get_evidence()
        key_cache, value_cache = _split_cache(kv_cache)
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        if not evidence.selection.attention:
            self._stock_forward(evidence.ops.attention.attention, query, key_cache, value_cache, attn_metadata, out)
            return output
        # The attention op slot has causal_attention's signature (contiguous K/V); paged_attention
        # reads the paged cache in place with the same numerics, so it is called directly and counted
        # on that slot's counter, which is what the readback reports for attention.attention.
        evidence.counter.calls["attention.attention"] += 1
        n = attn_metadata.num_actual_tokens
        q = query[:n].view(n, self.num_heads, self.head_size)
        out[:n] = paged_attention(q, key_cache, value_cache, attn_metadata.block_table, attn_metadata.seq_lens,
                                  attn_metadata.query_start_loc, self.scale, attn_metadata.max_query_len,
                                  attn_metadata.max_seq_len).to(out.dtype)
        return output

    def _stock_forward(self, attention, query, key_cache, value_cache, attn_metadata, out) -> None:
        """The P (stock) route: each request's keys gathered in position order for the op slot.
        The plugin registers this backend only when rollout attention is R, so this is a fallback."""
        bs = key_cache.shape[2]
        starts = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        for r, seq_len in enumerate(seq_lens):
            lo, hi = starts[r], starts[r + 1]
            if hi == lo:
                continue
            n_blocks = -(-seq_len // bs)
            blocks = attn_metadata.block_table[r, :n_blocks].long()
            k = key_cache[blocks].permute(0, 2, 1, 3).reshape(n_blocks * bs, self.num_kv_heads, -1)[:seq_len]
            v = value_cache[blocks].permute(0, 2, 1, 3).reshape(n_blocks * bs, self.num_kv_heads, -1)[:seq_len]
            q = query[lo:hi].view(hi - lo, self.num_heads, self.head_size)
            q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)
            res = attention(q[None], k[None], v[None], q_pos[None], self.scale)[0]
            out[lo:hi] = res.to(out.dtype)


class LockstepAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return LockstepAttentionImpl
