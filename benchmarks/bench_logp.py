"""lockstep's fused linear_logp (Triton backend) against the paths it replaces, on one CUDA device.

Qwen3's LM head in bf16 (H=4096, V=151936), T tokens:
- forward time against the bare LM-head GEMM (torch.matmul, the floor any logp path pays) and
  against the naive path (logits = hidden @ W^T in bf16, .float(), log_softmax, gather);
- forward extra memory against the naive path's;
- forward+backward time and extra memory against the naive path's. Both backward passes produce
  the same gradient tensors (grad_hidden, grad_weight: 1.2 GiB at this vocab), so memory is
  compared beyond those outputs;
- tensor-parallel shards (V/2, V/4, V/8 local rows): the local forward against the bare GEMM on
  the same rows;
- top-p replay (support_ids: T = 128 rows, k ids each): the Triton support kernel's forward against
  the naive path over the whole vocab (logits, the support kept by a scatter, log_softmax) and
  against the torch reference's [T, k, H] products, time and extra memory.
Both sides run in the same process on the same inputs (benchmarks/_harness.py). Forward times are
kernel time on both sides: CUDA-graph replays (`fwd_ms`), with linear_logp's target-range check
skipped, as a rollout engine skips it (it reads the targets on the host, which no graph can hold),
against the bare GEMM in alternating turns (_harness.paired_graph_ms);
forward+backward times and memory are measured eagerly.

    python benchmarks/bench_logp.py
"""
from __future__ import annotations

import torch

if __package__:  # imported as benchmarks.bench_logp
    from ._harness import graph_ms_per_call, markdown_table, measure, paired_graph_ms
else:  # run as a script, or imported with benchmarks/ on sys.path
    from _harness import graph_ms_per_call, markdown_table, measure, paired_graph_ms

import lockstep.kernels as K

VOCAB = 151936  # Qwen3
HIDDEN = 4096
TOKENS = [256, 4096, 16384]
SHARD_TOKENS = 4096
TP_SIZES = [2, 4, 8]
DTYPE = torch.bfloat16
FWD_TIME_TARGET = 1.10  # x bare GEMM
FWD_BWD_TIME_TARGET = 1.00  # x naive forward+backward
MEMORY_TARGET = 0.10  # x naive extra memory
GIB = 2**30


def _inputs(tokens: int, rows: int = VOCAB):
    hidden = torch.randn(tokens, HIDDEN, device="cuda", dtype=DTYPE)
    weight = (torch.randn(rows, HIDDEN, device="cuda") * 0.02).to(DTYPE)
    targets = torch.randint(0, rows, (tokens,), device="cuda")
    return hidden, weight, targets


def _naive_logp(hidden, weight, targets):
    logits = hidden @ weight.t()
    return logits.float().log_softmax(-1).gather(1, targets[:, None])[:, 0]


def _lockstep_logp(hidden, weight, targets):
    return K.linear_logp(hidden, weight, targets).logp


def _fwd_bwd(logp_fn, hidden, weight, targets):
    """The forward, then grad_hidden and grad_weight of sum(logp)."""
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    return torch.autograd.grad(logp_fn(h, w, targets).sum(), (h, w))


def fwd_ms(fn) -> float:
    """Milliseconds of one forward call, replayed from a CUDA graph (value checks skipped)."""
    with K.skipping_value_checks():
        return graph_ms_per_call(fn)


def fwd_pair_ms(baseline, ours) -> tuple[float, float]:
    """fwd_ms of both sides, timed in alternating turns (_harness.paired_graph_ms)."""
    with K.skipping_value_checks():
        return paired_graph_ms(baseline, ours)


def _row(tokens, what, baseline, base_value, ours, target):
    ratio = ours / base_value
    return [tokens, what, baseline, base_value, ours, ratio, f"<={target:.2f}", "pass" if ratio <= target else "miss"]


def _rows_for(tokens: int) -> list[list]:
    hidden, weight, targets = _inputs(tokens)
    gemm_ms, ours_ms = fwd_pair_ms(lambda: torch.matmul(hidden, weight.t()),
                                   lambda: _lockstep_logp(hidden, weight, targets))
    naive_ms = fwd_ms(lambda: _naive_logp(hidden, weight, targets))
    naive = measure(lambda: _naive_logp(hidden, weight, targets))  # memory
    ours = measure(lambda: _lockstep_logp(hidden, weight, targets))
    naive_train = measure(lambda: _fwd_bwd(_naive_logp, hidden, weight, targets))
    ours_train = measure(lambda: _fwd_bwd(_lockstep_logp, hidden, weight, targets))
    grads_gib = (hidden.numel() + weight.numel()) * DTYPE.itemsize / GIB
    return [
        _row(tokens, "fwd time (ms)", "bare GEMM", gemm_ms, ours_ms, FWD_TIME_TARGET),
        [tokens, "fwd time (ms)", "naive", naive_ms, ours_ms, ours_ms / naive_ms, "-", "-"],
        _row(tokens, "fwd extra memory (GiB)", "naive", naive.extra_gib, ours.extra_gib, MEMORY_TARGET),
        _row(tokens, "fwd+bwd time (ms)", "naive", naive_train.ms, ours_train.ms, FWD_BWD_TIME_TARGET),
        _row(tokens, "fwd+bwd extra memory beyond the gradients (GiB)", "naive", naive_train.extra_gib - grads_gib,
             ours_train.extra_gib - grads_gib, MEMORY_TARGET),
    ]


def logp_table() -> str:
    rows = [row for tokens in TOKENS for row in _rows_for(tokens)]
    columns = ["T", "measure", "baseline", "baseline value", "lockstep", "ratio", "target", "pass/miss"]
    return markdown_table(f"linear_logp (bf16, H={HIDDEN}, V={VOCAB}) vs bare GEMM and the naive path", columns, rows)


def shard_table() -> str:
    rows = []
    for tp in TP_SIZES:
        local = VOCAB // tp  # whole 2374-column chunks: 64 / tp of them
        hidden, weight, targets = _inputs(SHARD_TOKENS, local)
        # one rank's part of a sharded call: its chunks' states and their merge (no all-gather)
        gemm, ours = fwd_pair_ms(lambda: torch.matmul(hidden, weight.t()),
                                 lambda: K.linear_logp(hidden, weight, targets, full_vocab_size=VOCAB).logp)
        ratio = ours / gemm
        rows.append([f"V/{tp} = {local}", SHARD_TOKENS, gemm, ours, ratio, f"<={FWD_TIME_TARGET:.2f}",
                     "pass" if ratio <= FWD_TIME_TARGET else "miss"])
    columns = ["local vocab rows", "T", "bare GEMM ms", "lockstep fwd ms", "ratio", "target", "pass/miss"]
    return markdown_table("linear_logp forward on a tensor-parallel vocab shard vs its bare GEMM", columns, rows)


SUPPORT_TOKENS = 128
SUPPORT_WIDTHS = [64, 1024]


def _naive_support_logp(hidden, weight, targets, ids):
    z = (hidden @ weight.t()).float()
    kept = torch.full_like(z, float("-inf")).scatter(1, ids, z.gather(1, ids))
    return kept.log_softmax(-1).gather(1, targets[:, None])[:, 0]


def _support_logp(hidden, weight, targets, ids, backend):
    with K.using_backend(backend):
        return K.linear_logp(hidden, weight, targets, support_ids=ids).logp


def support_table() -> str:
    rows = [_support_row(k) for k in SUPPORT_WIDTHS]
    columns = ["k", "naive ms", "torch reference ms", "kernel ms", "vs naive", "vs torch reference",
               "naive GiB", "torch reference GiB", "kernel GiB"]
    return markdown_table(f"linear_logp top-p replay forward (T = {SUPPORT_TOKENS}, bf16, H={HIDDEN}, V={VOCAB}), "
                          "bits equal to the torch reference's", columns, rows)


def _support_row(k: int) -> list:
    hidden, weight, targets = _inputs(SUPPORT_TOKENS)
    ids = torch.randint(0, VOCAB, (SUPPORT_TOKENS, k), device="cuda")
    ids[:, 0] = targets
    naive_fn = lambda: _naive_support_logp(hidden, weight, targets, ids)  # noqa: E731
    torch_fn = lambda: _support_logp(hidden, weight, targets, ids, "torch")  # noqa: E731
    ours_fn = lambda: _support_logp(hidden, weight, targets, ids, "triton")  # noqa: E731
    if not torch.equal(torch_fn(), ours_fn()):
        raise AssertionError(f"support logp at k = {k}: the Triton path's bits differ from the torch reference's")
    naive_ms, ours_ms = fwd_pair_ms(naive_fn, ours_fn)
    torch_ms = fwd_ms(torch_fn)
    mem = [measure(fn).extra_gib for fn in (naive_fn, torch_fn, ours_fn)]
    return [k, naive_ms, torch_ms, ours_ms, ours_ms / naive_ms, ours_ms / torch_ms, *mem]


def run(out_md_lines: list[str]) -> None:
    """Append the linear_logp tables (markdown) to out_md_lines. CUDA only."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_logp needs a CUDA device")
    with K.using_backend("triton"):
        out_md_lines.append(logp_table())
        out_md_lines.append(shard_table())
        out_md_lines.append(support_table())


if __name__ == "__main__":
    lines: list[str] = []
    run(lines)
    print("\n".join(lines))
