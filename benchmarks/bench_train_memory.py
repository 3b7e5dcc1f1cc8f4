"""Peak training memory of the megatron actor against actor.max_tokens_per_gpu and the batch (one GPU).

    python benchmarks/bench_train_memory.py OUT.md [--model qwen3-1.7b] [--length 512]
        [--batches 8,16,32,64] [--budgets 2048,4096,8192,whole]

One MegatronActor rank (world size 1, NCCL, bf16, lockstep kernels: determinism strict) trains GRPO
steps on synthetic rollouts of `length` tokens per sample (64 prompt + the rest response, fixed so
padding plays no part). Per (batch, budget): the peak allocated GPU memory during `train()` above
what was allocated before it (parameters, gradient buffers and optimizer state stay resident and
are reported once), and the train time. `whole` is the whole batch in one micro-batch: what a
trainer without per-micro-batch backward holds, the baseline. The row at the largest batch with
`whole` runs last: it may not fit, and then says OOM.
"""
from __future__ import annotations

import argparse
import socket
import time

import torch

from bench_rollout import model_shape
from _harness import emit

PROMPT = 64
PROVIDER = "lockstep.kernels.provider:linear_logp_provider"
DET = dict(mode="strict", case="R/R", attention=1, ffn=1, logp=1, provider=PROVIDER, on_mismatch="auto",
           inject_fault="none")
OPTIM = dict(lr=1e-6, betas=[0.9, 0.99], eps=1e-8, weight_decay=0.0, warmup_steps=0, grad_clip=1.0)
WHOLE = 10**9


def rollout(batch: int, length: int, vocab: int):
    from lockstep.framework.rollout.base import Rollout, SamplingParams

    g = torch.Generator().manual_seed(batch)
    resp = length - PROMPT
    return Rollout(tokens=torch.randint(10, vocab, (batch, length), generator=g),
                   prompt_lens=torch.full((batch,), PROMPT), response_lens=torch.full((batch,), resp),
                   logp=torch.full((batch, resp), -12.0), support_ids=None,
                   finished=torch.zeros(batch, dtype=torch.bool), weights_version=0, sampling=SamplingParams())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--model", default="qwen3-1.7b")
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--batches", default="8,16,32,64")
    p.add_argument("--budgets", default="2048,4096,8192,whole")
    args = p.parse_args()
    from lockstep.framework.actor.megatron.worker import MegatronActor

    shape = model_shape(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    budgets = [WHOLE if b == "whole" else int(b) for b in args.budgets.split(",")]
    actor = MegatronActor(shape, determinism=DET, real_vocab_size=shape["vocab_size"] - 256, optim=OPTIM, algo={},
                          seed=0, parallel=dict(device="cuda", tp=1, cp=1, pp=1, dp=1), rank=0, world_size=1,
                          max_tokens_per_gpu=budgets[0], weights=dict(bucket_mb=512, transport="cuda_ipc"),
                          dtype="bfloat16")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    actor.setup("127.0.0.1", port)

    def step(batch: int, budget: int) -> tuple[float, float]:
        ro = rollout(batch, args.length, shape["vocab_size"] - 256)
        actor.max_tokens = budget
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        actor.train(ro, torch.arange(batch).remainder(3).float(), torch.arange(batch) // 4, ro.logp)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**30, time.perf_counter() - t0

    step(batches[0], budgets[0])  # the optimizer's state appears at its first step
    resident = torch.cuda.memory_allocated() / 2**30
    order = [(b, m) for b in batches for m in budgets if (b, m) != (batches[-1], budgets[-1])]
    order.append((batches[-1], budgets[-1]))
    results = {}
    for b, m in order:
        try:
            results[(b, m)] = step(b, m)
        except torch.cuda.OutOfMemoryError:
            results[(b, m)] = None
            torch.cuda.empty_cache()
        r = results[(b, m)]
        print(f"batch {b} budget {m}: " + (f"peak {r[0]:.2f} GiB, {r[1]:.2f} s" if r else "OOM"), flush=True)
    name = lambda m: "whole batch" if m == WHOLE else f"{m:,}"
    lines = [f"{args.model}, bf16, megatron actor (1 rank, lockstep kernels, strict), {args.length} tokens per sample; "
             f"resident (params + grad buffers + optimizer state) {resident:.2f} GiB", "",
             "peak training memory above resident, GiB (train s):", "",
             "| batch (tokens) | " + " | ".join(f"max_tokens_per_gpu {name(m)}" for m in budgets) + " |",
             "|---|" + "---|" * len(budgets)]
    for b in batches:
        cells = [f"{r[0]:.2f} ({r[1]:.1f} s)" if (r := results[(b, m)]) else "OOM" for m in budgets]
        lines.append(f"| {b} ({b * args.length:,}) | " + " | ".join(cells) + " |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
