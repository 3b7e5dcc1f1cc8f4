"""Batch-invariant Triton GEMM: `matmul(a, b)`, `linear(x, weight, bias)` and their backward.

Why a row's result never depends on M: every output element is accumulated in fp32 over
ceil(K / BLOCK_K) `tl.dot` steps of a BLOCK_K fixed per dtype, in ascending k (matmul_configs.py).
There is no split-K or stream-K, so no element's sum is ever cut differently; the tile shape,
chosen per M bucket, only decides which program computes an element. K tails are TMA zero-fill,
which adds exact zeros.

Schedule: persistent. One program per SM loops over output tiles in a grouped order (GROUP_M row
tiles sweep the N tiles together, so programs running at the same time read the same weight tiles
from L2). Operands arrive through TMA tensor descriptors built on the device.

The forward entry points make their operands row-major, so the operand layout (and with it the
instruction sequence) is a function of the op alone, never of the caller's strides. The backward
passes transposed views, which the kernel reads in place (A_TRANSPOSED / B_TRANSPOSED): it must be
deterministic for a fixed shape, which it is, but does not promise per-row invariance.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from lockstep.kernels._triton._device import INTERPRETING, resident_programs
from lockstep.kernels._triton._order import grouped_tile
from lockstep.kernels._triton._tma import aligned_empty, install_descriptor_allocator, tma_matrix
from lockstep.kernels._triton.matmul_configs import (MAX_WARP_SPECIALIZED_STAGES, block_k, config_for, tile_rows,
                                                     tl_tile)
from lockstep.kernels._triton.splitk_ws import row_tree_ws
from lockstep.kernels._triton.swap_ws import gemm_swap_ws, swap_ws_fits


# M is not specialised: a separate M == 1 (or M % 16 == 0) compilation would be another binary for
# some batch sizes; one binary for every M leaves nothing to differ.
@triton.jit(do_not_specialize=["M", "num_programs"])
def _gemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_a, stride_b, stride_c, num_programs,
                 A_TRANSPOSED: tl.constexpr, B_TRANSPOSED: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 WIDEN_OPERANDS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """C[M, N] = A[M, K] @ B[K, N] (+ bias). A_TRANSPOSED: a_ptr holds A^T [K, M] row-major;
    B_TRANSPOSED: b_ptr holds B^T [N, K] row-major (an nn.Linear weight).
    WARP_SPECIALIZE: the tile loop runs warp-specialised (GemmConfig.warp_specialize), unflattened:
    Triton's Hopper pass does not split a flattened loop."""
    if A_TRANSPOSED:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[stride_a, 1], block_shape=[BLOCK_K, BLOCK_M])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_a, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_TRANSPOSED:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_b, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_b, 1], block_shape=[BLOCK_K, BLOCK_N])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_c, 1], block_shape=[BLOCK_M, BLOCK_N])
    out_dtype = c_ptr.dtype.element_ty

    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    # The epilogue recomputes its tile's coordinates from a counter of its own (as in Triton's
    # persistent-matmul tutorial), so that flattening the tile and K loops into one pipelined loop
    # does not keep the prologue's values alive across it.
    epilogue_tile = tl.program_id(0) - num_programs
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_programs, flatten=not WARP_SPECIALIZE,
                     warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):  # ascending k, the same BLOCK_K steps for every tile and every M
            off_k = ki * BLOCK_K
            if A_TRANSPOSED:
                a = a_desc.load([off_k, off_m]).T
            else:
                a = a_desc.load([off_m, off_k])
            if B_TRANSPOSED:
                b = b_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
            if WIDEN_OPERANDS:
                # Only under the interpreter: its tl.dot multiplies bf16 tiles as their raw uint16
                # bits (triton 3.6). Widening to fp32 is exact, and so are the bf16 products.
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            # ieee: fp32 operands get exact fp32 FMAs instead of TF32; no effect on 16-bit operands.
            acc = tl.dot(a, b, acc, input_precision="ieee")

        epilogue_tile += num_programs
        pid_m, pid_n = grouped_tile(epilogue_tile, num_pid_m, num_pid_n, GROUP_M)
        c = acc.to(out_dtype)
        if HAS_BIAS:
            # The reference's order: round the product to the output dtype, then add the bias.
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            c = (c.to(tl.float32) + bias.to(tl.float32)[None, :]).to(out_dtype)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], c)


@triton.jit(do_not_specialize=["M"])
def _gemm_swap_kernel(x_ptr, w_ptr, c_ptr, bias_ptr, M, N, K, stride_x, stride_w, stride_c, HAS_BIAS: tl.constexpr,
                      BLOCK_X: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
                      WIDEN_OPERANDS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """C[M, N] = X[M, K] @ W[N, K]^T (+ bias) for a few rows, computed as C^T = W @ X^T: the weight
    rows are the MMA's M side (BLOCK_W, a multiple of the 64 rows a wgmma takes) and the rows of X
    its N side (BLOCK_X, 16-256 wide), so a decode-sized X is not padded to 64 rows in every stage.
    Each element is the same sum as in _gemm_kernel: the same BLOCK_K steps in ascending k, each one
    wgmma, whose elements do not depend on which operand is which (checked on the GPU by the row
    tests of every M bucket). One program per tile, no persistence: decode shapes have few tiles.
    WARP_SPECIALIZE: the K loop runs warp-specialised (a producer warpgroup keeps the weight's TMA
    loads in flight; two consumer warpgroups take 64 of the BLOCK_W weight rows each)."""
    pid_w = tl.program_id(0)
    pid_x = tl.program_id(1)
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_w, 1], block_shape=[BLOCK_W, BLOCK_K])
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_x, 1], block_shape=[BLOCK_X, BLOCK_K])
    acc = tl.zeros((BLOCK_W, BLOCK_X), dtype=tl.float32)
    for ki in tl.range(tl.cdiv(K, BLOCK_K), warp_specialize=WARP_SPECIALIZE):  # ascending k, as _gemm_kernel
        w = w_desc.load([pid_w * BLOCK_W, ki * BLOCK_K])
        x = x_desc.load([pid_x * BLOCK_X, ki * BLOCK_K]).T
        if WIDEN_OPERANDS:  # the interpreter multiplies bf16 tiles as raw bits (see _gemm_kernel)
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(w, x, acc, input_precision="ieee")
    out_dtype = c_ptr.dtype.element_ty
    c = acc.to(out_dtype)  # [BLOCK_W, BLOCK_X]: element (n, m) is C[m, n]
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_x = pid_x * BLOCK_X + tl.arange(0, BLOCK_X)
    if HAS_BIAS:  # the reference's order, as in _gemm_kernel
        bias = tl.load(bias_ptr + offs_w, mask=offs_w < N, other=0.0)
        c = (c.to(tl.float32) + bias.to(tl.float32)[:, None]).to(out_dtype)
    tl.store(c_ptr + offs_x[None, :].to(tl.int64) * stride_c + offs_w[:, None], c,
             mask=(offs_x[None, :] < M) & (offs_w[:, None] < N))


def _gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) -> [M, N] contiguous, in a's dtype."""
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0 or k == 0:
        out = a.new_zeros(m, n)
        return out if bias is None else out + bias
    a_rows, a_transposed = tma_matrix(a)
    b_rows, b_transposed = tma_matrix(b)
    c = aligned_empty(m, n, a.dtype, a.device)
    cfg = config_for(m, a.dtype, n)
    if (cfg.gluon and b_transposed and not a_transposed and not INTERPRETING  # x @ weight^T: a Gluon kernel
            and (not cfg.swap_ab or swap_ws_fits(k, cfg, a.dtype))):
        if cfg.swap_ab:
            gemm_swap_ws(a_rows, b_rows, c, cfg)  # decode-sized x: _gemm_swap_kernel's sums
        else:
            row_tree_ws(a_rows, b_rows, c, 1, k, k, block_k(a.dtype), cfg)  # one K chunk: this kernel's sums
        if bias is not None:  # the reference's order, as in _gemm_kernel's epilogue
            c = (c.float() + bias.float()).to(a.dtype)
        return c.contiguous()
    # a Gluon config's tile in the tl kernel (other operand layouts, the interpreter, a K of partial slots)
    cfg = tl_tile(cfg)
    if cfg.warp_specialize and cfg.num_stages > MAX_WARP_SPECIALIZED_STAGES:
        raise ValueError(f"{cfg}: Triton's warp specialisation with more than {MAX_WARP_SPECIALIZED_STAGES} stages "
                         "gave other bits than the plain kernel on an H200 (Triton 3.6; matmul_configs.py)")
    install_descriptor_allocator(a.device)
    if cfg.swap_ab and b_transposed and not a_transposed:  # x @ weight^T with an nn.Linear weight
        rows = tile_rows(m, cfg)
        _gemm_swap_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, rows))](
            a_rows, b_rows, c, c if bias is None else bias, m, n, k, a_rows.stride(0), b_rows.stride(0), c.stride(0),
            HAS_BIAS=bias is not None, BLOCK_X=rows, BLOCK_W=cfg.block_n, BLOCK_K=block_k(a.dtype),
            WIDEN_OPERANDS=INTERPRETING and a.dtype == torch.bfloat16, WARP_SPECIALIZE=cfg.warp_specialize,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return c.contiguous()
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    programs = min(tiles, resident_programs(a.device) * cfg.programs_per_sm)
    _gemm_kernel[(programs,)](
        a_rows, b_rows, c, c if bias is None else bias, m, n, k,
        a_rows.stride(0), b_rows.stride(0), c.stride(0), programs,
        A_TRANSPOSED=a_transposed, B_TRANSPOSED=b_transposed, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k(a.dtype), GROUP_M=cfg.group_m,
        WIDEN_OPERANDS=INTERPRETING and a.dtype == torch.bfloat16,
        # a swapped config's warp specialisation splits its weight rows: unswapped (the backward's
        # operand layouts), its block_m x rows may be too few to split
        WARP_SPECIALIZE=cfg.warp_specialize and not cfg.swap_ab,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return c.contiguous()  # a copy only when N needed a padded row stride


def _check_operands(op: str, *tensors: torch.Tensor) -> None:
    dtype, device = tensors[0].dtype, tensors[0].device
    block_k(dtype)  # raises for unsupported dtypes
    for t in tensors[1:]:
        if t.dtype != dtype or t.device != device:
            raise ValueError(f"{op}: operands must share dtype and device, got "
                             f"{', '.join(f'{x.dtype} on {x.device}' for x in tensors)}")


def _check_matmul(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul expects [M,K] @ [K,N], got {tuple(a.shape)} @ {tuple(b.shape)}")
    _check_operands("matmul", a, b)


def _check_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear expects x [..., K] and weight [N, K], got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"linear: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    _check_operands("linear", x, weight, *([] if bias is None else [bias]))


@torch.library.custom_op("lockstep::matmul", mutates_args=())
def matmul_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check_matmul(a, b)
    return _gemm(a, b)


@matmul_op.register_fake
def _matmul_fake(a, b):
    _check_matmul(a, b)
    return a.new_empty(a.shape[0], b.shape[1])


def _matmul_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _matmul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    da = matmul_op(grad, b.t()) if ctx.needs_input_grad[0] else None
    db = matmul_op(a.t(), grad) if ctx.needs_input_grad[1] else None
    return da, db


matmul_op.register_autograd(_matmul_backward, setup_context=_matmul_setup)


@torch.library.custom_op("lockstep::linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    _check_linear(x, weight, bias)
    out = _gemm(x.reshape(-1, x.shape[-1]), weight.t(), bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


@linear_op.register_fake
def _linear_fake(x, weight, bias):
    _check_linear(x, weight, bias)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _linear_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    g = grad.reshape(-1, grad.shape[-1])
    dx = matmul_op(g, weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
    dw = matmul_op(g.t(), x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
    # A plain column sum: torch's reductions use a fixed order for a fixed shape (no atomics).
    db = g.sum(0, dtype=torch.float32).to(g.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return dx, dw, db


linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N]; the Triton backend of lockstep.kernels.matmul."""
    return matmul_op(a.contiguous(), b.contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias[N]); the Triton backend of lockstep.kernels.linear."""
    return linear_op(x.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous())
