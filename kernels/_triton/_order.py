"""The grouped order in which persistent and grid programs visit a 2-D grid of tiles: GROUP row
tiles (row blocks) sweep the column tiles side by side, so the programs running at once share their
operand rows in L2 (Triton's matmul tutorial). One definition for the GEMM, the row-parallel tree
(tl and Gluon) and linear_logp (tl and Gluon, which calls tl functions); it moves no bit, only which
program computes which tile when."""
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
