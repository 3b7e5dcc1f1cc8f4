"""The rollout ops of this vLLM worker process: built by the model class, used by the attention
backend (its paged-attention slot) and read back by the worker extension (one model per worker)."""
from __future__ import annotations

from lockstep.framework.models.ops import ModelOps

_ops: ModelOps | None = None
_rank = 0


def set_process_ops(ops: ModelOps, rank: int) -> None:
    global _ops, _rank
    _ops, _rank = ops, rank


def process_ops() -> tuple[ModelOps, int]:
    if _ops is None:
        raise RuntimeError("the lockstep vLLM model has not been built in this process")
    return _ops, _rank
