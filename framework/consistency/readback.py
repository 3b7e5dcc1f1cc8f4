"""Readbacks: each worker process writes what really ran in it, as JSON in <run_dir>/readbacks/.

Configuration says what should run; the readback says what did: the op bound to every module slot,
how often each was called, which provider backend/contract served the logprobs, and every fallback.
The run validator trusts only these files.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import lockstep.kernels as K
from lockstep.framework.models.ops import ModelOps, OpCounter, Selection, build_ops
from lockstep.framework.provider.route import RouteRecord

READBACK_DIR = "readbacks"


class ProcessEvidence:
    """The ops of one worker process, instrumented, and its readback."""

    def __init__(self, determinism: dict, side: str, backend: str, rank: int = 0, instance: int = 0):
        """rank: the process's rank within its engine/actor group; instance: which engine."""
        self.determinism, self.side, self.backend = dict(determinism), side, backend
        self.rank, self.instance = rank, instance
        self.selection = Selection.for_side(determinism, side)
        self.counter, self.record = OpCounter(), RouteRecord()
        self.ops: ModelOps = build_ops(self.selection, mode=determinism["mode"], provider=determinism["provider"],
                                       counter=self.counter, record=self.record)

    def readback(self) -> dict:
        route = self.record.as_dict()
        return {
            "framework": "lockstep", "backend": self.backend, "side": self.side, "instance": self.instance,
            "rank": self.rank,
            "pid": os.getpid(), "host": socket.gethostname(), "mode": self.determinism["mode"],
            "case": self.determinism.get("case"), "selection": self.selection.letters(),
            "kernel_backend": K.get_backend(),
            "installed_hooks": {k: v["impl"] for k, v in self.counter.as_dict().items()},
            "ops": self.counter.as_dict(), "logp_route": route,
            "fallbacks": [{"op": "logp.linear_logp", "reason": r, "count": n} for r, n in route["fallbacks"].items()],
        }

    def write(self, run_dir: str) -> str:
        return write_readback(run_dir, self.readback())


def write_readback(run_dir: str, readback: dict) -> str:
    out = Path(run_dir) / READBACK_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{readback['side']}-{readback['instance']}-rank{readback['rank']}.json"
    path.write_text(json.dumps(readback, indent=2))
    return str(path)


def load_readbacks(run_dir: str | Path) -> list[dict]:
    d = Path(run_dir) / READBACK_DIR
    return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.exists() else []
