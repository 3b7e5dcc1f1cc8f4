"""Small builders shared by tests (real classes, tiny shapes)."""
import os

import pytest


def optional(module: str, reason: str | None = None) -> None:
    """Skip when an optional extra is not installed, except where LOCKSTEP_REQUIRE_OPTIONAL is set
    (CI): there a missing install fails."""
    if not os.environ.get("LOCKSTEP_REQUIRE_OPTIONAL"):
        pytest.importorskip(module, reason=reason)


TINY = dict(vocab_size=16)
REAL_VOCAB = 15
OPTIM = dict(lr=1e-3, betas=[0.9, 0.99], eps=1e-8, weight_decay=0.0, warmup_steps=0, grad_clip=1.0)
PROVIDER = "lockstep.kernels.provider:linear_logp_provider"
WEIGHTS = dict(bucket_mb=512, transport="object_store")


def determinism(mode="strict", case="R/R", attention=1, ffn=1, logp=1, fault="none", provider=PROVIDER):
    return dict(mode=mode, case=case, attention=attention, ffn=ffn, logp=logp, provider=provider,
                on_mismatch="auto", inject_fault=fault)


def make_actor(mode="strict", seed=0, weights_bucket_mb=WEIGHTS["bucket_mb"], **algo):
    from lockstep.framework.actor.native import NativeActor  # here: the kernels' tests need only torch and triton

    return NativeActor(TINY, determinism=determinism(mode), real_vocab_size=REAL_VOCAB, optim=OPTIM, algo=algo, seed=seed,
                       weights={**WEIGHTS, "bucket_mb": weights_bucket_mb})


def sync(actor, *engines) -> dict:
    """A weight sync between objects of this process (the driver does it between Ray actors)."""
    from lockstep.framework.weights.sync import sync_weights

    return sync_weights(actor, lambda bucket: [e.receive_bucket(bucket) for e in engines])


class Corrupting:
    """An actor whose bucket `index` of pass `phase` has one bit flipped after its checksum was
    stamped (corruption in transit; object-store transport)."""

    def __init__(self, actor, index, phase="verify"):
        self.actor, self.index, self.phase = actor, index, phase

    def __getattr__(self, name):
        return getattr(self.actor, name)

    def sync_bucket(self, phase, index):
        bucket = self.actor.sync_bucket(phase, index)
        if (phase, index) == (self.phase, self.index):
            data = bytearray(bucket.payload["data"])
            data[40] ^= 1
            bucket.payload = {**bucket.payload, "data": bytes(data)}
        return bucket


def make_engine(mode="strict", fault="none"):
    from lockstep.framework.rollout.native import NativeRolloutEngine

    return NativeRolloutEngine(TINY, determinism=determinism(mode, fault=fault), real_vocab_size=REAL_VOCAB,
                               eos_ids=[2], pad_id=0)


def fixed_order_interpreter_dot() -> None:
    """Triton's interpreter computes `tl.dot` with numpy's BLAS, whose K-summation order depends on
    the matrix shape on some CPUs (seen with OpenBLAS 0.3.30's Haswell kernels on an AMD EPYC):
    a tile of 16 rows and one of 64 then round the same row differently, which is a property of
    that BLAS, not of the kernel under test (a GPU's MMA fixes the order per element). Here every
    float dot accumulates its K products in ascending k, as the hardware does, on every CPU."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    # (processes spawned by a test call this too: they do not run conftest.py)
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype not in (np.float32, np.float64) or b.data.dtype != a.data.dtype:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc_dtype = d.data.dtype
        x, y = a.data.astype(acc_dtype), b.data.astype(acc_dtype)
        out = np.zeros(x.shape[:-1] + y.shape[-1:], dtype=acc_dtype)
        for k in range(x.shape[-1]):
            out += x[..., :, k:k + 1] * y[..., k:k + 1, :]
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


def assert_draws_follow_reported(engine, prompt: list[int], sampling, seeds: list[int]) -> None:
    """One token drawn once per seed after one prompt: the drawn tokens' counts follow the
    probabilities the engine reports for them (Pearson's chi-square under its mean plus six standard
    deviations), and the same counts reject those probabilities bent as a sampler would draw them
    that applied the temperature twice or not at all (the check's power on this model). Every draw
    of one token reports the same logprob bits (one position of one prompt is one batch-invariant
    row). The seeds fix the draws, so a pass or a fail repeats."""
    import math
    from collections import defaultdict

    from lockstep.framework.rollout.base import SamplingParams

    params = SamplingParams(sampling.temperature, sampling.top_p, sampling.top_k, 1)
    r = engine.generate([prompt], params, [seeds])
    drawn = defaultdict(list)
    for tok, lp in zip(r.tokens[:, int(r.prompt_lens[0])].tolist(), r.logp[:, 0].tolist()):
        drawn[tok].append(lp)
    assert all(len(set(lps)) == 1 for lps in drawn.values()), "one token's draws reported different logprobs"
    n, counts = len(seeds), {t: len(lps) for t, lps in drawn.items()}
    p = {t: math.exp(lps[0]) for t, lps in drawn.items()}
    assert sum(p.values()) > 0.99, f"tokens never drawn hold {1 - sum(p.values()):.3f} of the reported mass: draw more"

    def chi2(q):
        s = sum(q.values())
        return sum((counts[t] - n * q[t] / s) ** 2 / (n * q[t] / s) for t in q)

    dof = len(p) - 1
    bound = dof + 6 * math.sqrt(2 * dof)
    assert chi2(p) < bound, f"drawn tokens do not follow the reported logprobs: chi-square {chi2(p):.1f} >= {bound:.1f}"
    bent = {name: chi2({t: v ** e for t, v in p.items()})
            for name, e in (("temperature twice", 1 / sampling.temperature), ("no temperature", sampling.temperature))}
    assert all(v > bound for v in bent.values()), f"the check cannot tell these samplers apart: {bent} (bound {bound:.1f})"
