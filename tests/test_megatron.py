"""The megatron-core actor (CPU, gloo): HF <-> Megatron conversion, bitwise logprobs against the
native rollout engine, and a run through the CLI. Megatron runs in spawned processes: its CPU shims
patch torch process-wide and must not leak into the other tests."""
import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from helpers import WEIGHTS, optional, sync

optional("megatron.core")

from lockstep.framework.actor.megatron.convert import Qwen3Layout, hf_to_megatron, megatron_to_hf  # noqa: E402
from lockstep.framework.models.ops import ALL_R, build_ops  # noqa: E402
from lockstep.framework.models.qwen3 import Qwen3Config, Qwen3ForCausalLM  # noqa: E402


PROVIDER = "lockstep.kernels.provider:linear_logp_provider"
DET = dict(mode="strict", case="R/R", attention=1, ffn=1, logp=1, provider=PROVIDER, on_mismatch="auto", inject_fault="none")
OPTIM = dict(lr=1e-3, betas=[0.9, 0.99], eps=1e-8, weight_decay=0.0, warmup_steps=0, grad_clip=1.0)
SHAPE = dict(vocab_size=32, head_dim=32, num_attention_heads=4, num_key_value_heads=2)


def _hf(tied: bool, seed=3):
    m = Qwen3ForCausalLM(Qwen3Config(**SHAPE, tie_word_embeddings=tied), build_ops(ALL_R))
    m.init_weights(seed)
    return m.hf_state_dict()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp", [1, 2])
def test_conversion_round_trip_is_exact(tied, tp):
    hf = _hf(tied)
    lay = Qwen3Layout.from_config(Qwen3Config(**SHAPE, tie_word_embeddings=tied))
    shards = [hf_to_megatron(hf, lay, tp, r) for r in range(tp)]
    if tp == 2:  # the layouts lockstep's megatron layer expects per rank
        qkv = shards[1]["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert qkv.shape == ((4 // 2 + 2) * 32, 64)  # one KV group per rank: [2 q heads; k; v]
        assert torch.equal(qkv[:64], hf["model.layers.0.self_attn.q_proj.weight"][64:])
        assert torch.equal(qkv[64:96], hf["model.layers.0.self_attn.k_proj.weight"][32:])
        assert torch.equal(qkv[96:], hf["model.layers.0.self_attn.v_proj.weight"][32:])
        assert torch.equal(shards[1]["decoder.layers.0.mlp.linear_fc1.weight"][:64], hf["model.layers.0.mlp.gate_proj.weight"][64:])
    back = megatron_to_hf(shards, lay)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def test_tp_must_divide_kv_heads():
    lay = Qwen3Layout.from_config(Qwen3Config(**SHAPE))
    with pytest.raises(ValueError, match="must divide the model's KV heads"):
        hf_to_megatron(_hf(True), lay, tp=4, rank=0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _megatron_rank(rank, world, port, tp, out, init_from=None):
    """One megatron rank (TP=tp): load HF weights (the seeded init, or a sharded HF checkpoint read
    shard by shard), stream them back, and on TP=1 compare logprobs with the native engine and
    take training steps."""
    from lockstep.framework.actor.megatron.worker import MegatronActor

    from lockstep.framework.weights.buckets import unpack
    from lockstep.framework.weights.transport import open_payload

    actor = MegatronActor(SHAPE, determinism=DET, real_vocab_size=30, optim=OPTIM, algo={"kl_coef": 0.01}, seed=5,
                          parallel=dict(device="cpu", tp=tp, cp=1, pp=1, dp=world // tp), rank=rank,
                          world_size=world, max_tokens_per_gpu=24, weights={**WEIGHTS, "bucket_mb": 0.02},
                          init_from=init_from)
    actor.setup("127.0.0.1", port)
    # every rank takes part in every bucket (gathering its shards); rank 0 gets the buckets
    buckets = [actor.sync_bucket("load", i) for i in range(actor.sync_plan())]
    actor.sync_done()
    result = {}
    if rank == 0:
        assert len(buckets) >= 2
        streamed = {n: t.clone() for b in buckets for n, t in unpack(open_payload(b.payload), b.layout)}
        native = Qwen3ForCausalLM(Qwen3Config(**SHAPE), build_ops(ALL_R))
        native.init_weights(5)
        ref = native.hf_state_dict()
        result["round_trip_exact"] = streamed.keys() == ref.keys() and all(torch.equal(streamed[k], ref[k]) for k in ref)
    if tp == 1:
        from lockstep.framework.rollout.base import SamplingParams
        from lockstep.framework.rollout.native import NativeRolloutEngine

        engine = NativeRolloutEngine(SHAPE, determinism=DET, real_vocab_size=30, eos_ids=[2], pad_id=0)
        sync(actor, engine)
        mismatches, numel = [], []
        for step, sp in enumerate([SamplingParams(1.0, 1.0, 0, 6), SamplingParams(0.8, 0.9, 6, 6), SamplingParams(0.7, 1.0, 0, 5)]):
            ro = engine.generate([[1, 3, 4, 5], [1, 6, 7], [1, 9, 10, 11, 12]], sp, [[step, 2, 3], [4, 5, 6], [7, 8, 9]])
            lp = actor.compute_logp(ro)
            m = ro.response_mask()
            mismatches.append(int(((lp.logp.view(torch.int32) != ro.logp.view(torch.int32)) & m).sum()))
            numel.append(int(m.sum()))
            actor.train(ro, (ro.response_lens % 2).float(), torch.arange(3).repeat_interleave(3), lp.logp)
            sync(actor, engine)
        result.update(mismatches=mismatches, numel=numel, readback=actor.ops.counter.as_dict())
    torch.save(result, os.path.join(out, f"{rank}.pt"))


@pytest.mark.parametrize("tp,from_checkpoint", [(1, False), (2, False), (2, True)])
def test_megatron_actor_on_gloo(tp, from_checkpoint, tmp_path):
    init_from = None
    if from_checkpoint:  # the same seeded weights, as a sharded HF checkpoint
        native = Qwen3ForCausalLM(Qwen3Config(**SHAPE), build_ops(ALL_R))
        native.init_weights(5)
        native.save_pretrained(tmp_path / "ckpt", max_shard_bytes=60_000)
        assert (tmp_path / "ckpt" / "model.safetensors.index.json").exists()
        init_from = str(tmp_path / "ckpt")
    mp.spawn(_megatron_rank, args=(tp, _free_port(), tp, str(tmp_path), init_from), nprocs=tp, join=True)
    r0 = torch.load(tmp_path / "0.pt")
    assert r0["round_trip_exact"], "HF -> megatron -> HF (through the model) changed a tensor"
    if tp == 1:
        assert all(n > 0 for n in r0["numel"])
        assert r0["mismatches"] == [0, 0, 0], r0["mismatches"]  # bitwise, before and after updates
        # every op slot ran (paged attention is the vLLM engine's; sampling logits the engine's; the
        # packed core runs with actor.pack_sequences; megatron holds q/k/v and gate/up fused, so its
        # projections are linear_rows, not linear)
        calls = {k: v["calls"] for k, v in r0["readback"].items()}
        assert calls["attention.linear_rows"] > 0 and calls["ffn.linear_rows"] > 0
        assert calls["attention.linear"] == calls["ffn.linear"] == 0
        assert all(n > 0 for k, n in calls.items() if k not in (
            "logp.linear", "attention.paged_attention", "attention.varlen_attention", "attention.linear", "ffn.linear"))


@pytest.mark.slow
def test_tiny_cpu_with_megatron_actor(ray_session, tmp_path, capsys):
    from lockstep.framework.tracking.jsonl import read_jsonl
    from lockstep.launch import cli

    rc = cli.main(["run", "tiny-cpu", "actor=megatron", "trainer.steps=3", f"hydra.run.dir={tmp_path}",
                   "logger.progress=false", "logger.wandb.enabled=false"])
    assert rc == 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == 3 and all(r["consistency/mismatch_count"] == 0 and r["consistency/numel"] > 0 for r in rows)
    assert json.loads((tmp_path / "readbacks" / "trainer-0-rank0.json").read_text())["backend"] == "megatron"
    assert (tmp_path / "checkpoint" / "model.safetensors").exists()
    capsys.readouterr()
    assert cli.main(["validate", str(tmp_path)]) == 0
