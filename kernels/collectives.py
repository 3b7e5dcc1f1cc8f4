"""Deterministic tensor-parallel reductions: one balanced tree over an ordered list of partials.

NCCL's all-reduce chunks a message and its reduction order changes with message size, ring/tree
choice and channel count, so the same partial sums can add up to different bits. lockstep's TP
reductions (kernels/rowlinear.py, kernels/logp.py) instead gather every rank's partial in rank order
and add them in one balanced tree, ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)): the order
depends on nothing but the number of parts, and 1/2/4/8 parts are nested subtrees of the same tree.
"""
from __future__ import annotations

import torch


def tree_sum_ranks(parts: list[torch.Tensor]) -> torch.Tensor:
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]
