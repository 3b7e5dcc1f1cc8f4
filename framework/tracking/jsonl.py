"""One JSON object per line: every step's metrics, then the summary, in the run dir."""
from __future__ import annotations

import json
from pathlib import Path


class JsonlWriter:
    def __init__(self, path: Path):
        self.path = path
        self._f = path.open("a")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, default=float) + "\n")
        self._f.flush()  # a crash must not lose the steps already run

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def computed(row: dict) -> dict:
    """A metrics row without what depends on the machine's speed (timings, throughput): what the
    step computed, which a resumed run must reproduce bit for bit."""
    return {k: v for k, v in row.items() if not k.startswith("perf/") and k != "rollout/tok_per_s_per_gpu"}
