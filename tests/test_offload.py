"""Colocated offload: what the actor releases while the engines generate, and that it comes back bit
for bit. Runs on the CPU actor (the offload works on the actor's own device; CUDA storages go to
pinned host memory, CPU ones to plain host buffers)."""
import torch

from helpers import make_actor, make_engine, sync
from lockstep.framework.rollout.base import SamplingParams

PROMPTS = [[1, 3, 4, 5], [1, 6, 7], [1, 9, 10, 11, 12, 13]]


def _step(actor, engine, step):
    sync(actor, engine)
    ro = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=5),
                         [[step * 10 + i, step * 10 + i + 5] for i in range(len(PROMPTS))])
    lp = actor.compute_logp(ro)
    return actor.train(ro, (ro.response_lens % 2).float(), torch.arange(3).repeat_interleave(2), lp.logp)


def _state(actor):
    params = [p.detach().clone() for p in actor.model.parameters()]
    moments = [t.clone() for s in actor.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return params, moments


def test_offload_releases_optimizer_state_created_after_the_first_offload_and_restores_bits():
    actor, twin, engine, twin_engine = make_actor(), make_actor(), make_engine(), make_engine()
    # a colocated run offloads at its first weight sync, before the optimizer has any state
    first = actor.offload()
    assert not actor.optimizer.state and first["offloaded_gib"] > 0
    actor.reload()
    _step(actor, engine, 1), _step(twin, twin_engine, 1)
    params, moments = _state(actor)
    assert moments  # Adam's moments exist now
    second = actor.offload()
    assert second["offloaded_gib"] > first["offloaded_gib"] * 2.5  # params + grads + two moments
    held = [t for s in actor.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    held += [p for p in actor.model.parameters()] + [p.grad for p in actor.model.parameters() if p.grad is not None]
    kept = [t for t in held if t.untyped_storage().nbytes()]
    assert not kept, f"{len(kept)} of {len(held)} tensors still hold memory after offload"
    actor.reload()
    after = _state(actor)
    assert all(torch.equal(a, b) for a, b in zip(params + moments, after[0] + after[1]))
    # training goes on as if nothing happened: the same bits as an actor that never offloaded
    a, b = _step(actor, engine, 2), _step(twin, twin_engine, 2)
    assert a == b
    assert all(torch.equal(p, q) for p, q in zip(actor.model.parameters(), twin.model.parameters()))
