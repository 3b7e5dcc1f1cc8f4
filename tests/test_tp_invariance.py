"""Parallelism invariance: the megatron actor's logprobs are the same bits at every TP x CP layout
(CPU, gloo: each layout its own spawned processes), equal to the native engine's, across training
steps and weight syncs; context parallelism halves each rank's activations; and, on a GPU, the
canonical row-parallel GEMM emulated at TP 2/4/8 on Qwen3-8B shapes equals TP 1 bit for bit."""
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from helpers import WEIGHTS, determinism, optional, sync
from lockstep.framework.weights.sync import sync_weights

optional("megatron.core")

# 4 KV heads so that TP 4 shards them; head_dim 32; vocab 64 = 64 chunks of 1 id
SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, max_position_embeddings=128)
REAL_VOCAB = 60
OPTIM = dict(lr=1e-3, betas=[0.9, 0.99], eps=1e-8, weight_decay=0.0, warmup_steps=0, grad_clip=1.0)
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]  # (tp, cp)
PROMPTS = [[1, 3, 4, 5], [1, 6, 7], [1, 9, 10, 11, 12], [1, 20, 21]]
STEPS = 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sampling(step):
    from lockstep.framework.rollout.base import SamplingParams

    return [SamplingParams(1.0, 1.0, 0, 7), SamplingParams(0.8, 0.9, 8, 7), SamplingParams(0.7, 1.0, 0, 6)][step % 3]


def _rank(rank, world, port, tp, cp, out):
    """One rank of a layout: logprobs of the fixed batch, then STEPS steps against a native engine
    (on rank 0) with a weight sync after each; the saved-activation bytes of one training forward."""
    torch.set_num_threads(1)
    from lockstep.framework.actor.megatron.worker import MegatronActor
    from lockstep.framework.rollout.native import NativeRolloutEngine

    actor = MegatronActor(SHAPE, determinism=determinism(), real_vocab_size=REAL_VOCAB, optim=OPTIM, algo={}, seed=5,
                          parallel=dict(device="cpu", tp=tp, cp=cp, pp=1, dp=world // (tp * cp)), rank=rank,
                          world_size=world, max_tokens_per_gpu=64, weights={**WEIGHTS, "bucket_mb": 0.05})
    actor.setup("127.0.0.1", port)
    fixed = torch.load(os.path.join(out, "fixed.pt"), weights_only=False)
    result = {"fixed": actor.compute_logp(fixed).logp}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
        actor._logp_of(actor.model, fixed, torch.arange(fixed.batch_size), True).logp.sum().backward()
    result["saved_bytes"] = sum(saved)
    actor.ddp.zero_grad_buffer()
    import torch.distributed as dist

    engine = NativeRolloutEngine(SHAPE, determinism=determinism(), real_vocab_size=REAL_VOCAB, eos_ids=[2], pad_id=0)

    def receive(bucket):  # rank 0 has the bucket; every rank's engine loads it (so all generate alike)
        obj = [bucket]
        dist.broadcast_object_list(obj, src=0)
        return [engine.receive_bucket(obj[0])]

    sync_weights(actor, receive)  # every rank takes part in every bucket (gathering its shards)
    mismatches, numel = [], []
    for step in range(STEPS):
        ro = engine.generate(PROMPTS, _sampling(step), [[step * 10 + i, 2, 3] for i in range(len(PROMPTS))])
        lp = actor.compute_logp(ro)
        m = ro.response_mask()
        mismatches.append(int(((lp.logp.view(torch.int32) != ro.logp.view(torch.int32)) & m).sum()))
        numel.append(int(m.sum()))
        actor.train(ro, (ro.response_lens % 2).float(), torch.arange(len(PROMPTS)).repeat_interleave(3), lp.logp)
        sync_weights(actor, receive)
    # replicated parameters (the norms) stay equal on every TP rank: a gradient summed over TP
    # everywhere a replicated tensor enters sharded compute
    diverged = []
    for name, p in actor.model.named_parameters():
        if "norm" in name and tp > 1:
            parts = [torch.empty_like(p) for _ in range(tp)]
            dist.all_gather(parts, p.detach().contiguous(), group=actor.tp_group)
            if not all(torch.equal(parts[0], q) for q in parts):
                diverged.append(name)
    result.update(mismatches=mismatches, numel=numel, diverged=diverged)
    torch.save(result, os.path.join(out, f"{tp}x{cp}-{rank}.pt"))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Every layout run once; the fixed batch comes from a native engine on the same seeded weights."""
    from lockstep.framework.actor.native import NativeActor
    from lockstep.framework.rollout.native import NativeRolloutEngine

    out = tmp_path_factory.mktemp("layouts")
    native = NativeActor(SHAPE, determinism=determinism(), real_vocab_size=REAL_VOCAB, optim=OPTIM, algo={}, seed=5,
                         weights=WEIGHTS)
    engine = NativeRolloutEngine(SHAPE, determinism=determinism(), real_vocab_size=REAL_VOCAB, eos_ids=[2], pad_id=0)
    sync(native, engine)
    fixed = engine.generate(PROMPTS, _sampling(1), [[100 + i, 7] for i in range(len(PROMPTS))])
    torch.save(fixed, out / "fixed.pt")
    results = {}
    for tp, cp in LAYOUTS:
        world = tp * cp
        mp.spawn(_rank, args=(world, _free_port(), tp, cp, str(out)), nprocs=world, join=True)
        results[(tp, cp)] = [torch.load(out / f"{tp}x{cp}-{r}.pt") for r in range(world)]
    return fixed, results


def test_logprobs_of_a_fixed_batch_are_equal_across_layouts(layouts):
    fixed, results = layouts
    mask = fixed.response_mask()
    ref = fixed.logp  # the native engine's
    rows = ["| tp | cp | ranks | tokens | equal to the engine | equal to tp1/cp1 |", "|---|---|---|---|---|---|"]
    base = results[(1, 1)][0]["fixed"]
    ok = True
    for (tp, cp), ranks in results.items():
        lp = ranks[0]["fixed"]
        same_engine = bool(((lp.view(torch.int32) == ref.view(torch.int32)) | ~mask).all())
        same_base = torch.equal(lp.view(torch.int32), base.view(torch.int32))
        rows.append(f"| {tp} | {cp} | {tp * cp} | {int(mask.sum())} | {same_engine} | {same_base} |")
        ok &= same_engine and same_base and all(torch.equal(r["fixed"], lp) for r in ranks)
    print("\n" + "\n".join(rows))
    assert ok, "\n".join(rows)


def test_every_layout_stays_bitwise_with_the_engine_over_steps(layouts):
    _, results = layouts
    for layout, ranks in results.items():
        r0 = ranks[0]
        assert all(n > 0 for n in r0["numel"]) and r0["mismatches"] == [0] * STEPS, (layout, r0["mismatches"])
        assert not any(r["diverged"] for r in ranks), (layout, [r["diverged"] for r in ranks])


def test_context_parallelism_halves_the_activations(layouts):
    _, results = layouts
    for tp in (1, 2):
        one, two = results[(tp, 1)][0]["saved_bytes"], [r["saved_bytes"] for r in results[(tp, 2)]]
        # each CP rank keeps about half of what CP 1 keeps (plus the gathered keys and values)
        assert all(0.4 * one < b < 0.75 * one for b in two), (tp, one, two)


# ---- GPU tier: the canonical partition at real shapes --------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(4096, 4096), (12288, 4096)], ids=["o_proj", "down_proj"])
@pytest.mark.parametrize("m", [1, 7, 128, 4096])
def test_emulated_tp_equals_tp1_at_qwen3_8b_shapes(k, n, m):
    import lockstep.kernels as K
    from lockstep.kernels.collectives import tree_sum_ranks
    from lockstep.kernels.rowlinear import NUM_K_CHUNKS, _subtree

    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    with K.using_backend("triton"):
        tp1 = K.row_parallel_linear(x, w)
        for tp in (2, 4, 8):
            kl = k // tp
            roots = [_subtree(x[:, r * kl:(r + 1) * kl].contiguous(), w[:, r * kl:(r + 1) * kl].contiguous(),
                              k // NUM_K_CHUNKS) for r in range(tp)]
            assert torch.equal(tree_sum_ranks(roots).to(x.dtype), tp1), f"TP {tp} differs from TP 1"
        assert torch.equal(K.row_parallel_linear(x[:1], w)[0], tp1[0])  # and row 0 alone
    ref = (x.double() @ w.double().t())
    assert float((tp1.double() - ref).abs().max()) <= 0.02 * float(ref.abs().max()) + 1e-3


# ---- the CLI on a 2-core machine: multi-rank layouts placed with fractional Ray CPUs -------------

@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["actor=megatron", "parallel.tp=2", "rollout.tensor_parallel_size=2"],  # megatron TP2 vs a native TP2 engine
    ["actor=megatron", "parallel.cp=2", "rollout=vllm"],  # megatron CP2 vs vLLM
    ["rollout.tensor_parallel_size=2"],  # the native actor vs a native TP2 engine
], ids=["megatron-tp2/native-tp2", "megatron-cp2/vllm", "native/native-tp2"])
def test_multi_rank_runs_from_the_cli(ray_session, tmp_path, overrides):
    from lockstep.framework.tracking.jsonl import read_jsonl
    from lockstep.launch import cli

    assert cli.main(["run", "tiny-cpu", *overrides, "trainer.steps=2", f"hydra.run.dir={tmp_path}",
                     "logger.progress=false", "logger.wandb.enabled=false", "trainer.save_final=false"]) == 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == 2 and all(r["consistency/mismatch_count"] == 0 and r["consistency/numel"] > 0 for r in rows)
