"""Weight sync refuses stale/skipped versions and corrupted bytes, and never half-applies."""
import pytest
import torch

from helpers import make_actor, make_engine
from lockstep.framework.rollout.base import SamplingParams
from lockstep.framework.weights.sync import WeightChecksumError, WeightPayload, WeightVersionError, checksum


def _engine_weights(engine):
    return {k: v.clone() for k, v in engine.model.hf_state_dict().items()}


def test_versions_must_advance_by_one():
    actor, engine = make_actor(), make_engine()
    with pytest.raises(RuntimeError, match="before the first weight sync"):
        engine.generate([[1, 3]], SamplingParams(), [[1, 2]])
    engine.update_weights(actor.weights_for_sync())  # version 0
    assert engine.version == 0
    with pytest.raises(WeightVersionError, match="holds version 0, payload has version 0"):
        engine.update_weights(actor.weights_for_sync())  # repeated
    skipped = WeightPayload.pack(actor.model.hf_state_dict().items(), version=2)
    with pytest.raises(WeightVersionError, match="expected 1"):
        engine.update_weights(skipped)
    engine.update_weights(WeightPayload.pack(actor.model.hf_state_dict().items(), version=1))
    assert engine.version == 1


def test_corrupted_payload_is_refused_before_loading():
    actor, engine = make_actor(), make_engine()
    engine.update_weights(actor.weights_for_sync())
    before = _engine_weights(engine)
    with torch.no_grad():
        for p in actor.model.parameters():
            p.add_(0.01)
    payload = WeightPayload.pack(actor.model.hf_state_dict().items(), version=1)
    name = "model.layers.0.mlp.up_proj.weight"
    payload.tensors[name].view(-1)[3] += 1e-6  # one flipped value in transit
    with pytest.raises(WeightChecksumError, match="corrupted in transit"):
        engine.update_weights(payload)
    assert engine.version == 0
    after = _engine_weights(engine)
    assert all(torch.equal(before[k], after[k]) for k in before), "refused payload touched the weights"


def test_checksum_covers_names_dtypes_and_shapes():
    t = torch.arange(6, dtype=torch.float32)
    base = checksum([("a", t)])
    assert checksum([("b", t)]) != base
    assert checksum([("a", t.double())]) != base
    assert checksum([("a", t.view(2, 3))]) != base
    assert checksum([("a", t.clone())]) == base


def test_synced_engine_matches_actor_bitwise():
    actor, engine = make_actor(), make_engine()
    engine.update_weights(actor.weights_for_sync())
    a, e = actor.model.hf_state_dict(), engine.model.hf_state_dict()
    assert a.keys() == e.keys() and all(torch.equal(a[k], e[k]) for k in a)
