"""Small builders shared by tests (real classes, tiny shapes)."""
from lockstep.framework.actor.native import NativeActor
from lockstep.framework.rollout.native import NativeRolloutEngine

TINY = dict(vocab_size=16)
REAL_VOCAB = 15
OPTIM = dict(lr=1e-3, betas=[0.9, 0.99], eps=1e-8, weight_decay=0.0, warmup_steps=0, grad_clip=1.0)
PROVIDER = "lockstep.kernels.provider:linear_logp_provider"


def determinism(mode="strict", case="R/R", attention=1, ffn=1, logp=1, fault="none", provider=PROVIDER):
    return dict(mode=mode, case=case, attention=attention, ffn=ffn, logp=logp, provider=provider,
                on_mismatch="auto", inject_fault=fault)


def make_actor(mode="strict", seed=0, **algo):
    return NativeActor(TINY, determinism=determinism(mode), real_vocab_size=REAL_VOCAB, optim=OPTIM, algo=algo, seed=seed)


def make_engine(mode="strict", fault="none"):
    return NativeRolloutEngine(TINY, determinism=determinism(mode, fault=fault), real_vocab_size=REAL_VOCAB,
                               eos_id=2, pad_id=0)
