"""Where the Gluon split decode's program spends its time (attention._decode_chunks_kernel, a chunk
at once), with its copies by cp.async and by TMA: %globaltimer stamps (STAMPS) at each step of a
program's last chunk, medians / maxima over the programs, us; the paged decode table's inputs
(sweep_attention.paged_inputs: bf16, Qwen3-8B heads, 16-key pages in random order). The output is
checked against the table's kernel (the tl split with GLUON off) bit for bit.

    python benchmarks/probe_chunks.py [1x1024,1x4096,...]      # (gpu_session.sh probe_chunks)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
from sweep_attention import paged_inputs  # noqa: E402
from lockstep.kernels._triton import attention as A  # noqa: E402
from lockstep.kernels._triton._device import resident_programs  # noqa: E402
from lockstep.kernels._triton._tickets import zeroed_tickets  # noqa: E402

STEPS = ["entry -> bound", "bound -> K", "q.k", "softmax", "-> V", "chain", "-> ticket", "merge"]


def _run(case: str, tma: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    batch, context = map(int, case.split("x"))
    q, k_cache, v_cache, table, seq_lens, qsl, scale, max_q, max_s = paged_inputs(batch, context, 1)
    queries, keys = A._paged_layout(q, k_cache, v_cache, table, seq_lens, qsl, max_q, max_s)
    group, d = q.shape[1] // keys.n_heads, q.shape[2]
    n_chunks, pairs = triton.cdiv(keys.max_count, A.KV_CHUNK), queries.n_seqs * keys.n_heads
    per_split = A._gluon_split(keys, group, A.TUNING["decode"], pairs, n_chunks, resident_programs(q.device))
    assert per_split > 1, f"{case}: the Gluon split does not run here"
    view = A._tma_view(keys) if tma else None
    assert (view is not None) == tma
    part_m = torch.empty((pairs, n_chunks, group), device="cuda")
    part_l, part_acc = torch.empty_like(part_m), torch.empty((pairs, n_chunks, group, d), device="cuda")
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device="cuda")
    stamps = torch.zeros((pairs * per_split, 16), dtype=torch.int64, device="cuda")
    tickets = zeroed_tickets(q.device, pairs)
    for _ in range(20):  # warm: compiled, L2 as a replay's
        A._launch_chunks(queries, keys, out, lse, part_m, part_l, part_acc, tickets, group, scale * A._LOG2E,
                         n_chunks, per_split, view, stamps)
    torch.cuda.synchronize()
    with torch.no_grad():
        cfg = {**A.TUNING["decode"], "GLUON": False}
        saved, A.TUNING["decode"] = A.TUNING["decode"], cfg
        try:
            table_out = A._paged(q, k_cache, v_cache, table, seq_lens, qsl, scale, max_q, max_s)
        finally:
            A.TUNING["decode"] = saved
    same = torch.equal(out, table_out)
    return stamps.cpu(), same, per_split


def main() -> None:
    cases = sys.argv[1] if len(sys.argv) > 1 else "1x1024,1x4096,1x16384,8x1024"
    print("| case | copies | programs | " + " | ".join(STEPS) + " | span | bits |")
    print("|---|---|---|" + "---|" * (len(STEPS) + 2))
    for case in cases.split(","):
        for tma in (False, True):
            st, same, per_split = _run(case, tma)
            st = st.double() / 1e3  # us
            cells = []
            for i in range(len(STEPS)):
                ok = (st[:, i] > 0) & (st[:, i + 1] > 0)
                dt = (st[ok, i + 1] - st[ok, i])
                cells.append(f"{dt.median():.2f} / {dt.max():.2f}" if ok.any() else "-")
            span = st[:, 8][st[:, 8] > 0].max() - st[:, 0].min()
            print(f"| {case} | {'TMA' if tma else 'cp.async'} | {st.shape[0]} ({per_split} a pair) | "
                  + " | ".join(cells) + f" | {span:.2f} | {'same' if same else 'DIFFER'} |", flush=True)


if __name__ == "__main__":
    main()
