"""Micro-batching in training: actor.max_tokens_per_gpu, not the batch, bounds the activations
alive at once (one backward per micro-batch, gradients accumulating), and the accumulated step is
the one-backward step (same loss, gradient norm and updated weights up to float reassociation).
Sequence packing (actor.pack_sequences): the same logprobs and losses as padded rows, bit for bit."""
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from lockstep.framework.actor.logp import micro_batches
from lockstep.framework.actor.native import NativeActor
from lockstep.framework.rollout.base import Rollout, SamplingParams

from helpers import OPTIM, PROVIDER, REAL_VOCAB, TINY, WEIGHTS, determinism, optional

PROMPT, RESPONSE = 4, 8
# Adam's first update is lr * g / (|g| + eps): a gradient entry near eps moves by a few % of lr
# when summed in another order; 2% of the lr (1e-3) in absolute terms
ADAM_ATOL = 2e-5


def test_micro_batches_respect_the_token_budget():
    assert micro_batches([5, 5, 5, 5], 10) == [[0, 1], [2, 3]]
    assert micro_batches([3, 9, 2], 10) == [[0], [1], [2]]
    assert micro_batches([30, 2], 10) == [[0], [1]]  # an oversize sample travels alone
    assert sum(micro_batches([4] * 9, 12), []) == list(range(9))
    # packed: the lengths' sum fits, not count x longest
    assert micro_batches([9, 1, 1, 1], 12, packed=True) == [[0, 1, 2, 3]]
    assert micro_batches([9, 1, 1, 1], 12) == [[0], [1, 2, 3]]


def rollout(batch: int, seed: int = 0) -> Rollout:
    """A batch of `batch` samples of PROMPT + RESPONSE tokens (responses of varied lengths), with
    made-up rollout logprobs near the policy's."""
    g = torch.Generator().manual_seed(seed)
    resp = torch.randint(RESPONSE // 2, RESPONSE + 1, (batch,), generator=g)
    logp = -torch.rand(batch, RESPONSE, generator=g) * 3 * (torch.arange(RESPONSE)[None] < resp[:, None])
    return Rollout(tokens=torch.randint(3, REAL_VOCAB, (batch, PROMPT + RESPONSE), generator=g),
                   prompt_lens=torch.full((batch,), PROMPT), response_lens=resp, logp=logp, support_ids=None,
                   finished=torch.zeros(batch, dtype=torch.bool), weights_version=0, sampling=SamplingParams())


def actor(max_tokens, pack=False, mode="strict"):
    return NativeActor(TINY, determinism=determinism(mode), real_vocab_size=REAL_VOCAB, optim=OPTIM, algo={}, seed=0,
                       weights=WEIGHTS, max_tokens_per_gpu=max_tokens, pack_sequences=pack)


def train(a, ro):
    rewards = torch.arange(ro.batch_size).remainder(3).float()
    return a.train(ro, rewards, torch.arange(ro.batch_size) // 4, ro.logp)


def peak_saved_bytes(fn) -> int:
    """The most bytes autograd held saved for backward at any moment while fn ran."""
    live = {"now": 0, "peak": 0}

    class Held:
        def __init__(self, t):
            self.t, self.n = t, t.numel() * t.element_size()
            live["now"] += self.n
            live["peak"] = max(live["peak"], live["now"])

        def __del__(self):
            live["now"] -= self.n

    with torch.autograd.graph.saved_tensors_hooks(Held, lambda h: h.t):
        fn()
    return live["peak"]


def test_activations_follow_the_token_budget_not_the_batch():
    peak = {(b, m): peak_saved_bytes(lambda: train(actor(m), rollout(b))) for b in (8, 32) for m in (24, 96)}
    # the batch grows 4x: what is alive at once stays (within the micro-batches' padding)
    for m in (24, 96):
        assert peak[(32, m)] < 1.25 * peak[(8, m)], peak
    # the budget grows 4x: so do the activations
    assert peak[(32, 96)] > 2.5 * peak[(32, 24)], peak
    # negative control: with the whole batch in one micro-batch, they follow the batch
    whole = {b: peak_saved_bytes(lambda: train(actor(None), rollout(b))) for b in (8, 32)}
    assert whole[32] > 3 * whole[8], whole


def test_accumulated_step_is_the_one_backward_step():
    ro = rollout(16, seed=1)
    parts, whole = actor(24), actor(None)
    a, b = train(parts, ro), train(whole, ro)
    for k in ("loss", "pg_loss", "grad_norm", "clipfrac", "ratio_mean", "entropy"):
        assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k
    for (name, p), q in zip(parts.model.named_parameters(), whole.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=ADAM_ATOL, msg=name)
    # and one model's micro-batched logprobs are its one-forward logprobs, bit for bit
    ro1 = Rollout(**{**vars(ro), "weights_version": 1})
    micro = parts.compute_logp(ro1).logp
    parts.max_tokens = None
    assert torch.equal(micro, parts.compute_logp(ro1).logp)


def test_packed_sequences_give_the_padded_bits():
    ro = rollout(16, seed=2)
    # one micro-batch each (the partition decides how loss shares are summed); packed into one row
    padded, packed = actor(None), actor(None, pack=True)
    lp = padded.compute_logp(ro).logp
    assert torch.equal(packed.compute_logp(ro).logp, lp)
    assert torch.equal(actor(24, pack=True).compute_logp(ro).logp, lp)  # packed micro-batches of <= 24 tokens
    kinds = {k: v["calls"] for k, v in packed.ops.counter.as_dict().items() if "attention.attention" in k or "varlen" in k}
    assert kinds["attention.varlen_attention"] > 0 and kinds["attention.attention"] == 0, kinds
    a, b = train(padded, ro), train(packed, ro)
    for k in ("loss", "pg_loss", "ratio_mean", "entropy", "tis_ratio_mean"):
        assert a[k] == b[k], k  # the loss of the same logprobs, summed in the same [B, R] layout
    for p, q in zip(padded.model.parameters(), packed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=ADAM_ATOL)
    # determinism off: the stock ops pack too (torch's SDPA one sequence at a time), to float accuracy
    stock = actor(None, pack=True, mode="off").compute_logp(ro).logp
    torch.testing.assert_close(stock, actor(None, mode="off").compute_logp(ro).logp, rtol=1e-4, atol=1e-5)


# ---- the megatron actor (gloo, one rank) ---------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _megatron_step(rank, port, max_tokens, pack, out):
    from lockstep.framework.actor.megatron.worker import MegatronActor

    det = dict(determinism(), provider=PROVIDER)
    a = MegatronActor(TINY, determinism=det, real_vocab_size=REAL_VOCAB, optim=OPTIM, algo={"kl_coef": 0.01}, seed=0,
                      parallel=dict(device="cpu", tp=1, cp=1, pp=1, dp=1), rank=0, world_size=1,
                      max_tokens_per_gpu=max_tokens, weights=WEIGHTS, pack_sequences=pack)
    a.setup("127.0.0.1", port)
    ro = rollout(16, seed=1)
    logp = a.compute_logp(ro).logp
    stats = train(a, ro)
    torch.save({"stats": stats, "logp": logp, "params": [p.detach().float().clone() for p in a.model.parameters()],
                "calls": a.ops.counter.as_dict()}, os.path.join(out, f"{max_tokens}-{pack}.pt"))


def test_megatron_accumulated_and_packed_steps_are_the_one_backward_step(tmp_path):
    optional("megatron.core")
    for m, pack in ((24, False), (10_000, False), (10_000, True)):
        mp.spawn(_megatron_step, args=(_free_port(), m, pack, str(tmp_path)), nprocs=1, join=True)
    a, b, packed = (torch.load(tmp_path / f) for f in ("24-False.pt", "10000-False.pt", "10000-True.pt"))
    for k in ("loss", "pg_loss", "kl_loss", "grad_norm", "ratio_mean", "entropy"):
        assert a["stats"][k] == pytest.approx(b["stats"][k], rel=1e-5, abs=1e-7), k
    for p, q in zip(a["params"], b["params"]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=ADAM_ATOL)
    # packed: the padded logprobs and losses bit for bit, through megatron's layer and varlen attention
    assert packed["calls"]["attention.varlen_attention"]["calls"] > 0
    assert packed["calls"]["attention.attention"]["calls"] == 0
    assert torch.equal(packed["logp"], a["logp"]) and torch.equal(packed["logp"], b["logp"])
    for k in ("loss", "pg_loss", "kl_loss", "ratio_mean", "entropy"):
        assert packed["stats"][k] == b["stats"][k], k  # one micro-batch each: the same sums
    for p, q in zip(packed["params"], b["params"]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=ADAM_ATOL)
