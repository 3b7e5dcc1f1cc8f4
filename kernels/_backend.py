"""Which implementation of the lockstep ops runs: `torch` (reference) or `triton`.

Both sides of a run (trainer and rollout) must use the same backend, so the choice is global per
process and logged by the readbacks. Default: Triton on CUDA, the torch reference elsewhere;
`LOCKSTEP_KERNEL_BACKEND=triton|torch` or `set_backend(...)` overrides it.
"""
from __future__ import annotations

import os

BACKENDS = ("torch", "triton")
_ENV = "LOCKSTEP_KERNEL_BACKEND"
_backend: str | None = None


def _triton_unavailable_reason() -> str | None:
    """None when the Triton backend can run here, else why it cannot."""
    return "the Triton kernels are not part of this build yet (torch reference only)"


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown lockstep kernel backend {name!r}; valid: {', '.join(BACKENDS)}")
    if name == "triton":
        reason = _triton_unavailable_reason()
        if reason:
            raise RuntimeError(f"lockstep kernel backend 'triton' is unavailable: {reason}; "
                               f"available: torch")
    return name


def default_backend() -> str:
    env = os.environ.get(_ENV)
    if env:
        return _check(env.strip().lower())
    return "triton" if _triton_unavailable_reason() is None and _cuda_available() else "torch"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def get_backend() -> str:
    global _backend
    if _backend is None:
        _backend = default_backend()
    return _backend


def set_backend(name: str) -> None:
    global _backend
    _backend = _check(name.strip().lower())
