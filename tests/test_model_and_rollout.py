"""The Qwen3 definition and the native engine: checkpoints, cache vs teacher forcing, sampling."""
import torch

from helpers import REAL_VOCAB, make_actor, make_engine, sync
from lockstep.framework.models.ops import ALL_P, ALL_R, build_ops
from lockstep.framework.models.qwen3 import KVCache, Qwen3Config, Qwen3ForCausalLM
from lockstep.framework.rollout.base import SamplingParams
from lockstep.framework.rollout.sampling import sample_seed

LOCKSTEP_OPS, PRODUCTION_OPS = build_ops(ALL_R), build_ops(ALL_P)
PROMPTS = [[1, 3, 4, 5], [1, 6, 7], [1, 9, 10, 11, 12, 13]]


def _model(ops, tied=True):
    m = Qwen3ForCausalLM(Qwen3Config(vocab_size=16, tie_word_embeddings=tied), ops)
    m.init_weights(0)
    return m


def test_safetensors_round_trip(tmp_path):
    for tied in (True, False):
        m = _model(LOCKSTEP_OPS, tied)
        m.save_pretrained(tmp_path / str(tied))
        back = Qwen3ForCausalLM.from_pretrained(tmp_path / str(tied), LOCKSTEP_OPS)
        a, b = m.hf_state_dict(), back.hf_state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert ("lm_head.weight" in a) == (not tied)
        assert "model.layers.1.self_attn.q_norm.weight" in a  # HF names


def _cached_vs_forced(ops):
    m = _model(ops)
    ids = torch.randint(0, 16, (3, 12))
    pos = torch.arange(12).expand(3, 12)
    forced = m(ids, pos)
    cache = KVCache(m.config, 3, 20)
    parts = [m(ids[:, :5], pos[:, :5], cache)] + [m(ids[:, t:t + 1], pos[:, t:t + 1], cache) for t in range(5, 12)]
    return forced, torch.cat(parts, 1)


def test_kv_cache_decode_equals_teacher_forcing_with_lockstep_ops():
    forced, cached = _cached_vs_forced(LOCKSTEP_OPS)
    assert torch.equal(forced, cached)


def test_production_ops_do_not_promise_this():
    forced, cached = _cached_vs_forced(PRODUCTION_OPS)
    assert torch.allclose(forced, cached, atol=1e-5)
    assert not torch.equal(forced, cached)  # if this starts passing, CPU torch became batch-invariant


def _generate(engine, prompts, sp, seeds):
    return engine.generate(prompts, sp, seeds)


def test_samples_depend_only_on_their_seed():
    actor, engine = make_actor(), make_engine()
    sync(actor, engine)
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=8, max_new_tokens=6)
    seeds = [[sample_seed(1, 1, i, j) for j in range(3)] for i in range(3)]
    full = _generate(engine, PROMPTS, sp, seeds)
    alone = _generate(engine, PROMPTS[1:2], sp, [seeds[1][2:3]])  # prompt 1, sample 2, by itself
    b = 1 * 3 + 2
    n = int(full.response_lens[b])
    assert int(alone.response_lens[0]) == n
    assert torch.equal(full.response_tokens()[b, :n], alone.response_tokens()[0, :n])
    assert torch.equal(full.logp[b, :n], alone.logp[0, :n])  # batch-invariant logprobs, too
    assert full.batch_size == 9


def test_top_p_support_holds_the_sampled_token_and_stops_at_eos():
    actor, engine = make_actor(), make_engine()
    sync(actor, engine)
    sp = SamplingParams(temperature=0.7, top_p=0.5, max_new_tokens=8)
    ro = _generate(engine, PROMPTS, sp, [[11, 12, 13, 14]] * 3)
    mask = ro.response_mask()
    toks = ro.response_tokens()
    sup = ro.support_ids
    assert sup is not None and sup.shape[:2] == mask.shape
    assert ((sup == toks[..., None]).any(-1) | ~mask).all()
    assert (sup[~mask] == -1).all() and (sup[mask] < REAL_VOCAB).all()
    for b in range(ro.batch_size):
        n = int(ro.response_lens[b])
        eos_at = (toks[b, :n] == 2).nonzero()
        assert bool(ro.finished[b]) == (len(eos_at) > 0)
        if len(eos_at):
            assert int(eos_at[0]) == n - 1  # nothing generated after EOS
        else:
            assert n == sp.max_new_tokens


def test_greedy_is_deterministic_and_scores_raw_logits():
    actor, engine = make_actor(), make_engine()
    sync(actor, engine)
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    a = _generate(engine, PROMPTS, sp, [[1], [2], [3]])
    b = _generate(engine, PROMPTS, sp, [[4], [5], [6]])
    assert torch.equal(a.tokens, b.tokens) and a.support_ids is None
    assert torch.equal(actor.compute_logp(a).logp, a.logp)


def test_the_engine_passes_its_sampling_logits_back_to_the_logprob(monkeypatch):
    """Strict: each decode step's logprob folds the logits the step sampled from (one LM-head pass),
    and gives the bits of the logprob computed from the hidden states alone; with the logits slot
    stock, nothing is passed back (F.linear's logits are not lockstep's products)."""
    from lockstep.kernels import logp as logp_module

    seen, original = [], logp_module.chunk_states.reference

    def recording(hidden, weight, targets, *, logits=None, **kw):
        out = original(hidden, weight, targets, logits=logits, **kw)
        if logits is not None:
            again = original(hidden, weight, targets, **kw)
            assert torch.equal(out.m, again.m) and torch.equal(out.s, again.s) and torch.equal(out.target_z, again.target_z)
        seen.append(logits is not None)
        return out

    monkeypatch.setattr(logp_module.chunk_states, "reference", recording)
    actor, engine = make_actor(), make_engine("strict")
    sync(actor, engine)
    seen.clear()
    engine.generate([[1, 3, 4], [1, 5]], SamplingParams(temperature=0.9, max_new_tokens=5), [[0], [1]])
    assert seen and all(seen), seen
    assert engine.model.ops.logp.reuse_logits
    stock = build_ops(ALL_R.__class__(True, True, True, frozenset({"logp.linear"})))
    assert not stock.logp.reuse_logits
