"""GPU tier: vLLM (CUDA) with lockstep's plugin, compiled with CUDA graphs, bf16, bitwise against the
lockstep trainer for every sampled token; weights arrive over CUDA IPC."""
import json

import pytest
import torch

from helpers import OPTIM, determinism, assert_draws_follow_reported, optional, sync

pytestmark = pytest.mark.gpu

MODEL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
REAL_VOCAB = 500
PROMPTS = [[1, 3, 4, 5, 9, 17], [1, 6, 7], [1, 9], [1, 11, 12, 13, 14, 10, 99, 250]]


@pytest.fixture(scope="module")
def pair():
    optional("vllm")
    from lockstep.framework.actor.native import NativeActor
    from lockstep.framework.rollout.vllm_engine import VllmRolloutEngine

    det = determinism()
    actor = NativeActor(MODEL, determinism=det, real_vocab_size=REAL_VOCAB, optim=OPTIM, algo={}, seed=0,
                        weights={"bucket_mb": 0.5, "transport": "cuda_ipc"}, device="cuda", dtype="bfloat16")
    engine = VllmRolloutEngine(MODEL, determinism=det, real_vocab_size=REAL_VOCAB, eos_ids=[2], pad_id=0,
                               max_batch=16, dtype="bfloat16", enforce_eager=False, gpu_memory_utilization=0.3,
                               max_support=MODEL["vocab_size"])  # a random model's nucleus is most of the vocab
    timings = sync(actor, engine)
    yield actor, engine, timings
    engine.shutdown()


def _seeds(n_prompts, n, step=1):
    from lockstep.framework.rollout.sampling import sample_seed

    return [[sample_seed(7, step, p, j) for j in range(n)] for p in range(n_prompts)]


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (0.8, 1.0, 20), (0.0, 1.0, 0)],
                         ids=["full-vocab", "top-p", "top-k", "greedy"])
def test_vllm_cuda_graphs_bitwise_with_the_trainer(pair, temperature, top_p, top_k):
    from lockstep.framework.rollout.base import SamplingParams

    actor, engine, _ = pair
    rollout = engine.generate(PROMPTS, SamplingParams(temperature, top_p, top_k, 24), _seeds(len(PROMPTS), 3))
    mask = rollout.response_mask()
    recomputed = actor.compute_logp(rollout).logp
    assert int(mask.sum()) > 100
    differ = (recomputed.view(torch.int32) != rollout.logp.view(torch.int32)) & mask
    where = differ.nonzero().tolist()
    detail = [(b, r, int(rollout.response_lens[b]), float(rollout.logp[b, r]), float(recomputed[b, r]),
               int((rollout.support_ids[b, r] >= 0).sum()) if rollout.support_ids is not None else None) for b, r in where[:12]]
    assert int(differ.sum()) == 0, f"{int(differ.sum())} of {int(mask.sum())} logprobs differ: (sample, position, length, rollout, trainer, support size) {detail}"


def test_seeded_sampling_draws_the_same_tokens_in_any_batch(pair):
    """A sample's tokens are a function of its seed (and the weights), never of the batch around it:
    what RL's per-sample seeds promise. On CUDA vLLM's V2 runner draws every request of a step in one
    launch keyed by seed and position: a key taken from the batch row, or one that did not move with
    the position, would draw other tokens here."""
    from lockstep.framework.rollout.base import SamplingParams

    _, engine, _ = pair
    seeds = _seeds(len(PROMPTS), 3, step=5)
    for sp in (SamplingParams(1.0, 1.0, 0, 24), SamplingParams(0.8, 0.9, 0, 24)):
        together = engine.generate(PROMPTS, sp, seeds)
        alone = engine.generate(PROMPTS[2:3], sp, [seeds[2][1:2]])
        row = 2 * 3 + 1
        n = int(together.response_lens[row])
        assert int(alone.response_lens[0]) == n
        start_t, start_a = int(together.prompt_lens[row]), int(alone.prompt_lens[0])
        assert torch.equal(together.tokens[row, start_t:start_t + n], alone.tokens[0, start_a:start_a + n])
        # the three seeds of one prompt draw different responses (the noise follows the seed)
        responses = {tuple(together.tokens[2 * 3 + j, start_t:].tolist()) for j in range(3)}
        assert len(responses) == 3


@pytest.mark.parametrize("temperature,top_p", [(0.5, 0.9), (0.6, 1.0)], ids=["top-p", "full-vocab"])
def test_the_v2_sampler_draws_what_lockstep_reports(pair, temperature, top_p):
    """The logprob lockstep reports is the distribution vLLM's V2 sampler drew from (its temperature
    applied once, its top-p support the replayed one): 16,000 draws of one token against exp(logprob),
    and the same counts reject a sampler that applied the temperature twice or not at all."""
    from lockstep.framework.rollout.base import SamplingParams

    _, engine, _ = pair
    assert_draws_follow_reported(engine, PROMPTS[0], SamplingParams(temperature, top_p, 0, 1), list(range(1000, 17000)))


def test_weights_came_over_cuda_ipc_and_were_checked_on_the_gpu(pair, tmp_path):
    actor, engine, timings = pair
    assert timings["buckets"] >= 2 and timings["load_post_load_checked"] == timings["buckets"]
    [path] = engine.write_readback(str(tmp_path))
    rb = json.loads(open(path).read())
    assert rb["compiled_forward"] is True and rb["kernel_backend"] == "triton"
    assert rb["kernel_calls"]["paged_attention"] > 0 and rb["kernel_calls"]["linear_logp"] > 0
    assert rb["sampler"] == "LockstepSamplerV2", "the engine ran vLLM's V1 model runner on CUDA"
