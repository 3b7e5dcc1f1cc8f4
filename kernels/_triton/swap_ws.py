"""`linear`'s decode-sized forward (x @ weight^T, few rows of x) with swapped operands, warp-specialised
in Gluon: the swapped buckets of matmul_configs.py that set gluon.

The same sums as matmul._gemm_swap_kernel (and so as _gemm_kernel): C^T = W @ X^T, 64 weight rows a
program as the wgmma's M side and the rows of x (16-64, zero-filled past M by TMA) as its N side, each
element accumulated in fp32 over the BLOCK_K steps in ascending k, one wgmma group a step, the first
step from zero. Which warps issue the loads, and how many steps share a barrier, never changes a sum.

Why: at decode sizes a program does little per step (a 64 x 16 x 64 product), yet the tl kernel
waits on a barrier and a wgmma every step; its rate did not move with its stage count (8-14), so the
loads in flight were not what it waited for (qkv's 96 programs leave 36 SMs idle: each program's
rate is the product's rate). This schedule, which waits once every STEPS steps, ran 1.03x cuBLAS
on qkv at M = 1 and 8 where the tl kernel ran 0.86-0.89x (matmul_configs.py, benchmarks/RESULTS.md).
Here a producer warp issues the TMA loads of STEPS K steps into each slot of a STAGES-deep ring, and one
consumer warpgroup waits once a slot, issues its STEPS wgmma groups, leaves them in flight while it
frees the previous slot and awaits the next. A slot holds whole steps only: K's steps must be a
multiple of STEPS (GemmConfig.steps_per_stage), which every Qwen3 width is; the launcher says so
otherwise.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from lockstep.kernels._triton.matmul_configs import GemmConfig, block_k, tile_rows
from lockstep.kernels._triton.splitk_ws import (PRODUCER_REGISTERS, SHARED_BYTES, gluon_descriptor, invalidate_ring,
                                                ring_barriers)

W_ROWS = gl.constexpr(64)  # weight rows a program: one consumer warpgroup's wgmma M side


@gluon.jit
def _producer(x_desc, w_desc, x_smem, w_smem, ready, empty, pid_w, pid_x, slots, STAGES: gl.constexpr,
              STEPS: gl.constexpr):
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    NBYTES: gl.constexpr = STEPS * (x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    for t in range(slots):
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)  # the slot's first use passes at once
        bar = ready.index(s)
        mbarrier.expect(bar, NBYTES)
        for i in gl.static_range(STEPS):
            k = (t * STEPS + i) * BLOCK_K
            tma.async_copy_global_to_shared(w_desc, [pid_w * W_ROWS, k], bar, w_smem.index(s * STEPS + i))
            tma.async_copy_global_to_shared(x_desc, [pid_x * x_desc.block_type.shape[0], k], bar,
                                            x_smem.index(s * STEPS + i))


@gluon.jit
def _consumer(x_smem, w_smem, ready, empty, out_ptr, M, N, stride_o, pid_w, pid_x, slots, STAGES: gl.constexpr,
              STEPS: gl.constexpr, BLOCK_X: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_X, 16])
    acc = gl.zeros([W_ROWS, BLOCK_X], gl.float32, mma)
    for t in range(slots):
        s = t % STAGES
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        for i in gl.static_range(STEPS):  # ascending k; the first step from zero
            acc = warpgroup_mma(w_smem.index(s * STEPS + i), x_smem.index(s * STEPS + i).permute((1, 0)), acc,
                                use_acc=t * STEPS + i > 0, is_async=True)
        # this slot's groups stay in flight; the previous slot's are done, so its buffers are free
        acc = warpgroup_mma_wait(num_outstanding=STEPS, deps=(acc,))
        mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), count=1, pred=t > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    # acc [W_ROWS, BLOCK_X]: element (n, m) is out[m, n]
    offs_n = pid_w * W_ROWS + gl.arange(0, W_ROWS, layout=gl.SliceLayout(1, mma))
    offs_m = pid_x * BLOCK_X + gl.arange(0, BLOCK_X, layout=gl.SliceLayout(0, mma))
    ptrs = out_ptr + offs_m.to(gl.int64)[None, :] * stride_o + offs_n[:, None]
    gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[None, :] & (offs_n < N)[:, None])


@gluon.jit(do_not_specialize=["M"])  # one binary for every batch size, as matmul._gemm_swap_kernel
def _gemm_swap_ws_kernel(x_desc, w_desc, out_ptr, M, N, K, stride_o, STAGES: gl.constexpr, STEPS: gl.constexpr):
    BLOCK_X: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    pid_w = gl.program_id(0)
    pid_x = gl.program_id(1)
    slots = gl.cdiv(K, BLOCK_K) // STEPS
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES * STEPS, BLOCK_X, BLOCK_K], x_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES * STEPS, W_ROWS, BLOCK_K], w_desc.layout)
    ready, empty = ring_barriers(STAGES, 1)
    gl.warp_specialize([
        (_consumer, (x_smem, w_smem, ready, empty, out_ptr, M, N, stride_o, pid_w, pid_x, slots, STAGES, STEPS,
                     BLOCK_X)),
        (_producer, (x_desc, w_desc, x_smem, w_smem, ready, empty, pid_w, pid_x, slots, STAGES, STEPS)),
    ], [1], [PRODUCER_REGISTERS])
    invalidate_ring(ready, empty, STAGES)


def swap_ws_fits(k: int, cfg: GemmConfig, dtype: torch.dtype) -> bool:
    """Whether the Gluon kernel takes a product of K = k under cfg: whole slots of K steps (the tl
    kernel, matmul._gemm_swap_kernel, runs the same sums otherwise)."""
    return triton.cdiv(k, block_k(dtype)) % cfg.steps_per_stage == 0


def gemm_swap_ws(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cfg: GemmConfig) -> None:
    """out [M, N] = x [M, K] @ weight [N, K]^T, both row-major with 16-byte aligned rows (16-bit)."""
    if not (cfg.gluon and cfg.swap_ab) or cfg.block_n != W_ROWS.value:
        raise ValueError(f"{cfg}: the swapped Gluon kernel takes gluon=True, swap_ab=True and block_n={W_ROWS.value}")
    if not swap_ws_fits(x.shape[1], cfg, x.dtype):
        raise ValueError(f"{cfg}: K = {x.shape[1]} is not whole slots of {cfg.steps_per_stage} K steps; "
                         "run the tl kernel (matmul._gemm_swap_kernel, the same sums)")
    m, n = out.shape
    bk = block_k(x.dtype)
    rows = tile_rows(m, cfg)
    shared = cfg.num_stages * cfg.steps_per_stage * (rows + W_ROWS.value) * bk * x.element_size()
    if shared > SHARED_BYTES:
        raise ValueError(f"{cfg}: {cfg.num_stages} stages of {cfg.steps_per_stage} K steps of {rows} x rows and "
                         f"{W_ROWS.value} weight rows take {shared} bytes of shared memory, more than {SHARED_BYTES}")
    _gemm_swap_ws_kernel[(triton.cdiv(n, W_ROWS.value), triton.cdiv(m, rows))](
        gluon_descriptor(x, [rows, bk]), gluon_descriptor(weight, [W_ROWS.value, bk]), out, m, n, x.shape[1],
        out.stride(0), STAGES=cfg.num_stages, STEPS=cfg.steps_per_stage, num_warps=cfg.num_warps)
