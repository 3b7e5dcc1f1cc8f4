"""Host time per decode step of the sampler's logprob path in vLLM + lockstep strict (what
`framework/rollout/vllm_plugin` runs after every decode step's graph replay, outside the graph),
beside its GPU time, at the 8B rollout's shape (128 rows, H 4,096, Qwen3's 151,936-column head):

    python benchmarks/host_logp.py [--rows 128]

A piece whose host time exceeds its GPU time leaves the GPU idle wherever the host is not ahead of
the GPU (in the 8B rollout it is: its decode graph's replay keeps the GPU busy while the host queues
the sampler, benchmarks/RESULTS.md). The host's speed moves these numbers between machines; compare
rows of one run.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _harness import graph_ms_per_call, host_us  # noqa: E402
import lockstep.kernels as K  # noqa: E402
from lockstep.framework.models.ops import ALL_R, build_ops  # noqa: E402
from lockstep.kernels import logp as L  # noqa: E402

HIDDEN, VOCAB = 4096, 151936


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=128)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_logp needs a CUDA device")
    K.set_backend("triton")
    torch.manual_seed(0)
    t = args.rows
    hidden = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    targets = torch.randint(0, VOCAB, (t,), device="cuda")
    temperature = torch.full((t,), 0.7, device="cuda")
    ops = build_ops(ALL_R, mode="strict")
    logits = ops.logp.linear(hidden, weight).float()
    width = L.chunk_width(VOCAB)
    st = L.chunk_states(hidden, weight, targets, vocab_start=0, width=width, real_vocab_size=VOCAB, bias=None,
                        temperature=temperature, with_entropy=False, logits=logits)
    lp = torch.randn(t, 6, device="cuda")
    ids = torch.randint(0, VOCAB, (t, 6), device="cuda")

    def sampling_logits():  # model.compute_logits
        z = ops.logp.linear(hidden, weight).float().clone()
        z[:, VOCAB:] = float("-inf")
        return z

    def replay():  # worker.replace_sampled_logprob, unrestricted batch
        with K.skipping_value_checks():
            out = ops.logp.linear_logp(hidden, weight, targets, temperature=temperature, real_vocab_size=VOCAB,
                                       logits=logits).logp
        holds = ids == targets[:, None]
        lp.copy_(torch.where(holds, out[:, None], lp))

    ops_ = torch.ops.lockstep
    rows = [
        ("LM-head logits: custom op lockstep::linear_logp_head_logits",
         lambda: ops_.linear_logp_head_logits(hidden, weight, width)),
        ("LM-head logits: ops.logp.linear (lm_head_logits)", lambda: ops.logp.linear(hidden, weight)),
        ("compute_logits: logits, .float(), clone, pad mask", sampling_logits),
        ("chunk states from the logits: custom op", lambda: ops_.linear_logp_chunk_states(
            hidden, weight, targets, None, temperature, 0, width, VOCAB, False, logits)),
        ("chunk states from the logits: L.chunk_states", lambda: L.chunk_states(
            hidden, weight, targets, vocab_start=0, width=width, real_vocab_size=VOCAB, bias=None,
            temperature=temperature, with_entropy=False, logits=logits)),
        ("merge: custom op", lambda: ops_.linear_logp_merge(st.target_z, st.m, st.s, st.w)),
        ("merge: L.merge_states", lambda: L.merge_states(st.target_z, st.m, st.s, st.w)),
        ("K.linear_logp(logits=)", lambda: _checked(K.linear_logp, hidden, weight, targets, temperature, logits)),
        ("ops.logp.linear_logp (provider route, strict)", lambda: _checked(ops.logp.linear_logp, hidden, weight,
                                                                           targets, temperature, logits)),
        ("the sampler's replay: route + where + copy_", replay),
    ]
    print(f"| {t} rows, {torch.cuda.get_device_name()} | host us a call | GPU us a call | host / GPU |\n|---|---|---|---|")
    for label, fn in rows:
        h, g = host_us(fn), graph_ms_per_call(fn, 100) * 1e3
        print(f"| {label} | {h:.0f} | {g:.0f} | {h / g:.2f} |", flush=True)


def _checked(fn, hidden, weight, targets, temperature, logits):
    with K.skipping_value_checks():
        return fn(hidden, weight, targets, temperature=temperature, real_vocab_size=VOCAB, logits=logits)


if __name__ == "__main__":
    main()
