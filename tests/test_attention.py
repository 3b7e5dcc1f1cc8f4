"""Attention: one numerics for training (packed and padded), prefill, chunked prefill and decode,
on contiguous and paged caches, in both backends.

The central check feeds every token of a few sequences through simulated engines (random chunked
prefill then decode, requests sitting out steps at random, the batch order shuffled every step,
pages handed out in random order with page_size != KV_BLOCK) and requires each token's output to
equal, bit for bit, its output in training. Accuracy and gradients are checked against float64.

Backends: "torch" (reference), "triton" (the contract's block sizes) and "triton-small" (blocks
of 16 and chunks of 32 keys, and small backward tiles, so that sequences of ~70 tokens cross many
blocks, chunks and tiles). The Triton backend runs these tests on the GPU when there is one, else in
Triton's interpreter (tests/conftest.py). The GPU tier repeats the central check in bf16 at Qwen3-8B
head shapes and sequences of 1-3k tokens.
"""
import math
import os

import pytest
import torch

import lockstep.kernels as K

# Triton's interpreter turns loop bounds computed in a kernel into ints through a numpy call that
# numpy deprecates; harmless, and not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# Documented accuracy bounds (max abs error against float64, inputs ~ N(0, 1)): float32 sums in a
# different order; bfloat16 also rounds P (and in the reference, the block products) to 8 bits.
OUT_ATOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}
GRAD_ATOL = 1e-5  # float32 gradients
# The Triton backend runs the CPU-tier tests on the GPU when there is one (the interpreter otherwise).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _interpreter_bf16_dot(monkeypatch):
    """Triton 3.6's interpreter multiplies bf16 tl.dot operands as their raw uint16 storage; give it
    float32 copies (exact products, float32 sums: what the GPU's MMA computes). Test-only fix."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def _use_triton(monkeypatch, small_blocks: bool):
    pytest.importorskip("triton")
    from lockstep.kernels._triton import attention as tri

    if small_blocks:  # many blocks, chunks and tiles per sequence of ~70 tokens
        monkeypatch.setattr(tri, "KV_BLOCK", 16)
        monkeypatch.setattr(tri, "KV_CHUNK", 32)
        # forward tiles keep their height: below 64 rows a GPU would switch MMA instruction
        for name, sizes in [("bwd_dkdv", dict(BLOCK_Q=16, BLOCK_KV=16)), ("bwd_dq", dict(BLOCK_Q=32, BLOCK_KV=16))]:
            monkeypatch.setitem(tri.TUNING, name, {**tri.TUNING[name], **sizes})
    if os.environ.get("TRITON_INTERPRET") == "1":
        _interpreter_bf16_dot(monkeypatch)
        if small_blocks:
            # decode tiles swap their dots' operands at these head dims and blocks too (a GPU swaps
            # them only where the M sides stay >= 64, i.e. wgmma: the GPU tier checks those bits)
            monkeypatch.setattr(tri, "_WGMMA_M", 16)
    K.set_backend("triton")
    return tri


@pytest.fixture(params=["torch", "triton", "triton-small"])
def device(request, monkeypatch):
    """Selects a backend; yields the device its tests run on."""
    if request.param == "torch":
        yield "cpu"
        return
    _use_triton(monkeypatch, small_blocks=request.param == "triton-small")
    yield TRITON_DEVICE
    K.set_backend("torch")


@pytest.fixture
def triton_backend(monkeypatch):
    tri = _use_triton(monkeypatch, small_blocks=True)
    yield tri
    K.set_backend("torch")


# ---- data and float64 reference -------------------------------------------------------------------

def _packed(lens, h, hkv, d, dtype=torch.float32, device="cpu"):
    n = sum(lens)
    q, k, v = (torch.randn(n, heads, d, device=device).to(dtype) for heads in (h, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


def _varlen_f64(q, k, v, cu):
    """Dense float64 causal attention per sequence."""
    outs = []
    g = q.shape[1] // k.shape[1]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        kk = k[a:b].double().repeat_interleave(g, 1)
        vv = v[a:b].double().repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), kk) / math.sqrt(q.shape[-1])
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))
    return torch.cat(outs)


def _padded(x, cu, width):
    """Packed [N, ...] -> [B, width, ...], zero after each sequence."""
    out = x.new_zeros((len(cu) - 1, width, *x.shape[1:]))
    for r, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        out[r, : b - a] = x[a:b]
    return out


def _unpadded(x, cu):
    return torch.cat([x[r, : b - a] for r, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist()))])


# ---- simulated engines ----------------------------------------------------------------------------

def _schedule(lens, n_decode, max_chunk, gen):
    """Engine steps, each a list of (request, new tokens) in batch order. Request r's first
    lens[r] - n_decode[r] tokens arrive in chunks of random size (chunked prefill), the rest one per
    step (decode); a request sits out a step at random and the batch order is shuffled every step."""
    done, steps = [0] * len(lens), []
    while any(d < n for d, n in zip(done, lens)):
        batch = []
        for r in torch.randperm(len(lens), generator=gen).tolist():
            left = lens[r] - done[r]
            if left == 0 or torch.rand((), generator=gen) < 0.25:
                continue
            prompt_left = left - n_decode[r]
            new = int(torch.randint(1, min(prompt_left, max_chunk) + 1, (), generator=gen)) if prompt_left > 0 else 1
            batch.append((r, new))
            done[r] += new
        if batch:
            steps.append(batch)
    return steps


def _serve_paged(q, k, v, cu, steps, page_size, gen, vllm_layout=False):
    """Run the steps against a paged cache ([pages, kv heads, page_size, D]; vllm_layout: K and V as
    the two halves of the [pages, kv heads, page_size, 2 * D] that lockstep's vLLM backend allocates,
    kv_layout.py); return every token's output, packed like q."""
    from lockstep.framework.rollout.vllm_plugin.kv_layout import kv_cache_shape, split_kv_cache

    lens = (cu[1:] - cu[:-1]).tolist()
    starts = cu[:-1].tolist()
    pages_of = [-(-n // page_size) for n in lens]
    n_pages = sum(pages_of) + 3
    shape = (n_pages, k.shape[1], page_size, k.shape[2])
    # never-written slots hold NaN: a kernel that lets them into a sum fails loudly
    if vllm_layout:
        kv = torch.full(kv_cache_shape(*shape), float("nan"), dtype=k.dtype, device=k.device)
        k_cache, v_cache = split_kv_cache(kv)
    else:
        k_cache = torch.full(shape, float("nan"), dtype=k.dtype, device=k.device)
        v_cache = torch.full(shape, float("nan"), dtype=v.dtype, device=v.device)
    order = torch.randperm(n_pages, generator=gen).tolist()
    # a row's entries past its pages name a page nothing is written to (NaN; order.pop() leaves
    # order[0]): kernels may load those entries (decode's first chunk's come before the sequence's
    # length), never the keys they name
    table = torch.full((len(lens), max(pages_of) + 2), order[0], dtype=torch.int32, device=q.device)
    for r, n in enumerate(pages_of):
        table[r, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    out, done = torch.full_like(q, float("nan")), [0] * len(lens)
    for i, batch in enumerate(steps):
        rows, qsl, seq_lens = [], [0], []
        for r, new in batch:
            pos = torch.arange(done[r], done[r] + new, device=q.device)
            tok = starts[r] + pos
            k_cache[table[r, pos // page_size].long(), :, pos % page_size] = k[tok]
            v_cache[table[r, pos // page_size].long(), :, pos % page_size] = v[tok]
            rows.append(tok)
            qsl.append(qsl[-1] + new)
            done[r] += new
            seq_lens.append(done[r])
        rows = torch.cat(rows)
        block_table = table[[r for r, _ in batch]]
        as_i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=q.device)
        # every other step passes the maxima as a caller that knows them would (here over-estimated)
        maxima = (max(new for _, new in batch), table.shape[1] * page_size) if i % 2 else (None, None)
        out[rows] = K.paged_attention(q[rows], k_cache, v_cache, block_table, as_i32(seq_lens), as_i32(qsl), None,
                                      *maxima)
    return out


def _serve_contiguous(q, k, v, cu, steps):
    """Run the steps through causal_attention on a contiguous [R, S] cache (the native engine's
    layout): each step's new tokens padded to the longest by repeating a request's last one."""
    lens = (cu[1:] - cu[:-1]).tolist()
    starts = cu[:-1].tolist()
    width = max(lens) + 5
    k_cache = k.new_zeros((len(lens), width, *k.shape[1:]))
    v_cache = v.new_zeros((len(lens), width, *v.shape[1:]))
    out, done = torch.full_like(q, float("nan")), [0] * len(lens)
    for batch in steps:
        tq = max(new for _, new in batch)
        pos = torch.stack([torch.arange(done[r], done[r] + tq, device=q.device).clamp(max=done[r] + new - 1)
                           for r, new in batch])
        requests = [r for r, _ in batch]
        for i, (r, new) in enumerate(batch):
            k_cache[r, pos[i]], v_cache[r, pos[i]] = k[starts[r] + pos[i]], v[starts[r] + pos[i]]
        step_q = torch.stack([q[starts[r] + pos[i]] for i, r in enumerate(requests)])
        res = K.causal_attention(step_q, k_cache[requests], v_cache[requests], pos)
        for i, (r, new) in enumerate(batch):
            out[starts[r] + done[r]: starts[r] + done[r] + new] = res[i, :new]
            done[r] += new
    return out


def _check_every_route(lens, h, hkv, d, dtype, n_decode, max_chunk, page_size, device="cpu"):
    gen = torch.Generator().manual_seed(sum(lens))
    q, k, v, cu = _packed(lens, h, hkv, d, dtype, device)
    train = K.varlen_attention(q, k, v, cu)
    width = max(lens) + 3
    padded = K.causal_attention(_padded(q, cu, width), _padded(k, cu, width), _padded(v, cu, width),
                                torch.arange(width, device=device).expand(len(lens), width))
    assert torch.equal(_unpadded(padded, cu), train), "padded training differs from packed training"
    one_prefill = [[(r, n) for r, n in enumerate(lens)]]
    assert torch.equal(_serve_paged(q, k, v, cu, one_prefill, page_size, gen), train), "prefill differs"
    steps = _schedule(lens, n_decode, max_chunk, gen)
    assert torch.equal(_serve_paged(q, k, v, cu, steps, page_size, gen), train), \
        "paged chunked prefill / decode differs from training"
    assert torch.equal(_serve_contiguous(q, k, v, cu, steps), train), \
        "contiguous chunked prefill / decode differs from training"


# ---- CPU tier ------------------------------------------------------------------------------------

@pytest.mark.parametrize("h,hkv,d,dtype", [(2, 1, 16, torch.float32), (6, 2, 32, torch.bfloat16)])
def test_every_route_gives_the_training_bits(device, h, hkv, d, dtype):
    _check_every_route([70, 23, 41], h, hkv, d, dtype, n_decode=[6, 9, 4], max_chunk=24, page_size=32,
                       device=device)


def test_page_size_smaller_than_block(device):
    _check_every_route([66, 1, 35], 4, 2, 16, torch.float32, n_decode=[3, 0, 5], max_chunk=40, page_size=16,
                       device=device)


def test_page_size_not_a_power_of_two(triton_backend):
    """Decode finds a key's page by a shift where the page size is a power of two
    (decode_page_shift), else by a division: a 24-key page takes the division, same bits."""
    assert [triton_backend.decode_page_shift(n) for n in (1, 16, 64, 1 << 30, 24, 48)] == [0, 4, 6, 30, -1, -1]
    _check_every_route([66, 1, 35], 4, 2, 16, torch.float32, n_decode=[3, 0, 5], max_chunk=40, page_size=24,
                       device=TRITON_DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accuracy_against_float64(device, dtype):
    q, k, v, cu = _packed([70, 9, 33], 4, 2, 32, dtype, device)
    err = (K.varlen_attention(q, k, v, cu).double() - _varlen_f64(q, k, v, cu)).abs().max().item()
    assert err < OUT_ATOL[dtype], f"max abs error {err:.3g} against float64"


@pytest.mark.parametrize("route", ["varlen", "padded"])
def test_gradients_against_float64(device, route):
    lens = [45, 12, 30]
    q, k, v, cu = _packed(lens, 4, 2, 16, device=device)
    grad = torch.randn_like(q)
    if route == "varlen":
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = K.varlen_attention(*inputs, cu)
        grads = torch.autograd.grad(out, inputs, grad)
    else:
        width = max(lens) + 4
        inputs = [_padded(t, cu, width).requires_grad_() for t in (q, k, v)]
        pos = torch.arange(width, device=device).expand(len(lens), width)
        out = K.causal_attention(*inputs, pos)
        padded_grads = torch.autograd.grad(out, inputs, _padded(grad, cu, width))
        for g in padded_grads[1:]:  # keys past a sequence's end are seen by none of its tokens
            assert all(g[r, n:].abs().max() == 0 for r, n in enumerate(lens))
        grads = [_unpadded(g, cu) for g in padded_grads]
    ref_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    refs = torch.autograd.grad(_varlen_f64(*ref_inputs, cu), ref_inputs, grad.double())
    for name, a, r in zip("qkv", grads, refs):
        err = (a.double() - r).abs().max().item()
        assert err < GRAD_ATOL, f"d{name}: max abs error {err:.3g} against float64"


def test_varlen_max_seqlen_moves_no_bit(triton_backend, monkeypatch):
    """max_seqlen (the caller's bound on the longest sequence: no device-to-host read) gives the
    bits of the op without it, forward and backward, exact or over-estimated; the negative control:
    a bound below the longest sequence (the caller's contract broken) leaves its later tiles out.
    Every buffer the op allocates with empty_like starts as NaN here, so a row no program wrote is
    NaN, whatever memory the allocator hands back (a freed output of the same shape holds the very
    bits a left-out row would otherwise be compared with)."""
    q, k, v, cu = _packed([150, 12, 30], 4, 2, 16, device=TRITON_DEVICE)  # 3 tiles of 64 queries x 2 heads
    grad = torch.randn_like(q)
    empty_like = torch.empty_like

    def nan_empty_like(t, *args, **kwargs):
        out = empty_like(t, *args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty_like", nan_empty_like)

    def run(max_seqlen):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = K.varlen_attention(*inputs, cu, None, max_seqlen)
        return (out, *torch.autograd.grad(out, inputs, grad))

    ref = run(None)
    for bound in (150, 200):  # (torch.equal is False wherever a NaN is left)
        assert all(torch.equal(a, b) for a, b in zip(run(bound), ref)), bound
    short = K.varlen_attention(q, k, v, cu, None, 20)  # one 64-query tile a sequence: two of 150's left out
    left_out = torch.isnan(short).all(-1).all(-1)  # (which two follows the grid's order)
    assert int(left_out[:150].sum()) >= 150 - 64 and not left_out[150:].any(), left_out
    assert torch.equal(short[~left_out], ref[0][~left_out].detach())  # what was written is the op's bits


def _last_queries(lens: list[int]):
    """Each sequence's last query at one kv head (4 query heads, head_dim 16) as a decode step: (q
    [B, 1, 4, 16], its training output [B, 4, 16], padded K and V [B, max(lens), 1, 16], positions)."""
    q, k, v, cu = _packed(lens, 4, 1, 16, device=TRITON_DEVICE)
    last = cu[1:] - 1
    pos = (torch.tensor(lens, device=TRITON_DEVICE) - 1)[:, None]
    return q[last][:, None], K.varlen_attention(q, k, v, cu)[last], _padded(k, cu, max(lens)), \
        _padded(v, cu, max(lens)), pos


def _recorded_decode_flags(A, monkeypatch, flag: str) -> list:
    """The list each later decode launch appends the value of its constexpr `flag` to."""
    flags, kernel = [], A._decode_chunk_kernel

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kw: flags.append(kw[flag]) or kernel[grid](*args, **kw)

    monkeypatch.setattr(A, "_decode_chunk_kernel", Spy())
    return flags


def _recorded_decode_grids(A, monkeypatch) -> list:
    """The list each later decode launch appends its _decode_grid result to."""
    grids, real = [], A._decode_grid
    monkeypatch.setattr(A, "_decode_grid", lambda *a: grids.append(real(*a)) or grids[-1])
    return grids


def test_tuning_never_changes_a_bit(triton_backend, monkeypatch):
    q, k, v, cu = _packed([70, 20], 4, 1, 16, device=TRITON_DEVICE)
    last = torch.tensor([[69]], device=TRITON_DEVICE)
    ref = K.varlen_attention(q, k, v, cu)
    decode = K.causal_attention(q[None, 69:70], k[None, :70], v[None, :70], last)
    # other tile heights and warp counts that keep every forward tile on wgmma (>= 64 rows) on a GPU,
    # decode tiles with and without their dots' operands swapped
    for prefill, decode_tiles in [(dict(BLOCK_Q=64, num_warps=4), dict(SWAP=False, MIN_ROWS=128, num_warps=8)),
                                  (dict(BLOCK_Q=256, num_stages=2), dict(SWAP=False, MIN_ROWS=64, num_stages=2)),
                                  (dict(BLOCK_Q=128), dict(SWAP=True, num_stages=3))]:
        monkeypatch.setitem(triton_backend.TUNING, "prefill", {**triton_backend.TUNING["prefill"], **prefill})
        monkeypatch.setitem(triton_backend.TUNING, "decode", {**triton_backend.TUNING["decode"], **decode_tiles})
        assert torch.equal(K.varlen_attention(q, k, v, cu), ref)
        assert torch.equal(K.causal_attention(q[None, 69:70], k[None, :70], v[None, :70], last), decode)
    # over a linear K/V (this packed one takes the TMA route), the blocks through descriptors or loads
    assert triton_backend._descriptors(triton_backend._varlen_layout(q, k, v, cu, None)[1], 16)[0] is not None
    for linear in (dict(TMA=False, PREFETCH=True, num_stages=1, GLUON=False),
                   dict(TMA=False, PREFETCH=False, num_stages=2, GLUON=False), dict(TMA=True, num_stages=2, GLUON=False),
                   dict(GLUON=True)):  # (Gluon: 16-bit on Hopper; these float32 inputs take the tl kernel)
        monkeypatch.setitem(triton_backend.TUNING, "prefill_linear", {**triton_backend.TUNING["prefill_linear"], **linear})
        assert torch.equal(K.varlen_attention(q, k, v, cu), ref), linear
    # decode programs per sequence: one walking all 3 chunks, merging in registers (0 asks for none: at
    # least one), or one per chunk, merging the stored states
    for per_sm in (0, 64):
        monkeypatch.setitem(triton_backend.TUNING, "decode", {**triton_backend.TUNING["decode"], "PROGRAMS_PER_SM": per_sm})
        assert torch.equal(K.causal_attention(q[None, 69:70], k[None, :70], v[None, :70], last), decode), per_sm
    # several chunks a program (10 chunks on 4 programs: 3, 3, 2, 2, the last chunk one of its two
    # blocks), in one loop over a program's blocks (FLAT_STAGES) or a loop a chunk, merged in two
    # steps of _MERGE_AHEAD (8) loads, the second with 6 past the last state; 5 chunks on 4
    # programs (2, 1, 1, 1: a program of one chunk takes a loop a chunk either way); and 4 or 3
    # chunks on 4 programs, the kernel built for one chunk a program (ONE_CHUNK)
    assert triton_backend._MERGE_AHEAD.value == 8
    grids = _recorded_decode_grids(triton_backend, monkeypatch)
    one_chunk = _recorded_decode_flags(triton_backend, monkeypatch, "ONE_CHUNK")
    for flat in (0, 5):
        monkeypatch.setitem(triton_backend.TUNING, "decode", {**triton_backend.TUNING["decode"], "PROGRAMS_PER_SM": 1,
                                                              "SPLIT_PER_SM": 1, "FLAT_STAGES": flat})
        for n in (300, 150, 100, 70):
            q, k, v, cu = _packed([n], 4, 1, 16, device=TRITON_DEVICE)
            got = K.causal_attention(q[None, n - 1:], k[None], v[None], torch.tensor([[n - 1]], device=TRITON_DEVICE))
            assert torch.equal(got[0, 0], K.varlen_attention(q, k, v, cu)[n - 1]), (n, flat)
            chunks = -(-n // triton_backend.KV_CHUNK)
            assert grids[-1] == (0, min(4, chunks), triton_backend.TUNING["decode"]["SPLIT_STAGES"], flat), grids[-1]
            assert one_chunk[-1] == (chunks <= 4), (n, one_chunk)


def test_decode_split_two_ways_and_a_wave_of_walks_keep_the_bits(triton_backend, monkeypatch):
    """Pairs split two ways: each program's chunks stored, interleaved, and merged in chunk order.
    Every decoded row keeps training's bits at odd and even chunk counts (1-5 chunks of the fixture's
    32 keys), on the deeper split ring (a program's chunks in one loop over their blocks, FLAT_STAGES,
    or a loop a chunk) and on the table's. Pairs that fill WALK_FILL of the SMs, one each, walk whole
    instead (one program a pair, its chunks merged in registers): the same bits."""
    A = triton_backend
    lens = [64, 20, 160, 96]  # 4 single-query sequences at one kv head: 2, 1, 5 and 3 chunks
    q, train, k_b, v_b, pos = _last_queries(lens)
    grids = _recorded_decode_grids(A, monkeypatch)
    outs = {}
    # (4 pairs on the interpreter's 4 "SMs": 2 programs a pair either way)
    for split_per_sm, flat in ((2, 5), (2, 4), (2, 0), (0, 0)):
        monkeypatch.setitem(A.TUNING, "decode", {**A.TUNING["decode"], "PROGRAMS_PER_SM": 2,
                                                 "SPLIT_PER_SM": split_per_sm, "FLAT_STAGES": flat, "WALK_FILL": 0})
        outs[split_per_sm, flat] = K.causal_attention(q, k_b, v_b, pos)[:, 0]
        assert grids[-1][:2] == (0, 2), (split_per_sm, flat, grids)
    # 4 pairs fill the 4 "SMs" (72% would do): a wave of walks
    monkeypatch.setitem(A.TUNING, "decode", {**A.TUNING["decode"], "PROGRAMS_PER_SM": 2, "WALK_FILL": 0.72})
    outs["walks"] = K.causal_attention(q, k_b, v_b, pos)[:, 0]
    assert grids[-1] == (4, 1, A.TUNING["decode"]["WALK_STAGES"], 0), grids[-1]
    for key, got in outs.items():
        assert torch.equal(got, train), key


def test_decode_split_merges_whole_steps_of_chunk_states_with_the_training_bits(triton_backend, monkeypatch):
    """Pairs split two ways over 8, 10 and 17 chunks (the fixture's 32 keys each): the last program of
    a pair merges the chunk states _MERGE_AHEAD at a time, whole steps without masks and a part-full
    last step with them (_merge_chunk_states): every decoded row keeps training's bits."""
    A = triton_backend
    lens = [256, 300, 530]  # 8 chunks (one whole step), 10 (a whole step and 2), 17 (two and 1)
    q, train, k_b, v_b, pos = _last_queries(lens)
    grids = _recorded_decode_grids(A, monkeypatch)
    monkeypatch.setitem(A.TUNING, "decode", {**A.TUNING["decode"], "PROGRAMS_PER_SM": 2, "SPLIT_PER_SM": 2,
                                             "FLAT_STAGES": 5, "WALK_FILL": 0})
    out = K.causal_attention(q, k_b, v_b, pos)[:, 0]
    assert grids[-1][:2] == (0, 2), grids  # a grid of splits alone, two programs a pair
    assert torch.equal(out, train)


def test_decode_grid_splits_its_last_waves_pairs_with_the_walks_bits(triton_backend, monkeypatch):
    """More (sequence, kv head) pairs than a wave's slots: the pairs of the last, part-full wave split
    across programs (SPLIT_TAIL) in the walks' launch, and every decoded row keeps the bits of the
    all-walks grid and of training."""
    A = triton_backend
    lens = [70, 20, 45, 33, 64, 90, 7, 50, 81, 38]  # 10 single-query sequences at one kv head: 10 pairs
    q, train, k_b, v_b, pos = _last_queries(lens)
    grids = _recorded_decode_grids(A, monkeypatch)
    slots = 2 * A.resident_programs(q.device)  # two programs an SM: a wave of this many
    assert 10 % slots and slots // (10 % slots) > 1  # a last wave of walks part full, fewer than half its slots
    outs = {}
    # (the walk's deeper ring at one program an SM would take more waves: the rule keeps the table's)
    for per_sm, split_tail in [(0, True), (2, True), (2, False), (64, True)]:
        monkeypatch.setitem(A.TUNING, "decode", {**A.TUNING["decode"], "PROGRAMS_PER_SM": per_sm, "WALK_PER_SM": 1,
                                                 "SPLIT_TAIL": split_tail})
        outs[per_sm, split_tail] = K.causal_attention(q, k_b, v_b, pos)[:, 0]
    tail = 10 % slots
    walks, per_split, _, flat = grids[1]
    assert (walks, per_split, flat) == (10 - tail, min(3, slots // tail), 0), grids  # the mixed grid: a loop a chunk
    assert grids[0][:2] == grids[2][:2] == (10, 1) and grids[3][0] == 0, grids  # walks only; splits only
    for key, got in outs.items():
        assert torch.equal(got, train), key


def test_decode_grid_rule_on_an_h200():
    """The decode grid at Qwen3-8B's 8 kv heads on an H200's 132 SMs (3 programs an SM: 396 slots;
    a grid of splits alone 2 an SM on its deeper ring, 264 slots, where each pair still splits)."""
    from lockstep.kernels._triton import attention as A

    cfg = A.TUNING["decode"]
    assert (cfg["SPLIT_STAGES"], cfg["SPLIT_PER_SM"], cfg["FLAT_STAGES"]) == (3, 2, 5)
    grid = lambda batch, keys: A._decode_grid(batch * 8, -(-keys // A.KV_CHUNK), 132, cfg)  # noqa: E731
    # one wave of splits, at most a chunk each; a program of several chunks in one loop on FLAT_STAGES' ring
    assert grid(1, 16384) == (0, 33, 3, 5) and grid(1, 1024) == (0, 4, 3, 5)
    assert grid(11, 4096) == (0, 3, 3, 5) and grid(8, 1024) == (0, 4, 3, 5)
    # walks, one a pair and at most WALK_PER_SM (2) an SM, that fill at least WALK_FILL (72%) of their
    # waves of one an SM: on the deeper ring (96-132 pairs: 1 wave; 191-264: 2)
    assert cfg["WALK_FILL"] == 0.72 and cfg["WALK_PER_SM"] == 2
    for batch, keys in ((12, 16384), (13, 1024), (16, 4096), (16, 32768), (24, 1024), (24, 32768)):
        assert grid(batch, keys) == (batch * 8, 1, cfg["WALK_STAGES"], 0), (batch, keys)
    assert A._decode_grid(128, 16, 132, {**cfg, "WALK_FILL": 0}) == (0, 2, 3, 5)  # (0: never)
    # walks that would fill less: 1 a pair on the deeper ring, or the table's ring, a loop a chunk (3
    # an SM fit)
    assert grid(17, 4096) == (0, 2, 2, 0) and grid(20, 4096) == (0, 2, 2, 0) and grid(23, 4096) == (0, 2, 2, 0)
    assert grid(25, 4096) == (200, 1, cfg["WALK_STAGES"], 0)
    assert grid(64, 4096) == (512, 1, cfg["WALK_STAGES"], 0)  # walks whose deeper ring costs no wave
    assert grid(128, 1024) == (1024, 1, 2, 0)  # a last wave of 232 walks: too full to split
    assert grid(256, 1024) == (1980, 4, 2, 0) and grid(256, 16384) == (1980, 5, 2, 0)  # 68 pairs split 4 / 5 ways
    assert A._decode_grid(2048, 64, 132, {**cfg, "SPLIT_TAIL": False}) == (2048, 1, 2, 0)


def test_decode_cluster_rule_on_an_h200():
    """Which decode grids run their pairs as thread-block clusters (TUNING["decode"]'s CLUSTER_MAX,
    CLUSTER_FILL) at Qwen3-8B's 8 kv heads and head_dim 128 on 132 SMs: one-chunk splits alone, a
    power of two of CTAs a pair that holds its chunks (at most 8), at most 3/4 of the SMs in all."""
    from lockstep.kernels._triton import attention as A

    cfg = A.TUNING["decode"]
    assert (cfg["CLUSTER_MAX"], cfg["CLUSTER_FILL"]) == (8, 0.75)

    def cluster(batch, keys, table=cfg, head_dim=128):
        n_chunks = -(-keys // A.KV_CHUNK)
        walks, per_split, _, _ = A._decode_grid(batch * 8, n_chunks, 132, table)
        return A._decode_cluster(walks, per_split, n_chunks, batch * 8, 132, head_dim, table)

    assert [cluster(1, keys) for keys in (256, 257, 512, 700, 1024, 1500, 2048, 2049, 4096, 16384)] == [
        1, 2, 2, 4, 4, 8, 8, 1, 1, 1]  # one chunk: nothing to merge; 9+ chunks: 16 CTAs a pair
    assert cluster(2, 1024) == 4 and cluster(4, 512) == 2 and cluster(3, 1024) == 4 and cluster(6, 512) == 2  # 64-96 CTAs
    assert cluster(4, 1024) == 1 and cluster(2, 2048) == 1 and cluster(3, 2048) == 1  # 128-192: over 3/4 of the SMs
    assert cluster(3, 2048, {**cfg, "CLUSTER_FILL": 2.0}) == 8
    assert cluster(1, 4096, {**cfg, "CLUSTER_MAX": 16, "CLUSTER_FILL": 1.0}) == 16 and cluster(1, 1024, {**cfg, "CLUSTER_MAX": 0}) == 1
    assert cluster(1, 1024, head_dim=96) == 4 and cluster(1, 2048, head_dim=100) == 1  # a share of columns each
    assert cluster(16, 1024) == 1  # walks
    assert cluster(1, 1024, {**cfg, "num_warps": 8}) == 1  # (the occupancy query counts 128-thread CTAs)


def test_decode_walk_takes_its_deep_ring_only_where_that_costs_no_wave():
    """The one-program decode walk's ring (TUNING["decode"]["WALK_STAGES"], WALK_PER_SM programs an
    SM) against the table's (PROGRAMS_PER_SM an SM): on an H200's 132 SMs at Qwen3-8B's 8 kv heads,
    only batches whose walks fit the same number of waves take it (12-16, 24-33 and 50-66 among those
    that walk: 12-16 and 24 by WALK_FILL, below 25 otherwise a sequence's chunks split across programs)."""
    from lockstep.kernels._triton import attention as A

    cfg = A.TUNING["decode"]
    assert (cfg["PROGRAMS_PER_SM"], cfg["WALK_PER_SM"]) == (3, 2)
    assert [b for b in range(1, 400) if A._walk_fits(b * 8, 132, cfg)] == [*range(1, 34), *range(50, 67)]
    assert not A._walk_fits(512, 132, {**cfg, "WALK_PER_SM": 1})  # 4 waves of one against 2 of three


_MMA_PROBE = r"""
import json
from sm90 import compile_sm90
from lockstep.kernels._triton import attention as A
from lockstep.kernels._triton.splitk_ws import gluon_layout

INTS = {"stride_table", "page_size", "stride_page", "stride_head", "stride_slot", "n_heads", "min_queries", "n_chunks",
        "n_seqs", "n_walks", "per_split", "table_width"}
POINTEE = {"lse": "fp32", "tickets": "i32", "part_m": "fp32", "part_l": "fp32", "part_acc": "fp32", "q_begin": "i32",
           "q_count": "i32", "q_pos": "i32", "page_table": "i32"}
types = lambda n: "fp32" if n == "qk_scale" else "i32" if n in INTS else "*" + POINTEE.get(n, "bf16")
common = dict(GROUP=4, D=128, KV_BLOCK=A.KV_BLOCK, KV_CHUNK=A.KV_CHUNK)
cfg = A.TUNING["prefill"]
prefill = compile_sm90(A._prefill_kernel, types, dict(BLOCK_Q=cfg["BLOCK_Q"], PREFETCH=cfg["PREFETCH"], FROM_LENS=True,
                       TMA=False, k_desc=None, v_desc=None, **common), cfg["num_warps"], cfg["num_stages"])
cfg = A.TUNING["prefill_linear"]
desc = f"tensordesc<bf16[{A.KV_BLOCK}, 128]>"
linear = compile_sm90(A._prefill_kernel, lambda n: desc if n.endswith("_desc") else types(n),
                      dict(BLOCK_Q=cfg["BLOCK_Q"], PREFETCH=cfg["PREFETCH"], FROM_LENS=False, TMA=cfg["TMA"], **common),
                      cfg["num_warps"], cfg["num_stages"])
WS_INTS = {"stride_table", "stride_page", "stride_slot", "n_heads", "kv_width", "n_seqs", "page_rows", "head_rows",
           "head_cols"}
ws_desc = lambda box: f"tensordesc<bf16[{box}, 128],{gluon_layout([box, 128])!r}>"
# training's linear K/V: host descriptors in boxes of a block
gluon, gluon_q_regs = (compile_sm90(A._prefill_ws_kernel, lambda n: ws_desc(A.KV_BLOCK) if n.endswith("_all") else "i32"
                                    if n in WS_INTS else types(n),
                                    dict(GROUP=4, D=128, KV_BLOCK=A.KV_BLOCK, KV_CHUNK=A.KV_CHUNK, BOX=A.KV_BLOCK,
                                         STAGES=cfg["GLUON_STAGES"], FROM_LENS=False, Q_REGS=q_regs), 4, 1,
                                    wgmma_loops=True)
                       for q_regs in (False, True))
# vLLM's prefill: 16-key pages, positions from the sequence lengths
cfg = A.TUNING["prefill"]
gluon_paged = compile_sm90(A._prefill_ws_kernel, lambda n: ws_desc(16) if n.endswith("_all") else "i32"
                           if n in WS_INTS else types(n), dict(GROUP=4, D=128, KV_BLOCK=A.KV_BLOCK,
                           KV_CHUNK=A.KV_CHUNK, BOX=16, STAGES=cfg["GLUON_STAGES"], FROM_LENS=True,
                           Q_REGS=cfg["GLUON_Q_REGS"]), 4, 1, wgmma_loops=True)
bwd_types = lambda n: "fp32" if n in ("qk_scale", "scale") else "*fp32" if n == "delta" else types(n)
cfg = A.TUNING["bwd_dkdv"]
dkdv = compile_sm90(A._bwd_dkdv_kernel, lambda n: "*i32" if n == "kv_count" else bwd_types(n),
                    dict(GROUP=4, D=128, BLOCK_Q=cfg["BLOCK_Q"], BLOCK_KV=cfg["BLOCK_KV"]), cfg["num_warps"],
                    cfg["num_stages"])
dkdv_gluon = compile_sm90(A._bwd_dkdv_ws_kernel, lambda n: "*i32" if n == "kv_count" else "i32" if n in WS_INTS
                          | {"stride_head"} else bwd_types(n), dict(GROUP=4, D=128, STAGES=cfg["GLUON_STAGES"]),
                          4, 1)
cfg = A.TUNING["bwd_dq"]
dq = compile_sm90(A._bwd_dq_kernel, lambda n: f"tensordesc<bf16[{cfg['BLOCK_KV']}, 128]>" if n.endswith("_desc")
                  else bwd_types(n), dict(GROUP=4, D=128, BLOCK_Q=cfg["BLOCK_Q"], BLOCK_KV=cfg["BLOCK_KV"], TMA=True),
                  cfg["num_warps"], cfg["num_stages"])
dq_gluon, dq_gluon_q_regs = (compile_sm90(A._bwd_dq_ws_kernel, lambda n: "i32" if n in WS_INTS else bwd_types(n),
                                          dict(GROUP=4, D=128, BLOCK_KV=cfg["BLOCK_KV"], STAGES=cfg["GLUON_STAGES"],
                                               Q_REGS=q_regs), 4, 1) for q_regs in (False, True))
cfg = A.TUNING["decode"]
# (grids of splits only, of walks only (" in registers"; " deep": on the walk's ring) and of both)
kinds = {"": (False, True), " in registers": (True, False), " mixed": (True, True)}
split = dict(FLAT_STAGES=0)  # (a program's several chunks in one loop: the deeper split ring's alone)
decode = {f"{'swapped' if swap else 'padded'}{kind}{' deep' if deep else ''}":
          compile_sm90(A._decode_chunk_kernel, types, dict(ROWS=16 if swap else cfg["MIN_ROWS"], MERGE_ROWS=4,
                       WALKS=kinds[kind][0], SPLITS=kinds[kind][1], FROM_LENS=True, PREFETCH=cfg["PREFETCH"],
                       SWAP=swap, PAGE_SHIFT=A.decode_page_shift(16), ONE_CHUNK=False, **common, **split),
                       cfg["num_warps"],
                       cfg["WALK_STAGES" if deep else "num_stages"])
          for swap in (True, False) for kind in kinds
          for deep in ((False, True) if swap and kind == " in registers" else (False,))}
# a grid of splits alone on its deeper ring (" one chunk": of sequences of no more chunks than a pair has
# programs; ", one page a row": over a linear K/V, whose one-entry page table the launch specialises as
# the constant 1; ", clusters of C": each pair's programs a thread-block cluster, _cluster.py)
for name, variant in (("swapped split deep", {}), ("swapped split deep one chunk", dict(ONE_CHUNK=True)),
                      ("swapped split deep, one page a row", dict(PAGE_SHIFT=A.decode_page_shift(1 << 30),
                                                                  table_width=1)),
                      *((f"swapped split deep one chunk, clusters of {c}", dict(ONE_CHUNK=True, CLUSTER=c))
                        for c in (2, 4, 8))):
    decode[name] = compile_sm90(
        A._decode_chunk_kernel, types, {**dict(ROWS=16, MERGE_ROWS=4, WALKS=False, SPLITS=True, FROM_LENS=True,
                                               PREFETCH=cfg["PREFETCH"], SWAP=True, PAGE_SHIFT=A.decode_page_shift(16),
                                               FLAT_STAGES=cfg["FLAT_STAGES"], ONE_CHUNK=False, **common),
                                            **variant},
        cfg["num_warps"], cfg["SPLIT_STAGES"])
print(json.dumps([prefill, linear, gluon, gluon_q_regs, gluon_paged, dkdv, dkdv_gluon, dq, dq_gluon, dq_gluon_q_regs,
                  decode]))
"""


def test_decode_and_prefill_multiply_with_wgmma():
    """The GPU premise of the bitwise contract, checked without a GPU: compiled for sm_90 (bf16,
    Qwen3-8B heads), every dot of the prefill and decode kernels is wgmma (MMA v3): decode tiles with
    the group's heads padded to 64 rows run the prefill's instruction shapes, and swapped decode
    tiles (the heads as the N side) run the same instruction with N = 16, whose elements are the
    same sums (checked on the GPU: test_gpu_decode_tiles_give_the_training_bits). No decode
    kernel spills, and the swapped ones fit the programs an SM that their grids count on."""
    from sm90 import probe

    from lockstep.kernels._triton import attention as A

    (prefill, linear, gluon, gluon_q_regs, gluon_paged, dkdv, dkdv_gluon, dq, dq_gluon, dq_gluon_q_regs,
     decode) = probe(_MMA_PROBE)
    assert {version for version, _ in prefill["mma"]} == {"3"}, f"expected wgmma (MMA v3) only, got {prefill['mma']}"
    # over a linear K/V (TMA loads) the prefill tile runs the same instructions, without spilling, and
    # so does its warp-specialised Gluon form (the consumers' 64-row wgmmas)
    assert linear["mma"] == prefill["mma"] and linear["spill_bytes"] == 0, (linear, prefill)
    assert gluon["mma"] == prefill["mma"] and gluon["spill_bytes"] == 0 and gluon["warp_specialized"], gluon
    # with q in registers (GLUON_Q_REGS: the q.k wgmmas' A operand) the same instructions; the 32 more
    # registers a thread spill 24 bytes, outside the block loops (checked below)
    assert gluon_q_regs["mma"] == prefill["mma"] and gluon_q_regs["spill_bytes"] <= 32, gluon_q_regs
    # ... also over vLLM's paged cache (16-key pages: four boxes a block; positions from the lengths), as
    # the table runs it (q in registers: the same spill)
    assert gluon_paged["mma"] == prefill["mma"], gluon_paged
    assert gluon_paged["spill_bytes"] <= (32 if A.TUNING["prefill"]["GLUON_Q_REGS"] else 0), gluon_paged
    # ... and none of it in either consumer's block loop (nvdisasm): a reload there waits in front of
    # the block's wgmmas. (The persistent forms of the fiftieth session, branch persistent-gluon-forward,
    # reloaded spilled wgmma descriptors there, some among a block's wgmmas, and their program-a-tile
    # forms took 1.10-1.18x this kernel's time, H100; the cause was not isolated.)
    for kernel in (gluon, gluon_q_regs, gluon_paged):
        assert len(kernel["wgmma_loops"]) == 2 and all(loop["spills"] == 0 for loop in kernel["wgmma_loops"]), kernel
    # dK/dV's Gluon form runs the tl kernel's instructions on 64 of its keys a consumer
    # (its consumers hold two [64, D] fp32 accumulators and a tile's products: 76 bytes spilled since a
    # tile's lse and delta are loaded ahead, 152 before; probed)
    assert dkdv_gluon["mma"] == dkdv["mma"] and dkdv_gluon["warp_specialized"], (dkdv_gluon, dkdv)
    assert dkdv_gluon["spill_bytes"] <= 128, dkdv_gluon
    # dQ's Gluon form runs the tl kernel's instructions on 64 rows a consumer, without spilling
    assert dq_gluon["mma"] == dq["mma"] and dq_gluon["warp_specialized"] and dq_gluon["spill_bytes"] == 0, (dq_gluon,
                                                                                                        dq)
    # ... and with q and dO in registers (GLUON_Q_REGS: the A operands of its q.k and dO.v wgmmas)
    assert dq_gluon_q_regs["mma"] == dq["mma"] and dq_gluon_q_regs["spill_bytes"] == 0, dq_gluon_q_regs
    # no decode kernel spills: the swapped ones (the table's), nor the padded ones, whose 64-row tiles
    # hold up to the 255-register limit (the mixed grid, a walk beside splits: 255, probed)
    for name, d in decode.items():
        assert {version for version, _ in d["mma"]} == {"3"}, f"decode ({name}) MMAs {d['mma']}"
        assert d["spill_bytes"] == 0, (name, d)
    for name in ("padded", "padded in registers"):
        assert decode[name]["mma"] == prefill["mma"], f"prefill MMAs {prefill['mma']} != decode ({name}) {decode[name]['mma']}"
    # the programs an SM that the decode grid and the walk's ring rule count on are what fits, in
    # shared memory and in registers
    cfg, per_block = A.TUNING["decode"], 227 * 1024
    for name, per_sm in (("swapped", "PROGRAMS_PER_SM"), ("swapped in registers", "PROGRAMS_PER_SM"),
                         ("swapped in registers deep", "WALK_PER_SM"), ("swapped mixed", "PROGRAMS_PER_SM"),
                         ("swapped split deep", "SPLIT_PER_SM"), ("swapped split deep one chunk", "SPLIT_PER_SM")):
        assert decode[name]["mma"] == [["3", "[16, 16, 16]"]], (name, decode[name])
        assert decode[name]["regs"] * 32 * cfg["num_warps"] * cfg[per_sm] <= 65536, (name, decode[name])
    assert per_block // decode["swapped"]["shared_bytes"] == cfg["PROGRAMS_PER_SM"], decode["swapped"]
    assert per_block // decode["swapped in registers"]["shared_bytes"] == cfg["PROGRAMS_PER_SM"], decode
    assert per_block // decode["swapped mixed"]["shared_bytes"] == cfg["PROGRAMS_PER_SM"], decode
    assert per_block // decode["swapped in registers deep"]["shared_bytes"] == cfg["WALK_PER_SM"], decode
    assert per_block // decode["swapped split deep"]["shared_bytes"] == cfg["SPLIT_PER_SM"], decode
    assert per_block // decode["swapped split deep one chunk"]["shared_bytes"] == cfg["SPLIT_PER_SM"], decode
    # the prefill tile holds the next block's K/V in registers (TUNING["prefill"]["PREFETCH"]): the
    # measured winner spills 8 bytes on packed sequences and 68 on the paged layout (probed here);
    # more would mean the table no longer fits the tile
    assert prefill["spill_bytes"] <= 128, prefill


_ABLATION_PROBE = r"""
import json
from sm90 import compile_sm90
from lockstep.kernels._triton import attention as A
from lockstep.kernels._triton.splitk_ws import gluon_layout

INTS = {"stride_table", "page_size", "stride_slot", "n_heads", "min_queries", "n_seqs", "kv_width", "page_rows",
        "head_rows", "head_cols"}
POINTEE = {"lse": "fp32", "q_begin": "i32", "q_count": "i32", "q_pos": "i32", "page_table": "i32"}
types = lambda n: "fp32" if n == "qk_scale" else "i32" if n in INTS else "*" + POINTEE.get(n, "bf16")
desc = f"tensordesc<bf16[{A.KV_BLOCK}, 128],{gluon_layout([A.KV_BLOCK, 128])!r}>"
cfg = A.TUNING["prefill_linear"]
# training's linear K/V: host descriptors in boxes of a block
print(json.dumps({ablate: compile_sm90(A._prefill_ws_kernel, lambda n: desc if n.endswith("_all") else types(n), dict(
    GROUP=4, D=128, KV_BLOCK=A.KV_BLOCK, KV_CHUNK=A.KV_CHUNK, BOX=A.KV_BLOCK,
    STAGES=cfg["GLUON_STAGES"], FROM_LENS=False, Q_REGS=cfg["GLUON_Q_REGS"], ABLATE=ablate), 4, 1,
    count=("ex2", "max.f32", "mul.f32", "wgmma.mma_async", "wgmma.mma_async.sync.aligned.m64n16k16",
           "cp.async.bulk.tensor", "mbarrier.try_wait", "tensormap"))
    for ablate in (0, 1, 2, 4, 8, 16, 32)}))
"""


def test_probe_prefill_ablations_leave_out_their_work():
    """benchmarks/probe_prefill.py times the Gluon forward with parts of its consumers' work left out
    (ABLATE); compiled for sm_90a, each variant lacks exactly its part, so that its time says what
    that part costs: no softmax, no exponentials and maxima a key (the merges keep theirs) but the
    same rescale; no row sums, no m64n16 wgmmas; no rescale, no multiplies of the chunk state (and
    no alpha: its exponentials go too) but every wgmma; no MMAs, the ring's copies and waits alone;
    no loads, every wgmma and exponential but no copy and no consumer's wait; host ends, no
    descriptor made on the device but every copy, wgmma and exponential."""
    from sm90 import probe

    whole, no_softmax, no_row_sums, no_rescale, no_mma, no_loads, host_ends = probe(_ABLATION_PROBE).values()
    wgmmas = whole["ptx"]["wgmma.mma_async"]
    assert whole["mma"] == [["3", "[16, 128, 16]"], ["3", "[16, 16, 16]"], ["3", "[16, 64, 16]"]], whole
    assert no_softmax["ptx"]["ex2"] * 8 < whole["ptx"]["ex2"], (whole, no_softmax)
    assert no_softmax["ptx"]["max.f32"] * 4 < whole["ptx"]["max.f32"], (whole, no_softmax)
    assert no_softmax["ptx"]["wgmma.mma_async"] == wgmmas and no_softmax["mma"] == whole["mma"]
    assert whole["ptx"]["mul.f32"] - no_softmax["ptx"]["mul.f32"] < 32, (whole, no_softmax)  # (the max's scale a row)
    ones_dots = "wgmma.mma_async.sync.aligned.m64n16k16"
    assert whole["ptx"][ones_dots] > 0 and no_row_sums["ptx"][ones_dots] == 0, (whole, no_row_sums)
    assert no_row_sums["ptx"]["wgmma.mma_async"] == wgmmas - whole["ptx"][ones_dots]
    assert no_row_sums["ptx"]["ex2"] == whole["ptx"]["ex2"]
    assert whole["ptx"]["mul.f32"] - no_rescale["ptx"]["mul.f32"] >= 2 * 64, (whole, no_rescale)  # (a block's 64 + 8)
    assert no_rescale["ptx"]["wgmma.mma_async"] == wgmmas and no_rescale["mma"] == whole["mma"]
    assert no_rescale["ptx"]["ex2"] < whole["ptx"]["ex2"]
    # no variant spills more than the whole (the table's q in registers: 16-24 bytes outside the block
    # loop): a variant's time is its work's, not a spill's
    assert all(v["spill_bytes"] <= whole["spill_bytes"] <= 32 for v in (no_softmax, no_row_sums, no_rescale))
    copies, waits = whole["ptx"]["cp.async.bulk.tensor"], whole["ptx"]["mbarrier.try_wait"]
    assert copies > 0 and no_mma["ptx"]["cp.async.bulk.tensor"] == copies, (whole, no_mma)
    assert no_mma["ptx"]["wgmma.mma_async"] == 0 and no_mma["ptx"]["ex2"] == 0, no_mma
    assert 0 < no_mma["ptx"]["mbarrier.try_wait"], no_mma
    assert no_loads["ptx"]["cp.async.bulk.tensor"] == 0, no_loads
    assert no_loads["ptx"]["mbarrier.try_wait"] < waits, (whole, no_loads)  # (the producer's waits stay)
    assert no_loads["ptx"]["wgmma.mma_async"] == wgmmas and no_loads["ptx"]["ex2"] == whole["ptx"]["ex2"]
    assert whole["ptx"]["tensormap"] > 0 and host_ends["ptx"]["tensormap"] == 0, (whole, host_ends)
    assert {op: host_ends["ptx"][op] for op in ("wgmma.mma_async", "ex2", "cp.async.bulk.tensor")} == \
        {op: whole["ptx"][op] for op in ("wgmma.mma_async", "ex2", "cp.async.bulk.tensor")}, (whole, host_ends)


def test_custom_ops(triton_backend):
    q, k, v, cu = _packed([19, 5], 4, 2, 16, device=TRITON_DEVICE)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.lockstep.varlen_attention, (q, k, v, cu, 0.25), test_utils=checks)
    torch.library.opcheck(torch.ops.lockstep.varlen_attention, (q, k, v, cu, 0.25, 19), test_utils=checks)
    pos = torch.arange(19, device=TRITON_DEVICE).expand(2, 19)
    padded = [_padded(t, cu, 19) for t in (q, k, v)]
    torch.library.opcheck(torch.ops.lockstep.causal_attention, (*padded, pos, 0.25), test_utils=checks)
    cache = k.new_zeros(4, 2, 16, 16)
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=TRITON_DEVICE)
    torch.library.opcheck(torch.ops.lockstep.paged_attention,
                          (q, cache, cache, as_i32([[0, 1], [2, 3]]), as_i32([19, 5]), cu, 0.25, 19, 19),
                          test_utils=checks[::2])


@pytest.mark.parametrize("hkv,d", [(2, 16), (3, 24)])  # a kv-head count and head dim off the powers of two
def test_write_paged_kv_copies_into_the_slots(device, hkv, d):
    """New keys/values land exactly in their [block, head, offset] slots of both cache views of one
    buffer (vLLM's [blocks, kv heads, page, 2 * D] layout); padding rows (-1) write nothing. Block 0
    stays unassigned, as vLLM's null block is (the torch reference parks padding rows there)."""
    page, blocks = 4, 6
    kv = torch.full((blocks, hkv, page, 2 * d), float("nan"), device=device)
    k_cache, v_cache = kv[..., :d], kv[..., d:]
    slots = torch.tensor([5, -1, 7, 23, -1, 9], device=device)
    key = torch.randn(6, hkv, d, device=device)
    value = torch.randn(6, 3 * hkv, d, device=device)[:, hkv:2 * hkv]  # a row view (of a fused q/k/v output)
    K.write_paged_kv(key, value, k_cache, v_cache, slots[:5])  # the last row has no slot: not written
    expect = torch.full_like(kv, float("nan"))
    for row, slot in enumerate(slots[:5].tolist()):
        if slot >= 0:
            expect[slot // page, :, slot % page, :d], expect[slot // page, :, slot % page, d:] = key[row], value[row]
    assert torch.equal(kv.nan_to_num(-7.0), expect.nan_to_num(-7.0))
    with pytest.raises(ValueError, match="do not fit the cache"):
        K.write_paged_kv(key[:, :1], value[:, :1], k_cache, v_cache, slots)


def test_shape_errors(device):
    q, k, v, cu = _packed([8], 3, 2, 16, device=device)
    with pytest.raises(ValueError, match="not a multiple of 2 kv heads"):
        K.varlen_attention(q, k, v, cu)
    with pytest.raises(ValueError, match="must hold the same tokens"):
        K.varlen_attention(q[:, :2], k[:4], v[:4], cu)
    with pytest.raises(ValueError, match="all of them in the sequences"):
        K.varlen_attention(q[:, :2], k, v, torch.tensor([0, 5], dtype=torch.int32, device=device))


def test_triton_backward_needs_consecutive_positions(triton_backend):
    q, k, v = (torch.randn(1, 4, 2, 16, device=TRITON_DEVICE, requires_grad=True) for _ in range(3))
    out = K.causal_attention(q, k, v, torch.tensor([[0, 2, 2, 3]], device=TRITON_DEVICE))
    with pytest.raises(ValueError, match="consecutive query positions"):
        out.sum().backward()


# ---- GPU tier: Qwen3-8B heads, bfloat16, sequences of 1-3k tokens -------------------------------

@pytest.fixture
def gpu_triton():
    K.set_backend("triton")
    yield
    K.set_backend("torch")


@pytest.mark.gpu
def test_gpu_every_route_gives_the_training_bits(gpu_triton):
    torch.manual_seed(5)
    _check_every_route([3001, 1024, 1777], 32, 8, 128, torch.bfloat16, n_decode=[70, 130, 3], max_chunk=700,
                       page_size=16, device="cuda")


@pytest.mark.gpu
def test_gpu_accuracy_and_deterministic_backward(gpu_triton):
    q, k, v, cu = _packed([2048, 1000, 77], 32, 8, 128, torch.bfloat16, "cuda")
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = K.varlen_attention(*inputs, cu)
    assert (out.double() - _varlen_f64(q, k, v, cu)).abs().max().item() < OUT_ATOL[torch.bfloat16]
    grad = torch.randn_like(out)
    first = torch.autograd.grad(out, inputs, grad)
    again = torch.autograd.grad(K.varlen_attention(*inputs, cu), inputs, grad)
    assert all(torch.equal(a, b) for a, b in zip(first, again)), "backward is not deterministic"
    ref_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    refs = torch.autograd.grad(_varlen_f64(*ref_inputs, cu), ref_inputs, grad.double())
    for name, a, r in zip("qkv", first, refs):
        rel = ((a.double() - r).norm() / r.norm()).item()
        assert rel < 2e-2, f"d{name}: relative error {rel:.3g} against float64"


@pytest.mark.gpu
@pytest.mark.parametrize("q_regs", [False, True], ids=["q-shared", "q-registers"])
@pytest.mark.parametrize("heads", [32, 16, 8, 64], ids=["group4", "group2", "group1", "group8"])
def test_gpu_warp_specialized_kernels_give_the_tl_kernels_bits(gpu_triton, monkeypatch, heads, q_regs):
    """The Gluon kernels over a linear K/V (the forward, dK/dV and dQ: TUNING["prefill_linear"],
    ["bwd_dkdv"] and ["bwd_dq"] with GLUON) against the tl kernels, packed and padded, bf16, head_dim 128, 8 kv
    heads: the same outputs, lse and gradients, bit for bit, with tails of a block, a chunk and a
    tile, and a sequence shorter than one block. The forward's and dQ's consumers take q (and dQ's
    dO) from shared memory or from registers (GLUON_Q_REGS)."""
    from lockstep.kernels._triton import attention as A

    lens = [3001, 1024, 1777, 77, 5]
    q, k, v, cu = _packed(lens, heads, 8, 128, torch.bfloat16, "cuda")
    assert A._gluon_view(A._varlen_layout(q, k, v, cu, None)[1]) is not None
    # dK/dV's Gluon form takes the table's tiles only: the comparison below runs it against the tl kernel
    assert (A.TUNING["bwd_dkdv"]["BLOCK_KV"], A.TUNING["bwd_dkdv"]["BLOCK_Q"]) == (A._WS_TILE.value, A._WS_HALF.value)
    width = max(lens) + 3
    padded = [_padded(t, cu, width) for t in (q, k, v)]
    pos = torch.arange(width, device="cuda").expand(len(lens), width)

    grad = torch.randn_like(q)
    p_grad = torch.randn_like(padded[0])

    def run(gluon):
        monkeypatch.setitem(A.TUNING, "prefill_linear", {**A.TUNING["prefill_linear"], "GLUON": gluon,
                                                         "GLUON_Q_REGS": q_regs})
        monkeypatch.setitem(A.TUNING, "bwd_dkdv", {**A.TUNING["bwd_dkdv"], "GLUON": gluon})
        monkeypatch.setitem(A.TUNING, "bwd_dq", {**A.TUNING["bwd_dq"], "GLUON": gluon, "GLUON_Q_REGS": q_regs})
        out, lse = torch.ops.lockstep.varlen_attention(q, k, v, cu, 0.088)
        grads = torch.ops.lockstep.varlen_attention_backward(grad, q, k, v, cu, out, lse, 0.088)
        p_out, p_lse = torch.ops.lockstep.causal_attention(*padded, pos, 0.088)
        p_grads = torch.ops.lockstep.causal_attention_backward(p_grad, *padded, pos, p_out, p_lse, 0.088)
        return (out, lse, p_out, p_lse, *grads, *p_grads)

    names = ["out", "lse", "padded out", "padded lse", "dq", "dk", "dv", "padded dq", "padded dk", "padded dv"]
    for name, a, b in zip(names, run(True), run(False), strict=True):
        differ = (a != b).flatten(1).any(1)
        assert not differ.any(), f"{name}: {int(differ.sum())} of {differ.numel()} rows differ"


@pytest.mark.gpu
@pytest.mark.parametrize("page_size,vllm_layout,q_regs", [(16, True, False), (16, True, True), (16, False, False),
                                                          (32, True, False), (64, True, True), (128, False, False),
                                                          (48, True, False)])
def test_gpu_paged_prefill_takes_the_gluon_forward_with_the_training_bits(gpu_triton, monkeypatch, page_size,
                                                                          vllm_layout, q_regs):
    """vLLM's prefill (TUNING["prefill"]["GLUON"]): pages of 16 or 32 keys (boxes of a page), 64 or
    128 (a block's box in one page), vLLM's interleaved K/V or separate K and V caches, one prefill of
    every prompt and a schedule of chunked prefills beside decode steps (a cache of NaN where nothing
    was written): every token's output equals training's (the table's), bit for bit, with the
    prefill's consumers taking q from shared memory or from registers (GLUON_Q_REGS). 48-key pages
    are not a divisor or multiple of the 64-key block: the tl kernel takes them (the same bits)."""
    from lockstep.kernels._triton import attention as A

    monkeypatch.setitem(A.TUNING, "prefill", {**A.TUNING["prefill"], "GLUON_Q_REGS": q_regs})

    calls = []
    real = A._prefill_ws
    monkeypatch.setattr(A, "_prefill_ws", lambda *a, **kw: calls.append(a[1].page_size) or real(*a, **kw))
    gen = torch.Generator().manual_seed(page_size)
    lens = [3001, 1024, 1777, 77, 5]
    q, k, v, cu = _packed(lens, 32, 8, 128, torch.bfloat16, "cuda")
    train = K.varlen_attention(q, k, v, cu)
    calls.clear()
    one_prefill = [[(r, n) for r, n in enumerate(lens)]]
    got = _serve_paged(q, k, v, cu, one_prefill, page_size, gen, vllm_layout)
    assert calls == ([] if page_size == 48 else [page_size]), calls
    differ = (got != train).flatten(1).any(1)
    assert not differ.any(), f"prefill: {int(differ.sum())} tokens differ from training"
    steps = _schedule(lens, [70, 130, 3, 9, 0], 700, gen)
    got = _serve_paged(q, k, v, cu, steps, page_size, gen, vllm_layout)
    differ = (got != train).flatten(1).any(1)
    assert not differ.any(), f"chunked prefill / decode: {int(differ.sum())} tokens differ from training"


@pytest.mark.gpu
@pytest.mark.parametrize("swap", [True, False], ids=["swapped", "padded"])
@pytest.mark.parametrize("per_sm,walk_stages,split_per_sm,flat_stages",
                         [(16, None, 16, None), (16, None, 16, 0), (16, None, 0, None), (16, None, "two-ways", None),
                          (16, None, "one-chunk", None), (0, None, None, None), (0, 2, None, None),
                          (None, None, None, None)],
                         ids=["split", "split-a-loop-a-chunk", "split-2-stages", "split-two-ways", "split-one-chunk",
                              "one-program", "one-program-2-stages", "walks-and-split-tail"])
def test_gpu_decode_tiles_give_the_training_bits(gpu_triton, monkeypatch, swap, per_sm, walk_stages, split_per_sm,
                                                 flat_stages):
    """Decode tiles at Qwen3-8B heads (bf16, head_dim 128, group 4), with the dots' operands swapped
    (the heads as wgmma's N side) or the heads padded to 64 rows, a sequence's chunks split across
    programs (merged through memory) or walked by one program (merged in registers; its ring the
    table's WALK_STAGES deep, as the ~50 x 8 walks here take it, or 2), or both in one grid (a wave's
    slots fewer than the pairs: the last wave's pairs split): each decoded token's output equals its
    training output, bit for bit, at positions across blocks and chunks. A grid of splits alone runs
    on the SPLIT_STAGES ring, or (SPLIT_PER_SM 0) on the table's; "two-ways": as many an SM as split
    each pair two ways on the SPLIT_STAGES ring (each program's 6 chunks in one loop, interleaved);
    "one-chunk": as many as give each chunk a program (the kernel built for that, ONE_CHUNK)."""
    from lockstep.kernels._triton import attention as A

    cfg = {**A.TUNING["decode"], "SWAP": swap, "PROGRAMS_PER_SM": per_sm}
    if walk_stages is not None:
        cfg["WALK_STAGES"] = walk_stages
    if split_per_sm is not None and split_per_sm not in ("two-ways", "one-chunk"):
        cfg["SPLIT_PER_SM"] = split_per_sm
    if flat_stages is not None:
        cfg["FLAT_STAGES"] = flat_stages
    lens = [3000, 1500, 700, 257, 64]  # 3,000 keys: 12 chunks, merged in two steps of _MERGE_AHEAD loads
    gen = torch.Generator().manual_seed(3)
    picks = [(r, p) for r, n in enumerate(lens) for p in {0, n - 1, 63, 64, 255, 256, *torch.randint(0, n, (6,), generator=gen).tolist()}
             if p < n]
    q_b, k_b, v_b, pos, train = _gpu_decode_picks(lens, picks, max(lens))  # (q_b held: the graph below reads it)
    # the grid: one wave of per_sm programs an SM, so 16 splits each of the ~50 x 8 (sequence, kv
    # head) pairs across programs (the split path), and 0 leaves one program each; None: a wave of
    # fewer slots than pairs, the walks off their deeper ring, so the last wave's pairs split
    sms, pairs = torch.cuda.get_device_properties(0).multi_processor_count, len(picks) * 8
    if per_sm is None:
        cfg.update(PROGRAMS_PER_SM=pairs // sms, WALK_PER_SM=1, SPLIT_TAIL=True)
    if split_per_sm == "two-ways":
        cfg.update(SPLIT_PER_SM=-(-2 * pairs // sms))
    if split_per_sm == "one-chunk":
        cfg.update(SPLIT_PER_SM=-(-12 * pairs // sms))
    monkeypatch.setitem(A.TUNING, "decode", cfg)
    assert A.decode_swapped(128) == swap
    walks, per_split, stages, flat = A._decode_grid(pairs, 12, sms, cfg)  # 3,000 keys: 12 chunks
    if per_sm is None:
        assert 0 < walks < pairs and per_split > 1 and not flat, (walks, per_split, pairs, flat)
    elif per_sm:
        assert walks == 0 and 1 < per_split <= 12, (walks, per_split)  # the longest: several chunks a program, or one
        assert (per_split == 2) == (split_per_sm == "two-ways"), per_split
        assert (per_split == 12) == (split_per_sm == "one-chunk"), per_split  # (12 chunks: one a program)
        assert stages == cfg["SPLIT_STAGES" if split_per_sm else "num_stages"], stages
        assert flat == (cfg["FLAT_STAGES"] if split_per_sm else 0), flat
    else:
        assert walks == pairs and stages == cfg["WALK_STAGES"], "the walk should take WALK_STAGES here"
    out = K.causal_attention(q_b, k_b, v_b, pos)[:, 0]
    differ = (out != train).flatten(1).any(1)
    assert not differ.any(), f"decoded tokens differ from training at (sequence, position) " \
                             f"{[picks[i] for i in differ.nonzero().flatten().tolist()]}"
    # replayed from a CUDA graph: each merging program leaves its ticket at zero for the next replay
    # (a call on the capture stream first makes the stream's counters outside the graph, so the
    # graph holds no memset of them)
    assert _replays_give(out, q_b, k_b, v_b, pos)


def _gpu_decode_picks(lens, picks, width=None):
    """Decode steps at Qwen3-8B's heads (bf16, on the GPU) from packed sequences of `lens` tokens:
    pick (r, p) is sequence r's query at position p over its keys 0 .. p, in a batch padded to
    `width` keys (default: the longest pick's). Returns (q_b [B, 1, 32, 128], k_b, v_b, pos [B, 1],
    the picks' training outputs [B, 32, 128])."""
    q, k, v, cu = _packed(lens, 32, 8, 128, torch.bfloat16, "cuda")
    train = K.varlen_attention(q, k, v, cu)
    width = width or max(p for _, p in picks) + 1
    k_b, v_b = k.new_zeros(len(picks), width, 8, 128), v.new_zeros(len(picks), width, 8, 128)
    for i, (r, p) in enumerate(picks):
        k_b[i, : p + 1], v_b[i, : p + 1] = k[cu[r]: cu[r] + p + 1], v[cu[r]: cu[r] + p + 1]
    rows = torch.tensor([int(cu[r]) + p for r, p in picks], device="cuda")
    pos = torch.tensor([[p] for _, p in picks], device="cuda")
    return q[rows][:, None].contiguous(), k_b, v_b, pos, train[rows]


def _replays_give(out, q_b, k_b, v_b, pos, replays=3):
    """Whether causal_attention's decode, captured in a CUDA graph after a call on the capture stream
    outside it, gives `out` at each of `replays` replays (its output zeroed before each). The graph
    reads q_b, k_b, v_b and pos where they are: the caller keeps them."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        K.causal_attention(q_b, k_b, v_b, pos)
    stream.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        captured = K.causal_attention(q_b, k_b, v_b, pos)[:, 0]
    for _ in range(replays):
        captured.zero_()
        graph.replay()
        if not torch.equal(captured, out):
            return False
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("lens,picks,cluster,fill", [
    ([1024], [(0, 1023)], 4, None), ([700], [(0, 699)], 4, None),
    ([2048, 1100], [(0, 2047), (0, 777), (1, 1099)], 8, 2.0), ([1500, 700], [(0, 1499), (0, 300), (1, 699)], 8, 2.0)],
    ids=["1x1k-cluster-4", "1x700-cluster-4-of-3-chunks", "3x2k-cluster-8-any-fill", "3x1.5k-cluster-8-of-6-chunks-any-fill"])
def test_gpu_clustered_decode_gives_the_training_bits(gpu_triton, monkeypatch, lens, picks, cluster, fill):
    """A grid of one-chunk splits alone at batch 1-3 runs each (sequence, kv head) pair's programs as
    one thread-block cluster (TUNING's CLUSTER_MAX): each CTA keeps its chunk's state in its shared
    memory and merges a share of the columns from every CTA's state, where the ticketed split goes
    through memory; a cluster is a power of two of CTAs, so 1,500 or 700 keys (6 or 3 chunks) leave
    CTAs that only merge, and a shorter request more. Each decoded token equals its training output
    bit for bit, as the ticketed split's (CLUSTER_MAX 0) does, eagerly and replayed from a CUDA graph;
    the cluster launch must have run (where it cannot, the launcher takes the ticketed split, which
    the bits alone would not tell apart). Batch 3 runs with CLUSTER_FILL raised (fill): the table's
    keeps 192 CTAs off clusters."""
    from lockstep.kernels._triton import _cluster
    from lockstep.kernels._triton import attention as A

    shipped = A.TUNING["decode"]
    table = shipped if fill is None else {**shipped, "CLUSTER_FILL": fill}
    monkeypatch.setitem(A.TUNING, "decode", table)
    launched, real = [], _cluster.cluster_launch
    monkeypatch.setattr(_cluster, "cluster_launch", lambda *a, **kw: launched.append(real(*a, **kw)) or launched[-1])
    q_b, k_b, v_b, pos, train = _gpu_decode_picks(lens, picks)
    pairs, n_chunks = len(picks) * 8, -(-k_b.shape[1] // A.KV_CHUNK)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    walks, per_split, _, _ = A._decode_grid(pairs, n_chunks, sms, table)
    assert A._decode_cluster(walks, per_split, n_chunks, pairs, sms, 128, table) == cluster, per_split
    if fill is not None:  # the table's fill keeps this grid off clusters
        assert A._decode_cluster(walks, per_split, n_chunks, pairs, sms, 128, shipped) == 1
    out = K.causal_attention(q_b, k_b, v_b, pos)[:, 0]
    assert launched == [True], launched
    differ = (out != train).flatten(1).any(1)
    assert not differ.any(), f"decoded tokens differ from training at {[picks[i] for i in differ.nonzero().flatten()]}"
    monkeypatch.setitem(A.TUNING, "decode", {**table, "CLUSTER_MAX": 0})
    assert torch.equal(K.causal_attention(q_b, k_b, v_b, pos)[:, 0], out) and launched == [True], launched
    monkeypatch.setitem(A.TUNING, "decode", table)
    assert _replays_give(out, q_b, k_b, v_b, pos)
    assert launched == [True] * 3, launched
