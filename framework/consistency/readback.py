"""Readbacks: each worker process writes what really ran in it, as JSON in <run_dir>/readbacks/.

Configuration says what should run; the readback says what did: the op bound to every module slot
and how often each was called (models/ops.py's counter), the lockstep kernels this process called
(lockstep.kernels.kernel_calls, counted in the kernels themselves, so an op that bypasses the
selection shows up too), which provider backend/contract served the logprobs, and every fallback.
The run validator trusts only these files.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import lockstep.kernels as K
from lockstep.framework.models.ops import ModelOps

READBACK_DIR = "readbacks"


def readback(ops: ModelOps, *, side: str, backend: str, rank: int = 0, instance: int = 0, extra: dict | None = None) -> dict:
    """rank: the process's rank within its engine/actor group; instance: which engine."""
    route = ops.record.as_dict()
    counts = ops.counter.as_dict()
    return {
        "framework": "lockstep", "backend": backend, "side": side, "instance": instance, "rank": rank,
        "pid": os.getpid(), "host": socket.gethostname(), "mode": ops.mode, "selection": ops.selection.letters(),
        "kernel_backend": K.get_backend(), "kernel_calls": K.kernel_calls(),
        "installed_hooks": {k: v["impl"] for k, v in counts.items()},
        "ops": counts, "logp_route": route,
        "fallbacks": [{"op": "logp.linear_logp", "reason": r, "count": n} for r, n in route["fallbacks"].items()],
        **(extra or {}),
    }


def write_readback(run_dir: str, rb: dict) -> str:
    out = Path(run_dir) / READBACK_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{rb['side']}-{rb['instance']}-rank{rb['rank']}.json"
    path.write_text(json.dumps(rb, indent=2))
    return str(path)


def load_readbacks(run_dir: str | Path) -> list[dict]:
    d = Path(run_dir) / READBACK_DIR
    return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.exists() else []
