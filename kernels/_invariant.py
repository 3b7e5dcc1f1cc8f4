"""Building blocks of the torch reference backend: reductions whose per-row result never depends
on the shape of the batch around the row.

Why these two and nothing else: on the CPU build of torch, `torch.matmul` row results change with
M (M=1 takes a GEMV path) and vectorised reductions/`sigmoid` change with where an element falls
(vector body vs scalar tail). A single `bmm` over all row tiles is not safe either: its result
changes with the number of tiles for N=1 and for K in the thousands (measured with torch 2.13).
What was measured to be independent of the surrounding batch, the row's place in its tile and the
thread count is (1) one `mm` call per fixed [ROW_TILE, K] x [K, N] tile, and (2) elementwise
arithmetic plus `exp`, `log`, `rsqrt`, `cos`, `sin`, division. Every reference op is composed from
these; tests/test_kernels_invariance.py checks each op, not just these helpers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_TILE = 16  # rows per GEMM call: fixed, so the GEMM library sees one shape whatever M is


def tiled_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] computed as one GEMM call per fixed [ROW_TILE, K] tile (zero-padded rows),
    so the GEMM library sees the same problem whatever M is.

    The operand layouts are canonical too (a row-major, b column-major, i.e. b^T row-major), since
    the library picks its kernel by layout as well: with MKL's AVX2 kernels a strided `a` or a
    row-major `b` with 5..11 columns rounds odd rows of a tile differently from even ones."""
    a = a.contiguous()
    bt = b.t().contiguous()  # a no-op for a transposed nn.Linear weight
    m = a.shape[0]
    if m == 0:
        return a @ bt.t()  # empty, and attached to autograd like any product
    pad = (-m) % ROW_TILE
    if pad:
        a = F.pad(a, (0, 0, 0, pad))
    return torch.cat([a[i:i + ROW_TILE] @ bt.t() for i in range(0, a.shape[0], ROW_TILE)])[:m]


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` as a fixed balanced tree of elementwise adds.

    The length is zero-padded to a power of two; because `x + 0 == x` exactly, padding further
    never changes the result, so a partial vocab chunk sums exactly like a full one.
    """
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        x = F.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]
