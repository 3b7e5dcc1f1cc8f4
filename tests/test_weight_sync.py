"""Weight sync refuses stale/skipped versions and corrupted buckets, never half-applies, and streams
the model bucket by bucket (object-store transport: the CPU path)."""
import pytest
import torch

from helpers import Corrupting, make_actor, make_engine, sync
from lockstep.framework.rollout.base import SamplingParams
from lockstep.framework.weights.buckets import checksum, pack, plan_buckets, unpack
from lockstep.framework.weights.sync import (Bucket, WeightChecksumError, WeightSender, WeightSyncError,
                                             WeightVersionError, sync_weights)


def _engine_weights(engine):
    return {k: v.clone() for k, v in engine.model.hf_state_dict().items()}


def test_versions_must_advance_by_one():
    actor, engine = make_actor(), make_engine()
    with pytest.raises(RuntimeError, match="before the first weight sync"):
        engine.generate([[1, 3]], SamplingParams(), [[1, 2]])
    sync(actor, engine)  # version 0
    assert engine.version == 0
    with pytest.raises(WeightVersionError, match="holds version 0, bucket 1 of 1 .* has version 0"):
        sync(actor, engine)  # repeated
    actor.version = 2
    with pytest.raises(WeightVersionError, match="expected 1"):
        sync(actor, engine)  # skipped
    actor.version = 1
    sync(actor, engine)
    assert engine.version == 1


def test_a_load_needs_a_verified_update_first():
    actor, engine = make_actor(), make_engine()
    with pytest.raises(WeightSyncError, match="arrived to load before the update was verified"):
        engine.receive_bucket(actor.sync_bucket("load", 0))


@pytest.mark.parametrize("phase", ["verify", "load"])
def test_a_corrupted_bucket_is_refused_with_the_old_weights_intact(phase):
    actor = make_actor(weights_bucket_mb=0.01)  # several buckets for the tiny model
    engine = make_engine()
    sync(actor, engine)
    before = _engine_weights(engine)
    with torch.no_grad():
        for p in actor.model.parameters():
            p.add_(0.01)
    actor.version = 1
    assert actor.sync_plan() >= 3
    with pytest.raises(WeightChecksumError, match=r"bucket 2 of \d+ .*corrupted in transit.*keeps version 0"):
        sync(Corrupting(actor, 1, phase), engine)
    assert engine.version == 0
    after = _engine_weights(engine)
    if phase == "verify":  # the first pass refuses before anything is loaded
        assert all(torch.equal(before[k], after[k]) for k in before), "a refused update touched the weights"
        engine.generate([[1, 3]], SamplingParams(), [[1, 2]])
    else:  # a failure in the second pass: the engine refuses to generate with mixed weights
        with pytest.raises(WeightSyncError, match="sync again before generating"):
            engine.generate([[1, 3]], SamplingParams(), [[1, 2]])
    sync(actor, engine)  # the next clean update goes through
    assert engine.version == 1


def test_buckets_must_cover_every_weight():
    actor, engine = make_actor(), make_engine()
    sender = actor.sender
    bucket = sender.bucket(0, "verify", 0, lambda groups: [(n, t) for n, t in actor.model.hf_state_dict().items()
                                                            if "layers.1." not in n])
    with pytest.raises(WeightSyncError, match="lacks 11 weights of this engine: \\['model.layers.1"):
        engine.receive_bucket(bucket)


def test_checksum_covers_names_dtypes_shapes_and_order():
    t = torch.arange(6, dtype=torch.float32)
    base = checksum([("a", t)])
    assert checksum([("b", t)]) != base
    assert checksum([("a", t.double())]) != base
    assert checksum([("a", t.view(2, 3))]) != base
    assert checksum([("a", t.clone())]) == base
    u = t.clone()
    u[5] = torch.nextafter(u[5], torch.tensor(10.0))  # one ulp
    assert checksum([("a", u)]) != base
    assert checksum([("a", t), ("b", u)]) != checksum([("a", u), ("b", t)])


def test_buckets_pack_whole_groups_and_unpack_to_the_same_bits():
    named = [("x", torch.randn(37).bfloat16()), ("y", torch.arange(5)), ("z", torch.randn(3, 4))]
    flat, layout = pack(named)
    assert flat.dtype == torch.uint8 and all(off % 16 == 0 for off in layout.offsets)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(named, unpack(flat, layout)))
    assert plan_buckets([10, 5, 7, 20, 1], 12) == [[0], [1, 2], [3], [4]]


def test_sync_streams_and_times_every_phase():
    actor = make_actor(weights_bucket_mb=0.01)
    engine = make_engine()
    timings = sync(actor, engine)
    assert timings["buckets"] == actor.sync_plan() >= 3
    for phase in ("verify", "load"):
        for part in ("send_gather", "send_pack", "send_checksum", "open", "verify", "total"):
            assert f"{phase}_{part}_s" in timings
    assert timings["load_post_load_checked"] == timings["buckets"]  # every bucket checked after its load
    a, e = actor.model.hf_state_dict(), engine.model.hf_state_dict()
    assert a.keys() == e.keys() and all(torch.equal(a[k], e[k]) for k in a)


def test_the_sender_reuses_one_buffer():
    sender = WeightSender([100, 100, 100], 150, "object_store")
    tensors = [torch.randn(25) for _ in range(3)]
    first = sender.bucket(0, "verify", 0, lambda gs: [(f"t{g}", tensors[g]) for g in gs])
    buf = sender._buffer
    sender.bucket(0, "verify", 1, lambda gs: [(f"t{g}", tensors[g]) for g in gs])
    assert sender._buffer is buf and isinstance(first, Bucket) and first.count == 3
    assert sender.bucket(0, "verify", 2, lambda gs: [], emit=False) is None  # a helping rank
