"""lockstep.kernels: deterministic, batch-invariant ops shared by trainer and rollout.

Every op's result for one row (token) is bitwise independent of the rows around it. The torch
reference backend builds each op from fixed-shape GEMM tiles and fixed reduction trees
(see _invariant.py); `set_backend` / LOCKSTEP_KERNEL_BACKEND picks the implementation.
"""
from lockstep.kernels._backend import (BACKENDS, get_backend, kernel_calls, set_backend, skipping_value_checks,
                                       using_backend, value_checks_enabled)
from lockstep.kernels.activation import silu_mul
from lockstep.kernels.attention import KV_BLOCK, causal_attention, paged_attention, varlen_attention, write_paged_kv
from lockstep.kernels.logp import NUM_VOCAB_CHUNKS, LinearLogpOutput, chunk_width, linear_logp, lm_head_logits
from lockstep.kernels.matmul import linear, linear_rows, matmul
from lockstep.kernels.norm import rms_norm
from lockstep.kernels.rope import apply_rope, rope_cos_sin
from lockstep.kernels.rowlinear import NUM_K_CHUNKS, row_parallel_linear

__all__ = [
    "BACKENDS", "get_backend", "set_backend", "using_backend", "kernel_calls", "skipping_value_checks",
    "value_checks_enabled", "matmul", "linear", "linear_rows", "rms_norm",
    "row_parallel_linear", "NUM_K_CHUNKS",
    "silu_mul", "rope_cos_sin", "apply_rope", "causal_attention", "varlen_attention", "paged_attention",
    "write_paged_kv",
    "KV_BLOCK", "linear_logp", "lm_head_logits",
    "LinearLogpOutput", "NUM_VOCAB_CHUNKS", "chunk_width",
]
