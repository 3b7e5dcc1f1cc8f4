"""The split decode's merge alone (attention._merge_chunk_states, one program a pair, 8 pairs: batch 1
at Qwen3-8B's 8 kv heads), against a two-pass form of it: every state's running maximum (a prefix
maximum, exact in any order) and _merge's factors for a block of states at once, then the chain of
FMAs alone with each state's loads far ahead. The same operations on the same operands: the bits
column compares the two. CUDA graphs; the states sit in L2 (written once, read every replay).

    python benchmarks/probe_merge.py        # (gpu_session.sh probe_merge)

The thirty-fifth session (H100): the table's merge ~190 ns a state alone, the two-pass form 85-135;
inside the decode kernel (ab_decode.py) the two-pass form from 32 states gained only 1.5-2.8% at
batch 1 x 8k-32k and cost 1-3% at 1k-4k, where it was not taken (benchmarks/RESULTS.md).
Compiled alone (sm_90a, 32 registers) ptxas issues each state's loads just before its merge, one
round trip a state, where the decode kernel (164 registers) issues a step's 8 states' loads before
the first merge (both read in cuobjdump's SASS, the thirty-ninth session): the table's time here is
not the in-kernel merge's."""
import sys
from pathlib import Path
import torch
import triton
import triton.language as tl
sys.path.insert(0, str(Path(__file__).parent))
from _harness import graph_ms_per_call  # noqa: E402
from lockstep.kernels._triton import attention as A  # noqa: E402


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _fold2(part_m, part_l, part_acc, scr_a, scr_b, scr_t, first_g, n, GROUP: tl.constexpr, MR: tl.constexpr,
           D: tl.constexpr, NB: tl.constexpr, AHEAD: tl.constexpr):
    run = tl.full((MR,), float("-inf"), tl.float32)
    for base in range(0, n, NB):
        idx = base + tl.arange(0, NB)
        ok = (idx < n)[:, None]
        off = first_g[None, :] + idx[:, None] * GROUP
        m_blk = tl.load(part_m + off, mask=ok, other=float("-inf"))
        l_blk = tl.load(part_l + off, mask=ok, other=0.0)
        m_prev = tl.load(part_m + off - GROUP, mask=ok & (idx > base)[:, None], other=float("-inf"))
        big = tl.maximum(tl.associative_scan(m_blk, 0, _max), run[None, :])
        big_prev = tl.maximum(tl.associative_scan(m_prev, 0, _max), run[None, :])
        a = tl.math.exp2(big_prev - big)
        b = tl.math.exp2(m_blk - big)
        tl.store(scr_a + off, a, mask=ok)
        tl.store(scr_b + off, b, mask=ok)
        tl.store(scr_t + off, l_blk * b, mask=ok)
        run = tl.max(big, 0)
    tl.debug_barrier()
    l = tl.zeros((MR,), tl.float32)
    acc = tl.zeros((MR, D), tl.float32)
    for c_step in range(0, n, AHEAD):
        for i in tl.static_range(AHEAD):
            c = c_step + i
            here = c < n
            at = first_g + c * GROUP
            a = tl.load(scr_a + at, mask=here, other=1.0)
            b = tl.load(scr_b + at, mask=here, other=0.0)
            t = tl.load(scr_t + at, mask=here, other=-0.0)
            acc_c = tl.load(part_acc + A._tile_offsets(at, D, False), mask=here, other=-0.0)
            l = l * a + t
            acc = acc * a[:, None] + acc_c * b[:, None]
    return run, l, acc


@triton.jit
def _merge_only(part_m, part_l, part_acc, scr_a, scr_b, scr_t, out, lse, n_chunks, n_need, GROUP: tl.constexpr,
                D: tl.constexpr, NB: tl.constexpr, AHEAD: tl.constexpr, MODE: tl.constexpr):
    pair = tl.program_id(0)
    if MODE == 0:
        A._merge_chunk_states(part_m, part_l, part_acc, out, lse, pair, n_chunks, n_need, 0, pair, 32, GROUP, GROUP,
                              D)
    else:
        g = tl.arange(0, GROUP)
        first_g = (pair * n_chunks).to(tl.int64) * GROUP + g
        m, l, acc = _fold2(part_m, part_l, part_acc, scr_a, scr_b, scr_t, first_g, n_need, GROUP, GROUP, D, NB, AHEAD)
        A._store_rows(out, lse, pair * GROUP + g, g < GROUP, m, l, acc, D, False)


def main():
    pairs, group, d = 8, 4, 128
    print("| form | NB | ahead | ns a state (16 -> 128) | us at 4 / 16 / 64 | bits |")
    print("|---|---|---|---|---|---|")
    for mode, nb, ahead in [(0, 0, 8), (1, 64, 8), (1, 64, 16), (1, 64, 32), (1, 32, 16), (1, 128, 32)]:
        t, same = {}, True
        for n in (4, 16, 64, 128):
            g = torch.Generator(device="cuda").manual_seed(n)
            part_m = torch.randn(pairs, n, group, device="cuda", generator=g) * 4
            part_l = torch.rand(pairs, n, group, device="cuda", generator=g) * 60 + 1
            part_acc = torch.randn(pairs, n, group, d, device="cuda", generator=g)
            scr = [torch.empty_like(part_m) for _ in range(3)]
            outs = []
            for m_ in (0, mode):
                out = torch.empty(1, 32, d, device="cuda", dtype=torch.bfloat16)
                lse = torch.empty(1, 32, device="cuda")
                fn = lambda out=out, lse=lse, m_=m_: _merge_only[(pairs,)](  # noqa: E731
                    part_m, part_l, part_acc, *scr, out, lse, n, n, GROUP=group, D=d, NB=max(nb, 1), AHEAD=ahead,
                    MODE=m_, num_warps=4)
                fn()
                outs.append((out.clone(), lse.clone(), fn))
            same &= torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
            t[n] = graph_ms_per_call(outs[1][2], 20) * 1e3
        name = "table" if mode == 0 else "two-pass"
        print(f"| {name} | {nb} | {ahead} | {(t[128] - t[16]) * 1e3 / 112:.0f} | {t[4]:.2f} / {t[16]:.2f} / {t[64]:.2f} "
              f"| {'same' if same else 'DIFFER'} |", flush=True)


if __name__ == "__main__":
    main()
