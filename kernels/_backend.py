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
        _select(default_backend())
    return _backend


def set_backend(name: str) -> None:
    _select(_check(name.strip().lower()))


def _select(name: str) -> None:
    global _backend
    _backend = name
    if name == "triton":  # resolved now, never inside a torch.compile trace (imports do not trace)
        for op in KernelOp.registry.values():
            op.resolve_triton()


@contextmanager
def using_backend(name: str):
    """Run a block with `name` as the backend, restoring the previous one afterwards."""
    before = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(before)


class KernelOp:
    """One lockstep op, the one place where a backend is picked for it.

    - `reference`: the torch implementation (any device; what `torch` runs);
    - `triton`: "module:function" under lockstep.kernels._triton, imported on first use (None: the
      reference serves both backends);
    - `fake`: the output's shape for symbolic tracing. With one, the reference is also registered as
      the custom op `lockstep::ref_<name>` (forward only), which is what a torch.compile trace records
      in its place: Dynamo/Inductor keep the op opaque, so a compiled graph (vLLM's) runs the same
      arithmetic as eager code instead of a re-generated fusion of it. Eager calls go straight to the
      reference (so autograd works through it). The Triton functions are custom ops already.
    `calls` counts the calls per process (a torch.compile trace counts once, when it is traced: a
    compiled graph replays without Python): the readbacks report it as the evidence of which
    lockstep kernels ran.
    """

    registry: dict[str, "KernelOp"] = {}

    def __init__(self, name: str, reference, triton: str | None = None, fake=None):
        if name in KernelOp.registry:
            raise ValueError(f"lockstep kernel op {name!r} is defined twice")
        self.name, self.reference, self.triton = name, reference, triton
        self.calls = 0
        self._triton_fn = None
        self._opaque = None
        if _backend == "triton":
            self.resolve_triton()
        if fake is not None:
            import torch

            self._opaque = torch.library.custom_op(f"lockstep::ref_{name}", reference, mutates_args=())
            self._opaque.register_fake(fake)
        KernelOp.registry[name] = self

    def resolve_triton(self) -> None:
        if self.triton is not None and self._triton_fn is None:
            import importlib

            module, fn = self.triton.split(":")
            self._triton_fn = getattr(importlib.import_module(f"lockstep.kernels._triton.{module}"), fn)

    def implementation(self):
        """The function this op calls now (for the current backend and trace state)."""
        import torch

        if self.triton is not None and get_backend() == "triton":
            return self._triton_fn
        if self._opaque is not None and torch.compiler.is_compiling():
            return self._opaque
        return self.reference

    def __call__(self, *args, **kwargs):
        self.calls += 1  # inside a trace: counted once, when traced (a compiled graph runs no Python)
        return self.implementation()(*args, **kwargs)


_checks_skipped = 0  # depth of `skipping_value_checks` blocks


def value_checks_enabled() -> bool:
    """Whether an op may check values that live on the device (a host sync): never inside a
    torch.compile trace or a CUDA-graph capture, where a sync is an error or breaks the graph, nor
    inside `skipping_value_checks`. Shape checks always run; LOCKSTEP_VALUE_CHECKS=0 turns the
    value checks off everywhere."""
    import torch

    if _checks_skipped or os.environ.get("LOCKSTEP_VALUE_CHECKS", "1") == "0" or torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


@contextmanager
def skipping_value_checks():
    """A block whose inputs are known to be in range (a rollout engine's own sampled ids): its ops
    skip the checks that would stop the host until the device catches up, once per decode step."""
    global _checks_skipped
    _checks_skipped += 1
    try:
        yield
    finally:
        _checks_skipped -= 1


def kernel_calls() -> dict[str, int]:
    """Calls of every lockstep kernel op in this process so far (a compiled graph's: once, at its trace)."""
    return {name: op.calls for name, op in sorted(KernelOp.registry.items())}
