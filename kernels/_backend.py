"""Which implementation of the lockstep ops runs: `torch` (reference) or `triton`.

Both sides of a run (trainer and rollout) must use the same backend, so the choice is global per
process and logged by the readbacks. Default: Triton on CUDA, the torch reference elsewhere;
`LOCKSTEP_KERNEL_BACKEND=triton|torch` or `set_backend(...)` overrides it. On a CPU, the Triton
backend runs only under Triton's interpreter (TRITON_INTERPRET=1), which is how CI tests it.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

BACKENDS = ("torch", "triton")
_ENV = "LOCKSTEP_KERNEL_BACKEND"
_backend: str | None = None


def triton_unavailable_reason() -> str | None:
    """None when the Triton backend can run here, else why it cannot."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e}); pip install lockstep-rl[triton]"
    import torch

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA device (set TRITON_INTERPRET=1 to run the Triton kernels in the interpreter)"
    try:
        import lockstep.kernels._triton  # noqa: F401
    except ImportError as e:
        return f"lockstep's Triton kernels failed to import ({e})"
    return None


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown lockstep kernel backend {name!r}; valid: {', '.join(BACKENDS)}")
    if name == "triton":
        reason = triton_unavailable_reason()
        if reason:
            raise RuntimeError(f"lockstep kernel backend 'triton' is unavailable: {reason}; available: torch")
    return name


def default_backend() -> str:
    env = os.environ.get(_ENV)
    if env:
        return _check(env.strip().lower())
    import torch

    return "triton" if torch.cuda.is_available() and triton_unavailable_reason() is None else "torch"


def get_backend() -> str:
    global _backend
    if _backend is None:
        _backend = default_backend()
    return _backend


def set_backend(name: str) -> None:
    global _backend
    _backend = _check(name.strip().lower())


@contextmanager
def using_backend(name: str):
    """Run a block with `name` as the backend, restoring the previous one afterwards."""
    before = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(before)
