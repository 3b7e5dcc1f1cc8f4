"""Orders shared by the tl and Gluon kernels (a Gluon kernel calls these tl functions).

grouped_tile: the grouped order in which persistent and grid programs visit a 2-D grid of tiles:
GROUP row tiles (row blocks) sweep the column tiles side by side, so the programs running at once
share their operand rows in L2 (Triton's matmul tutorial). One definition for the GEMM, the
row-parallel tree and linear_logp; it moves no bit, only which program computes which tile when.

tree_join: the order in which the row-parallel GEMM's K-chunk products are summed (the canonical
balanced tree of kernels/rowlinear.py), one definition for splitk.py's tl kernel and the Gluon ones
(splitk_ws.py, swap_ws.py); tree_root: its top levels over subtree roots that split programs left in
a workspace. These two decide the bits."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(index, n_rows, n_cols, GROUP: tl.constexpr):
    """(row tile, column tile) of the index-th tile of an n_rows x n_cols grid in grouped order."""
    per_group = GROUP * n_cols
    first = (index // per_group) * GROUP
    size = tl.minimum(n_rows - first, GROUP)
    idx = index % per_group
    return first + idx % size, idx // size


@triton.jit
def tree_join(acc, j, h1, h2, h4, COUNT: tl.constexpr):
    """Chunk j's finished product joins the tree like a binary counter: added to its left sibling
    when j is odd, the pair to its left pair when j % 4 == 3, the quad to its left quad when
    j % 8 == 7. Returns the holders and the newest subtree (after the last chunk: the root)."""
    v = acc
    if COUNT > 1:  # (compile-time guards: a smaller subtree carries fewer holders)
        if j % 2 == 1:
            v = h1 + v
    if COUNT > 2:
        if j % 4 == 3:
            v = h2 + v
    if COUNT > 4:
        if j % 8 == 7:
            v = h4 + v
    if COUNT > 1:
        if j % 2 == 0:
            h1 = v
    if COUNT > 2:
        if j % 4 == 1:
            h2 = v
    if COUNT > 4:
        if j % 8 == 3:
            h4 = v
    return h1, h2, h4, v


@triton.jit
def _l2(ptr, mask):
    """A load of what other programs wrote: from L2 (.cg), never a stale L1 line; masked (a
    tile's rows past M lie past the workspace)."""
    return tl.load(ptr, mask=mask, other=0.0, cache_modifier=".cg")


@triton.jit
def tree_root(ws, step, mask, S: tl.constexpr):
    """The tree's top levels: the balanced tree over the S subtree roots at ws, ws + step, ... (S 2, 4
    or 8; fp32), each the root of the next run of consecutive chunks, joined as tree_join joins them."""
    if S == 2:
        root = _l2(ws, mask) + _l2(ws + step, mask)
    elif S == 4:
        root = (_l2(ws, mask) + _l2(ws + step, mask)) + (_l2(ws + 2 * step, mask) + _l2(ws + 3 * step, mask))
    else:
        tl.static_assert(S == 8)
        root = (((_l2(ws, mask) + _l2(ws + step, mask)) + (_l2(ws + 2 * step, mask) + _l2(ws + 3 * step, mask)))
                + ((_l2(ws + 4 * step, mask) + _l2(ws + 5 * step, mask))
                   + (_l2(ws + 6 * step, mask) + _l2(ws + 7 * step, mask))))
    return root
