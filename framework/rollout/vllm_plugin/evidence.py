"""The ProcessEvidence of this vLLM worker process: created by the model class, read by the
attention backend and the worker extension (one model per worker process)."""
from __future__ import annotations

from lockstep.framework.consistency.readback import ProcessEvidence

_evidence: ProcessEvidence | None = None


def set_evidence(evidence: ProcessEvidence) -> None:
    global _evidence
    _evidence = evidence


def get_evidence() -> ProcessEvidence:
    if _evidence is None:
        raise RuntimeError("the lockstep vLLM model has not been built in this process")
    return _evidence
