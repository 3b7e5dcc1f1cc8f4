"""Where a small-batch decode step's time goes: a timeline of the split decode path's programs (CUDA only).

    python benchmarks/probe_decode.py [BxC,...] [KEY=VALUE ...] [--merge-forms 0,1,2,3]
        # cases: default 1x1024,1x4096,1x16384,16x1024,16x4096,16x16384; KEY=VALUE: TUNING["decode"] for
        # both the table's kernel and the traced one (e.g. num_stages=4 PROGRAMS_PER_SM=1 SWAP=False)
        # --merge-forms: a row per form of the merging program's loop (default 0, the table's):
        #   0 the table's merge (_merge_chunk_states; bits checked against the table's kernel)
        #   1 its loads alone: the same loads, _MERGE_AHEAD a step, summed (no exponentials, no selects)
        #   2 its arithmetic alone: _merge and the selects on states made from the chunk's index (no load)
        #   3 neither: states made from the index, summed (the loop's own cost)
        # forms 1-3 are timing only (their outputs are not the attention's); the merge column and the
        # traced kernel's time, against form 0's, say which part holds the merge's time.

Decode below ~50 requests splits each (sequence, kv head)'s chunks over programs that store chunk
states, the last of a pair's programs merging them (kernels/_triton/attention.py,
_decode_chunk_kernel). The probe traces a program's chunks a loop each, the route of a program of one
chunk; the table runs a program of several in one loop (_split_states, FLAT_STAGES), so where
programs hold several chunks the two kernels' times differ by more than the stamps. No profiler runs
on the GPU host, so this probe runs the split path's steps, built from attention.py's own building
blocks (_sequence, _query_pos, _block_kv, _fold_block, _merge), with a stamp (%globaltimer, ns, and
the SM's %clock64) at each step a program waits on: entry, its keys' bound known (the sequence's
length loaded), each 64-key block's maxima known (its K/V loaded and its q.k done), its states
stored and its ticket back, and for the merging program the rows stored. Its outputs are checked
bit for bit against the table's kernel, and its time against the table's (stamps cost a little),
both by CUDA-graph replay. Also a kernel of the same grid that only reads the sequence's length and
stores one value: what launching the grid costs.

Per case it prints the table's and the traced kernel's time, the launch floor, and medians / maxima
over programs: the start spread (entry after the first program's), entry to bound, bound to the
first block, the period of later blocks, the last block to the ticket, the merge, and the span from
the first entry to the last program's end.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))

from _harness import graph_ms_per_call  # noqa: E402
from sweep_attention import paged_inputs  # noqa: E402
from lockstep.kernels._triton import attention as A  # noqa: E402
from lockstep.kernels._triton._device import resident_programs  # noqa: E402
from lockstep.kernels._triton._tickets import zeroed_tickets  # noqa: E402

CASES = "1x1024,1x4096,1x16384,16x1024,16x4096,16x16384"
MAX_BLOCKS = 32  # block stamps kept a program
# stamp slots a program: entry, bound, MAX_BLOCKS blocks, ticket, merged, then (not a stamp) blocks, sm
ENTRY, BOUND, BLOCK0 = 0, 1, 2
TICKET, MERGED, BLOCKS, SM = BLOCK0 + MAX_BLOCKS, BLOCK0 + MAX_BLOCKS + 1, BLOCK0 + MAX_BLOCKS + 2, BLOCK0 + MAX_BLOCKS + 3
SLOTS = SM + 1
SLOTS_C, MAX_BLOCKS_C, BLOCKS_C, SM_C = (tl.constexpr(v) for v in (SLOTS, MAX_BLOCKS, BLOCKS, SM))


@triton.jit
def _now(dep):
    """(%globaltimer, %clock64) once the scalar `dep` is ready (the asm takes it as an operand)."""
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,f", [dep], dtype=tl.int64, is_pure=False, pack=1)
    c = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,f", [dep], dtype=tl.int64, is_pure=False, pack=1)
    return t, c


@triton.jit
def _stamp(trace, slot, dep):
    t, c = _now(dep)
    tl.store(trace + slot, t)
    tl.store(trace + SLOTS_C + slot, c)



@triton.jit
def _sm():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _traced_split_kernel(q, k, v, out, lse, part_m, part_l, part_acc, tickets, trace, q_begin, q_count, q_pos,
                         page_table, stride_table, page_size, stride_page, stride_head, stride_slot, n_heads,
                         qk_scale, n_chunks, per_split, GROUP: tl.constexpr, ROWS: tl.constexpr,
                         MERGE_ROWS: tl.constexpr, D: tl.constexpr, KV_BLOCK: tl.constexpr, KV_CHUNK: tl.constexpr,
                         PAGE_SHIFT: tl.constexpr, SWAP: tl.constexpr, NULL: tl.constexpr,
                         MERGE_FORM: tl.constexpr = 0):
    """_decode_chunk_kernel's split path (every pair split, FROM_LENS), stamped. NULL: read the
    sequence's length, store it, return (the launch floor)."""
    pid = tl.program_id(0)
    trace = trace + pid * 2 * SLOTS_C
    _stamp(trace, 0, pid.to(tl.float32))
    n_kv = n_heads // GROUP
    pair = pid // per_split
    p = pid % per_split
    seq, kv_head = pair // n_kv, pair % n_kv
    begin, n_queries = A._sequence(q_begin, q_count, seq, True)
    rows = tl.arange(0, ROWS)
    tok, head = A._rows(rows, begin, 1, kv_head, GROUP)
    pos = A._query_pos(q_pos, tok, rows, seq, 1, GROUP, True)
    hi = tl.max(pos, 0)
    _stamp(trace, 1, hi.to(tl.float32))
    tl.store(trace + SM_C, _sm().to(tl.int64))
    if NULL:
        tl.store(trace + BLOCKS_C, hi.to(tl.int64))
        return
    n_need = hi // KV_CHUNK + 1
    if p >= n_need:
        return
    q_tile = tl.load(q + A._tile_offsets(tok * n_heads + head, D, SWAP))
    keep = rows < GROUP
    k, v, page_row = k + kv_head * stride_head, v + kv_head * stride_head, page_table + seq * stride_table
    first = (pair * n_chunks).to(tl.int64) * GROUP + rows % GROUP
    n_blk = 0
    for chunk in range(p, n_need, per_split):
        m, l, acc = A._empty_state(ROWS, D, SWAP)
        start = chunk * KV_CHUNK
        pages = A._chunk_pages(page_row, start, hi, KV_CHUNK, PAGE_SHIFT)
        for lo in range(start, tl.minimum(start + KV_CHUNK, hi + 1), KV_BLOCK):
            kb, vb, key_pos = A._block_kv(k, v, page_row, lo // KV_BLOCK, hi, page_size, stride_page, stride_slot,
                                          KV_BLOCK, D, PAGE_SHIFT, pages, start)
            m, l, acc = A._fold_block(q_tile, kb, vb, key_pos, pos, m, l, acc, qk_scale, KV_BLOCK, SWAP)
            _stamp(trace, 2 + tl.minimum(n_blk, MAX_BLOCKS_C - 1), tl.max(m, 0))
            n_blk += 1
        A._store_chunk_state(part_m, part_l, part_acc, first + chunk * GROUP, keep, m, A._tile_sums(l, SWAP), acc, D,
                             SWAP)
    tl.store(trace + BLOCKS_C, n_blk.to(tl.int64))
    mine = (n_need - 1 - p) // per_split + 1
    tl.debug_barrier()
    ticket = tl.atomic_add(tickets + pair, mine, sem="acq_rel", scope="gpu")
    _stamp(trace, 2 + MAX_BLOCKS_C, ticket.to(tl.float32))
    if ticket + mine == n_need:
        tl.atomic_xchg(tickets + pair, 0, sem="relaxed", scope="gpu")
        if MERGE_FORM == 0:
            A._merge_chunk_states(part_m, part_l, part_acc, out, lse, pair, n_chunks, n_need, begin, kv_head,
                                  n_heads, GROUP, MERGE_ROWS, D)
        else:
            _merge_form(part_m, part_l, part_acc, out, lse, pair, n_chunks, n_need, begin, kv_head, n_heads, GROUP,
                        MERGE_ROWS, D, MERGE_FORM)
        _stamp(trace, 3 + MAX_BLOCKS_C, 0.0)


@triton.jit
def _merge_form(part_m, part_l, part_acc, out, lse, tail, n_chunks, n_need, begin, kv_head, n_heads,
                GROUP: tl.constexpr, MERGE_ROWS: tl.constexpr, D: tl.constexpr, FORM: tl.constexpr):
    """_merge_chunk_states' loop (the same rows, steps of _MERGE_AHEAD states, the same store) with its
    body cut to one part (the module docstring's --merge-forms 1-3), every step masked (as the merge
    ran before its whole steps went unmasked, 4af830d). Timing only."""
    g = tl.arange(0, MERGE_ROWS)
    tok_g, head_g = A._rows(g, begin, 1, kv_head, GROUP)
    first_g = (tail * n_chunks).to(tl.int64) * GROUP + g % GROUP
    m_t = tl.full((MERGE_ROWS,), float("-inf"), tl.float32)
    l_t = tl.zeros((MERGE_ROWS,), tl.float32)
    acc_t = tl.zeros((MERGE_ROWS, D), tl.float32)
    cols = tl.arange(0, D).to(tl.float32)[None, :] * 1e-4
    for c_step in range(0, n_need, A._MERGE_AHEAD):
        for i in tl.static_range(A._MERGE_AHEAD):
            c = c_step + i
            here = c < n_need
            if FORM == 1:
                at = first_g + c * GROUP
                acc_c = tl.load(part_acc + A._tile_offsets(at, D, False), mask=here, other=0.0)
                m_c = tl.load(part_m + at, mask=here, other=0.0)
                l_c = tl.load(part_l + at, mask=here, other=0.0)
            else:  # states from the index: a new maximum every state, so no factor is exactly 1
                m_c = g.to(tl.float32) * 0.1 + c.to(tl.float32) * 0.01
                l_c = m_c + 1.0
                acc_c = cols + c.to(tl.float32) * 1e-3
            if FORM == 2:
                m_n, l_n, acc_n = A._merge(m_t, l_t, acc_t, m_c, l_c, acc_c, False)
                m_t, l_t, acc_t = tl.where(here, m_n, m_t), tl.where(here, l_n, l_t), tl.where(here, acc_n, acc_t)
            else:
                m_t, l_t, acc_t = tl.maximum(m_t, m_c), l_t + l_c, acc_t + acc_c
    A._store_rows(out, lse, tok_g * n_heads + head_g, g < GROUP, m_t, l_t, acc_t, D, False)



def _launch(args, trace: torch.Tensor, null: bool, form: int = 0):
    queries, keys = A._paged_layout(*args[:-3], *args[-2:])
    q = queries.q
    n_seqs, d = queries.n_seqs, q.shape[2]
    group = q.shape[1] // keys.n_heads
    n_chunks = triton.cdiv(keys.max_count, A.KV_CHUNK)
    pairs = n_seqs * keys.n_heads
    cfg = A.TUNING["decode"]
    walks, per_split, stages, _ = A._decode_grid(pairs, n_chunks, resident_programs(q.device), cfg)
    if walks or per_split < 2:
        raise SystemExit(f"probe_decode: {n_seqs} x {keys.max_count} is not an all-split grid ({walks} walks, "
                         f"{per_split} a pair): the probe traces the split path only")
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device=q.device, dtype=torch.float32)
    part_m = torch.empty((pairs, n_chunks, group), device=q.device, dtype=torch.float32)
    part_acc = torch.empty((pairs, n_chunks, group, d), device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    _traced_split_kernel[(pairs * per_split,)](
        q, keys.k, keys.v, out, lse, part_m, part_l, part_acc, zeroed_tickets(q.device, pairs), trace,
        *A._query_args(queries), *A._page_args(keys), q.shape[1], args[-3] * A._LOG2E, n_chunks, per_split,
        GROUP=group, ROWS=A.decode_rows(group, d), MERGE_ROWS=triton.next_power_of_2(group), D=d,
        KV_BLOCK=A.KV_BLOCK, KV_CHUNK=A.KV_CHUNK, PAGE_SHIFT=A.decode_page_shift(keys.page_size),
        SWAP=A.decode_swapped(d), NULL=null, MERGE_FORM=form,
        num_warps=cfg["num_warps"], num_stages=stages)
    return out, pairs * per_split


def _q(values, f) -> str:
    values = sorted(values)
    return f"{f(values[len(values) // 2]):.2f} / {f(values[-1]):.2f}" if values else "-"


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit(__doc__)
    argv = sys.argv[1:]
    forms = [0]
    if "--merge-forms" in argv:
        at = argv.index("--merge-forms")
        if at + 1 >= len(argv):
            raise SystemExit("probe_decode: --merge-forms takes a list, e.g. --merge-forms 0,1,2,3")
        forms = [int(f) if f.isdigit() else -1 for f in argv[at + 1].split(",")]
        if not set(forms) <= {0, 1, 2, 3}:
            raise SystemExit(f"probe_decode: --merge-forms {argv[at + 1]}: the forms are 0-3 (module docstring)")
        del argv[at:at + 2]
    sets = [a for a in argv if "=" in a]
    given = [a for a in argv if "=" not in a]
    for item in sets:
        key, value = item.split("=", 1)
        if key not in A.TUNING["decode"]:
            raise SystemExit(f"probe_decode: {key} is not a TUNING['decode'] key ({', '.join(A.TUNING['decode'])})")
        A.TUNING["decode"][key] = {"True": True, "False": False}.get(value, value if not value.isdigit() else int(value))
    cases = [tuple(map(int, c.split("x"))) for c in (given[0] if given else CASES).split(",")]
    print(f"TUNING['decode'] = {A.TUNING['decode']}", flush=True)
    print("times in us; 'a / b': median / max over programs; blocks: per program", flush=True)
    print("| case | merge form | programs | table | traced | launch floor | start spread | entry->bound | bound->block 1 "
          "| block period | blocks | last block->ticket | merge | span (first entry -> last end) | bits |")
    print("|---" * 15 + "|")
    for (batch, context), form in ((case, form) for case in cases for form in forms):
        args = paged_inputs(batch, context, 1)
        ref = A._paged(*args)
        trace = torch.zeros((batch * 8 * 132 * 4, 2, SLOTS), device="cuda", dtype=torch.int64)
        out, programs = _launch(args, trace, False, form)
        bits = ("same" if torch.equal(out, ref) else "DIFFER") if form == 0 else "timing only"
        table_ms = graph_ms_per_call(lambda: A._paged(*args))
        traced_ms = graph_ms_per_call(lambda: _launch(args, trace, False, form))
        null_ms = graph_ms_per_call(lambda: _launch(args, trace, True))
        trace.zero_()
        _launch(args, trace, False, form)
        torch.cuda.synchronize()
        t = trace[:programs, 0].cpu().tolist()
        cyc = trace[:programs, 1].cpu().tolist()
        ran = [i for i in range(programs) if t[i][BOUND] and t[i][BLOCKS] > 0]
        t0 = min(t[i][ENTRY] for i in range(programs))
        us = lambda ns: ns / 1e3  # noqa: E731
        # clock64 deltas to ns: the programs' own ratio of the two over their whole run
        rate = sorted((t[i][TICKET] - t[i][ENTRY]) / max(1, cyc[i][TICKET] - cyc[i][ENTRY]) for i in ran)[len(ran) // 2]
        cy = lambda c: c * rate / 1e3  # noqa: E731
        nblk = [min(t[i][BLOCKS], MAX_BLOCKS) for i in ran]
        period = [cyc[i][BLOCK0 + b] - cyc[i][BLOCK0 + b - 1] for i, n in zip(ran, nblk) for b in range(1, n)]
        mergers = [i for i in ran if t[i][MERGED]]
        ends = [t[i][MERGED] or t[i][TICKET] for i in ran]
        print(f"| {batch}x{context} | {form} | {programs} | {table_ms * 1e3:.1f} | {traced_ms * 1e3:.1f} | {null_ms * 1e3:.1f} | "
              f"{_q([t[i][ENTRY] - t0 for i in ran], us)} | {_q([cyc[i][BOUND] - cyc[i][ENTRY] for i in ran], cy)} | "
              f"{_q([cyc[i][BLOCK0] - cyc[i][BOUND] for i in ran], cy)} | {_q(period, cy)} | "
              f"{_q(nblk, float)} | {_q([cyc[i][TICKET] - cyc[i][BLOCK0 + n - 1] for i, n in zip(ran, nblk)], cy)} | "
              f"{_q([cyc[i][MERGED] - cyc[i][TICKET] for i in mergers], cy)} | {us(max(ends) - t0):.2f} | "
              f"{bits} |", flush=True)
        sms = {t[i][SM] for i in ran}
        print(f"  ({len(ran)} programs ran on {len(sms)} SMs; {rate:.3f} ns a cycle)", flush=True)
        args = ref = trace = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
