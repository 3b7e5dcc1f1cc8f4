"""Weight sync from the actor to the rollout engines: versioned, checksummed buckets, streamed.

Ordering rules (each enforced by a check, never assumed):
1. The actor stamps every bucket with its policy version; an engine accepts only the version right
   after the one it holds, so a stale, repeated or skipped update is refused rather than silently
   generating with the wrong weights; an engine that holds none yet takes the first version it is
   sent (0, or the step of the checkpoint a resumed run loaded).
2. A sync streams the model twice, bucket by bucket (models/qwen3.py `hf_groups`: the embeddings and
   norms, then one group per layer; `weights.bucket_mb` per bucket), each bucket gathered from the
   trainer's shards only when it is sent, never the whole model at once:
   - verify: every engine checks each bucket's checksum against the bytes it received and that
     the buckets cover every weight it holds, loading nothing; one bad bucket refuses the update
     (naming the bucket) with the old weights intact;
   - load: the same buckets again, each verified again, loaded into the engine's own parameters
     in place (vLLM's fused ones included), then checksummed once more from the engine's
     parameters (a load that converted or dropped a tensor is caught). The version advances after
     the last bucket.
3. Checksums are computed on the device that holds the bytes (weights/buckets.py): at send on the
   trainer's, at receipt and after load on the engine's.
4. A bucket's buffer stays alive on the trainer until every engine has answered for it; the next
   bucket reuses it (no allocation, no empty_cache in the loop).
5. Rollouts carry the version they were generated with; the driver refuses to score a rollout
   against an actor whose version differs.
Timings are emitted per phase and part (`perf/weight_<phase>_<part>_s`): gather, pack, checksum and
export on the trainer; open, verify, load and post_verify on the engine (the slowest engine).
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from lockstep.framework.weights.buckets import BucketLayout, checksum, pack, plan_buckets, unpack
from lockstep.framework.weights.transport import export, open_payload

PHASES = ("verify", "load")


class WeightSyncError(RuntimeError):
    pass


class WeightVersionError(WeightSyncError):
    pass


class WeightChecksumError(WeightSyncError):
    pass


@dataclass
class Bucket:
    version: int
    phase: str  # verify | load
    index: int
    count: int
    layout: BucketLayout
    checksum: str
    payload: dict  # weights/transport.py
    timings: dict = field(default_factory=dict)

    def describe(self) -> str:
        names = self.layout.names
        return f"bucket {self.index + 1} of {self.count} ({len(names)} tensors, {names[0]} .. {names[-1]})"

    def as_message(self) -> dict:
        """Plain types only (for vLLM's collective_rpc)."""
        return asdict(self)

    @classmethod
    def from_message(cls, m: dict) -> "Bucket":
        lay = m["layout"]
        layout = BucketLayout(tuple(lay["names"]), tuple(lay["dtypes"]), tuple(tuple(s) for s in lay["shapes"]),
                              tuple(lay["offsets"]), lay["nbytes"])
        return cls(**{**m, "layout": layout})


class WeightSender:
    """The trainer side: cuts the model into buckets from shapes alone (so every rank of a sharded
    trainer cuts the same ones) and packs, checksums and exports bucket `index` on request."""

    def __init__(self, group_bytes: list[int], bucket_bytes: int, transport: str):
        self.plan = plan_buckets(group_bytes, bucket_bytes)
        self.transport = transport
        self._buffer: torch.Tensor | None = None

    def bucket(self, version: int, phase: str, index: int,
               gather: Callable[[list[int]], list[tuple[str, torch.Tensor]]], emit: bool = True) -> Bucket | None:
        """gather(groups): the HF-named tensors of those groups (every rank of the trainer calls it:
        it may run collectives); only the emitting rank packs and returns the bucket."""
        t0 = time.perf_counter()
        named = gather(self.plan[index])
        t1 = time.perf_counter()
        if not emit:
            return None
        flat, layout = pack(named, self._buffer)
        if self._buffer is None or self._buffer.numel() < flat.numel():
            self._buffer = flat
        t2 = time.perf_counter()
        digest = checksum(unpack(flat, layout))  # of what travels, so a packing bug is caught too
        t3 = time.perf_counter()
        payload = export(flat, self.transport)
        t4 = time.perf_counter()
        return Bucket(version, phase, index, len(self.plan), layout, digest, payload,
                      {"gather": t1 - t0, "pack": t2 - t1, "checksum": t3 - t2, "export": t4 - t3})

    def release(self) -> None:
        self._buffer = None  # back to the caching allocator, once the engines are done with it


class WeightReceiver:
    """The engine side's bookkeeping for one engine: the version rule and the two passes.

    load(named): copies HF-named tensors into the engine's parameters; loaded(names): the engine's
    parameters under those HF names, for the post-load checksum (None where the engine cannot show
    them, e.g. weights vLLM's CPU build packed away: then that check is skipped and reported)."""

    def __init__(self, expected_names: list[str], version: int = -1):
        self.expected = set(expected_names)
        self.version = version
        self.consistent = True  # False from the first loaded bucket of an update until its last
        self._seen: set[str] = set()
        self._verified_version: int | None = None

    def check_ready(self) -> None:
        """Generating needs a whole update: refuse weights that are half one version, half the next."""
        if self.version < 0:
            raise RuntimeError("generate called before the first weight sync")
        if not self.consistent:
            raise WeightSyncError(f"the engine's weights are partly version {self.version} and partly the next: a "
                                  f"weight update failed in its load pass; sync again before generating")

    def receive(self, bucket: Bucket, load: Callable, loaded: Callable, device=None) -> dict:
        # an engine that holds no weights yet takes the actor's version (0, or a resumed run's step);
        # after that, each update is the next version
        if self.version >= 0 and bucket.version != self.version + 1 or bucket.version < 0:
            raise WeightVersionError(f"weight update refused: engine holds version {self.version}, "
                                     f"{bucket.describe()} has version {bucket.version} (expected {self.version + 1})")
        if bucket.phase == "load" and self._verified_version != bucket.version:
            raise WeightSyncError(f"weight update version {bucket.version}: {bucket.describe()} arrived to load "
                                  f"before the update was verified")
        t0 = time.perf_counter()
        flat = open_payload(bucket.payload, device)
        named = unpack(flat, bucket.layout)
        t1 = time.perf_counter()
        actual = checksum(named)
        t2 = time.perf_counter()
        if actual != bucket.checksum:
            self._seen.clear()
            raise WeightChecksumError(f"weight update refused: version {bucket.version}, {bucket.describe()}: "
                                      f"checksum {actual} != stamped {bucket.checksum} (corrupted in transit); "
                                      f"the engine keeps version {self.version}")
        timings = {"open": t1 - t0, "verify": t2 - t1, **{f"send_{k}": v for k, v in bucket.timings.items()}}
        if bucket.phase == "verify":
            unknown = [n for n in bucket.layout.names if n not in self.expected]
            if unknown:
                raise WeightSyncError(f"weight update refused: {bucket.describe()} holds weights this engine does not "
                                      f"have: {unknown[:5]}")
            self._seen.update(bucket.layout.names)
            if bucket.index == bucket.count - 1:
                missing = sorted(self.expected - self._seen)
                self._seen.clear()
                if missing:
                    raise WeightSyncError(f"weight update refused: version {bucket.version} lacks {len(missing)} "
                                          f"weights of this engine: {missing[:5]}")
                self._verified_version = bucket.version
            return timings
        self.consistent = False
        load(named)
        t3 = time.perf_counter()
        after = loaded(list(bucket.layout.names))
        checked = after is not None
        if checked and checksum(after) != bucket.checksum:
            raise WeightChecksumError(f"weights after loading {bucket.describe()} of version {bucket.version} do not "
                                      f"hash to {bucket.checksum}: the engine's load changed them")
        if flat.is_cuda:  # the sender reuses the buffer for its next bucket once we answer
            torch.cuda.synchronize(flat.device)
        timings.update(load=t3 - t2, post_verify=time.perf_counter() - t3, post_load_checked=float(checked))
        if bucket.index == bucket.count - 1:
            self.version, self._verified_version, self.consistent = bucket.version, None, True
        return timings


def sync_weights(actor, receive: Callable[[object], list[dict]]) -> dict[str, float]:
    """One weight sync: both phases, every bucket. `actor` offers sync_plan(), sync_bucket(phase,
    index) and sync_done() (an ActorGroup, or an actor itself in tests); receive(bucket) hands one
    bucket to every engine and returns their timings."""
    totals: dict[str, float] = defaultdict(float)
    count = actor.sync_plan()
    try:
        for phase in PHASES:
            for index in range(count):
                t0 = time.perf_counter()
                bucket = actor.sync_bucket(phase, index)
                totals[f"{phase}_send_s"] += time.perf_counter() - t0
                answers = receive(bucket)
                for part in {k for a in answers for k in a}:  # the slowest engine bounds each part
                    key = f"{phase}_{part}" + ("" if part == "post_load_checked" else "_s")
                    totals[key] += max(a.get(part, 0.0) for a in answers)
                totals[f"{phase}_total_s"] += time.perf_counter() - t0
    finally:
        actor.sync_done()
    totals["buckets"] = count
    return dict(totals)
