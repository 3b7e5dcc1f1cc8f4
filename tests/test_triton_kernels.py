"""The Triton backend of lockstep.kernels (matmul/linear, rms_norm, silu_mul, apply_rope).

CPU tier (Triton's interpreter, small shapes): a row computed alone, inside batches of random sizes
with random neighbours, at random positions, gives the same bits; results and gradients agree
with float64 within the bounds below; the custom ops pass torch.library.opcheck.
GPU tier (@pytest.mark.gpu, Qwen3-8B shapes in bf16): row 0 of every batch size, one per GEMM
tile bucket, equals the row computed alone.
"""
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import lockstep.kernels as K  # noqa: E402

# The interpreter turns a program id used as a loop bound into an int the way NumPy deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

SIZES = [1, 3, 16, 17, 40]
# One M per 16-bit GEMM tile bucket (<=64, <=256, <=1024, larger); the fp32 buckets split at 64.
GEMM_SIZES = SIZES + [130, 300, 1100]
DTYPES = [torch.float32, torch.bfloat16]

# Error bounds against float64 on the same (already rounded) inputs, relative to the magnitude the
# error scales with (e.g. sum_k |a_ik| |b_kj| for a GEMM). fp32: fp32 accumulation and a few
# roundings. bf16: up to two roundings to bf16 (the normalised value, then the output) plus the
# fp32 accumulation. A bf16 rounding costs 2^-8 on a GPU (round-to-nearest-even) but up to 2^-7
# under the interpreter, which converts fp32 to bf16 by truncation (triton 3.6).
REL = {torch.float32: 1e-6, torch.bfloat16: 2 * 2**-7}
# Gradients, as a fraction of the largest reference gradient. bf16 adds the rounding of the
# incoming gradient and of intermediates cast to bf16.
GRAD_REL = {torch.float32: 1e-6, torch.bfloat16: 2**-5}


@pytest.fixture(autouse=True)
def triton_backend():
    before = K.get_backend()
    K.set_backend("triton")
    yield
    K.set_backend(before)


def _assert_row_invariant(fn, make_batch, row, sizes=SIZES):
    """fn(*batch)[pos], with `row` (a tuple of per-row tensors) written at `pos` of a batch of
    random neighbours from make_batch(m), equals fn on the row alone, bit for bit."""
    alone = fn(*(part.unsqueeze(0) for part in row))[0]
    for m in sizes:
        for pos in sorted({0, int(torch.randint(m, ())), m - 1}):
            batch = make_batch(m)
            for full, part in zip(batch, row):
                full[pos] = part
            assert torch.equal(fn(*batch)[pos], alone), f"row changed at batch size {m}, position {pos}"


def _assert_within(out, ref, scale, rel):
    err = (out.double() - ref).abs()
    bound = rel * scale + 1e-30
    assert (err <= bound).all(), f"error exceeds its bound by {(err / bound).max().item():.3g}x"


def _assert_grads_close(grads, refs, dtype):
    for got, ref in zip(grads, refs):
        assert torch.isfinite(got).all()
        assert (got.double() - ref).abs().max() <= GRAD_REL[dtype] * ref.abs().max()


def _leaf(*shape):
    return torch.randn(*shape, requires_grad=True)


def _f64_leaves(*tensors):
    return tuple(t.detach().double().requires_grad_() for t in tensors)


# ---------------------------------------------------------------- GEMM


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(200, 72), (20, 1)])  # K and N tails; unaligned strides (copied)
def test_linear_row_invariant(dtype, k, n):
    w = torch.randn(n, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    _assert_row_invariant(lambda x: K.linear(x, w, bias), lambda m: (torch.randn(m, k).to(dtype),),
                          (torch.randn(k).to(dtype),), sizes=GEMM_SIZES)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_row_invariant(dtype):
    b = torch.randn(96, 40).to(dtype)
    _assert_row_invariant(lambda a: K.matmul(a, b), lambda m: (torch.randn(m, 96).to(dtype),),
                          (torch.randn(96).to(dtype),))


def test_linear_3d_input_and_strides_do_not_change_bits():
    w = torch.randn(24, 64)
    x = torch.randn(3, 5, 64)
    out = K.linear(x, w)
    assert out.shape == (3, 5, 24)
    assert torch.equal(out[1, 4], K.linear(x[1, 4:5], w)[0])
    wide = torch.randn(3, 5, 100)
    wide[..., :64] = x
    w_wide = torch.randn(24, 80)
    w_wide[:, :64] = w
    assert torch.equal(K.linear(wide[..., :64], w_wide[:, :64]), out)
    assert torch.equal(K.matmul(x[0], w.t()), K.matmul(x[0].contiguous(), w.t().contiguous()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_accuracy(dtype):
    x, w, b = torch.randn(37, 200).to(dtype), torch.randn(72, 200).to(dtype), torch.randn(72).to(dtype)
    ref = F.linear(x.double(), w.double(), b.double())
    scale = x.double().abs() @ w.double().abs().t() + b.double().abs()
    _assert_within(K.linear(x, w, b), ref, scale, REL[dtype])
    _assert_within(K.matmul(x, w.t()), x.double() @ w.double().t(), scale, REL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_grad(dtype):
    x = torch.randn(2, 19, 80).to(dtype).requires_grad_()
    w = torch.randn(36, 80).to(dtype).requires_grad_()
    b = torch.randn(36).to(dtype).requires_grad_()
    out = K.linear(x, w, b)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, w, b), g)
    xd, wd, bd = _f64_leaves(x, w, b)
    refs = torch.autograd.grad(F.linear(xd, wd, bd), (xd, wd, bd), g.double())
    _assert_grads_close(grads, refs, dtype)
    again = torch.autograd.grad(K.linear(x, w, b), (x, w, b), g)
    assert all(torch.equal(a, r) for a, r in zip(grads, again)), "backward is not deterministic"


def test_matmul_grad():
    a, b = torch.randn(23, 50, requires_grad=True), torch.randn(50, 30, requires_grad=True)
    out = K.matmul(a, b)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (a, b), g)
    ad, bd = _f64_leaves(a, b)
    _assert_grads_close(grads, torch.autograd.grad(ad @ bd, (ad, bd), g.double()), torch.float32)


def test_gemm_custom_ops_pass_opcheck():
    from lockstep.kernels._triton.matmul import linear_op, matmul_op

    torch.library.opcheck(matmul_op, (_leaf(5, 8), _leaf(8, 4)))
    torch.library.opcheck(linear_op, (_leaf(3, 5, 8), _leaf(4, 8), _leaf(4)))
    torch.library.opcheck(linear_op, (_leaf(3, 8), _leaf(4, 8), None))


def test_gemm_shape_errors():
    with pytest.raises(ValueError, match="matmul expects"):
        K.matmul(torch.randn(3, 4), torch.randn(5, 6))
    with pytest.raises(ValueError, match="linear"):
        K.linear(torch.randn(3, 4), torch.randn(6, 5))
    with pytest.raises(ValueError, match="bias must be"):
        K.linear(torch.randn(3, 4), torch.randn(6, 4), torch.randn(5))
    with pytest.raises(ValueError, match="share dtype"):
        K.matmul(torch.randn(3, 4), torch.randn(4, 6, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_equals_one_linear_per_block(dtype):
    """One launch over a fused weight (block edges off the tile grid, a K tail) gives each block's
    own linear bits."""
    x, w = torch.randn(37, 200).to(dtype), torch.randn(72 + 24 + 24, 200).to(dtype)
    sizes = (72, 24, 24)
    got = K.linear_rows(x, w, sizes)
    assert [tuple(g.shape) for g in got] == [(37, 72), (37, 24), (37, 24)]
    assert all(torch.equal(g, K.linear(x, w[a:a + n])) for g, a, n in zip(got, (0, 72, 96), sizes))
    with pytest.raises(ValueError, match="do not add up"):
        K.linear_rows(x, w, (72, 24))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # masked lanes, interpreter
def test_swapped_gemm_computes_the_same_product(monkeypatch):
    """The swapped-operand GEMM (C^T = W @ X^T, for decode-sized X) writes every element where the
    plain kernel does, with the bias, at row counts that take one, two or several X tiles. Integer
    inputs make every sum exact, so the interpreter's summation order cannot hide an indexing slip;
    that the bits of real inputs agree is the GPU row tests' job (every M bucket's row 0)."""
    from dataclasses import replace

    from lockstep.kernels._triton import matmul_configs as mc

    w = torch.randint(-3, 4, (72, 100)).float()
    bias = torch.randint(-3, 4, (72,)).float()
    xs = {m: torch.randint(-3, 4, (m, 100)).float() for m in (1, 17, 70)}
    plain = {m: (K.linear(x, w), K.linear(x, w, bias)) for m, x in xs.items()}
    monkeypatch.setattr(mc, "CONFIGS_FP32", [(None, replace(mc.CONFIGS_FP32[0][1], block_m=32, swap_ab=True))])
    for m, x in xs.items():
        assert torch.equal(K.linear(x, w), plain[m][0]), f"M={m}"
        assert torch.equal(K.linear(x, w, bias), plain[m][1]), f"M={m}, bias"
        assert torch.equal(plain[m][0], x @ w.t())
    # the row-parallel tree, swapped, at every split (a program's subtree root and the workspace
    # sums written transposed)
    from lockstep.kernels._triton.splitk import row_tree

    swapped = replace(mc.row_config_for(1, torch.float32), block_m=32, swap_ab=True)
    x, w = torch.randint(-3, 4, (70, 128)).float(), torch.randint(-3, 4, (40, 128)).float()
    for m in (1, 17, 70):
        ref = row_tree(x[:m], w, 16, torch.float32)
        for split in (1, 2, 8):
            assert torch.equal(row_tree(x[:m], w, 16, torch.float32, split=split, config=swapped), ref), (m, split)


# ---------------------------------------------------------------- row-parallel GEMM (K-chunk tree)


def _chunk_products(x, w, chunk):
    """Each chunk's fp32 product on its own (a one-chunk tree is the bare chunk GEMM)."""
    from lockstep.kernels._triton.splitk import row_tree

    return [row_tree(x[:, lo:lo + chunk].contiguous(), w[:, lo:lo + chunk].contiguous(), chunk, torch.float32)
            for lo in range(0, x.shape[1], chunk)]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # masked lanes, interpreter
@pytest.mark.parametrize("dtype,k", [(torch.float32, 64), (torch.bfloat16, 512)])  # chunk 8 < BLOCK_K; 64
def test_row_tree_is_the_canonical_tree_at_every_split(dtype, k):
    """The one-launch row-parallel GEMM sums the 8 chunk products in the balanced tree, whichever
    number of programs shares a tile (1: the whole tree in registers; 2/4/8: subtree roots through
    the workspace, the last program to arrive adds them)."""
    from lockstep.kernels.collectives import tree_sum_ranks
    from lockstep.kernels._triton.splitk import row_tree

    x, w = torch.randn(70, k).to(dtype), torch.randn(40, k).to(dtype)
    chunk = k // 8
    parts = _chunk_products(x, w, chunk)
    tree = tree_sum_ranks(parts)
    in_order = parts[0]
    for p in parts[1:]:
        in_order = in_order + p
    assert not torch.equal(tree, in_order), "negative control: another order must give other bits here"
    rounded = row_tree(x, w, chunk, dtype, split=1)
    for split in (1, 2, 4, 8):
        assert torch.equal(row_tree(x, w, chunk, torch.float32, split=split), tree), f"split {split}"
        assert torch.equal(row_tree(x, w, chunk, dtype, split=split), rounded), f"split {split}"
    # a TP rank's share (4 of the 8 chunks): its subtree root, at each split it allows
    half = [row_tree(x[:, :k // 2].contiguous(), w[:, :k // 2].contiguous(), chunk, torch.float32, split=s)
            for s in (1, 2, 4)]
    assert all(torch.equal(h, tree_sum_ranks(parts[:4])) for h in half)
    with pytest.raises(ValueError, match="split 8 must be"):
        row_tree(x[:, :k // 2].contiguous(), w[:, :k // 2].contiguous(), chunk, torch.float32, split=8)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # masked lanes, interpreter
def test_row_tree_over_many_tiles_and_chunk_counts():
    """Split 1 (the whole tree in one program) over many tiles, with 8, 4 and 2 chunks: every tile
    gets its own canonical tree."""
    from lockstep.kernels.collectives import tree_sum_ranks
    from lockstep.kernels._triton.splitk import row_tree

    x, w = torch.randn(260, 64), torch.randn(72, 64)  # fp32 64x32 tiles: 5 x 3 = 15 tiles
    for chunks in (8, 4, 2):
        chunk = 64 // chunks
        tree = tree_sum_ranks(_chunk_products(x, w, chunk))
        assert torch.equal(row_tree(x, w, chunk, torch.float32, split=1), tree), f"{chunks} chunks"


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # masked lanes, interpreter
def test_warp_specialized_configs_compute_the_same_sums(monkeypatch):
    """A warp-specialised config (a producer and two consumer warpgroups on Hopper, 128 MMA rows a
    tile) gives `linear` the same bits as the table's kernels: persistent over several tiles and a
    partial one, and swapped (128 weight rows a tile), and a Gluon one (the tl kernel here: Gluon
    runs only on the GPU, whose tests check its bits). The row-parallel tree takes only the Gluon
    form, which refuses a forced split; the config refuses
    what Triton's Hopper pass cannot split (64 MMA rows, 8 warps), and `linear` more than 4 stages.
    That the pass really splits each table config is test_gemm_table_compiles_to_wgmma's job; the
    GPU row tests check the bits there."""
    from dataclasses import replace

    from lockstep.kernels._triton import matmul_configs as mc
    from lockstep.kernels._triton.splitk import row_tree

    ws = mc.GemmConfig(block_m=128, block_n=32, group_m=2, num_warps=4, num_stages=2, warp_specialize=True)
    swapped = replace(ws, block_m=32, block_n=128, swap_ab=True)
    x, w, bias = torch.randn(300, 96), torch.randn(200, 96), torch.randn(200)
    plain = {m: K.linear(x[:m], w, bias) for m in (1, 40, 130, 300)}
    gluon = replace(ws, gluon=True)  # on the CPU (the interpreter): the tl kernel with its tile
    # a Gluon width of two products (96 = 64 + 32) runs in the tl kernel as its first product's width
    assert mc.tl_tile(replace(gluon, block_n=96, num_stages=8)) == replace(ws, block_n=64, num_stages=4)
    assert mc.tl_tile(replace(gluon, block_n=64, accumulators=2, tma_store=True)) == replace(ws, block_n=64)
    for cfg, ms in ((ws, (1, 130, 300)), (swapped, (1, 40)), (gluon, (1, 130)), (replace(gluon, block_n=96), (130,)),
                    (replace(gluon, block_n=64, tma_store=True), (130,)),
                    (replace(gluon, block_m=32, block_n=64, swap_ab=True, steps_per_stage=2), (1, 40))):
        monkeypatch.setattr(mc, "CONFIGS_FP32", [(None, cfg)])
        for m in ms:
            assert torch.equal(K.linear(x[:m], w, bias), plain[m]), (cfg, m)
    with pytest.raises(ValueError, match="the Gluon kernel \\(gluon=True\\)"):
        row_tree(x, w, 12, torch.float32, config=ws)
    with pytest.raises(ValueError, match="whole tree in one program; split 2"):
        row_tree(x, w, 12, torch.float32, split=2, config=gluon)
    with pytest.raises(ValueError, match="Gluon kernel .* interpreter cannot run"):  # the tree's form: GPU only
        row_tree(x, w, 12, torch.float32, config=gluon)
    for bad in (dict(block_m=64), dict(num_warps=8), dict(block_m=32, block_n=64, swap_ab=True)):
        with pytest.raises(ValueError, match="warp_specialize"):
            replace(ws, **bad)
    for bad in (dict(warp_specialize=False), dict(block_m=256)):
        with pytest.raises(ValueError, match="gluon is the warp-specialised schedule"):
            replace(gluon, **bad)
    swapped_gluon = replace(gluon, block_m=32, block_n=64, swap_ab=True, steps_per_stage=2)  # swap_ws.py
    for bad in (dict(block_n=96), dict(block_m=256), dict(warp_specialize=False)):
        with pytest.raises(ValueError, match="a swapped Gluon tile"):
            replace(swapped_gluon, **bad)
    # two accumulators: the unswapped Gluon tree's schedule, power-of-two tiles up to 128 columns, wgmmas in flight
    assert replace(gluon, block_n=64, accumulators=2).accumulators == 2
    for bad in (dict(accumulators=3), dict(accumulators=2, block_n=96), dict(accumulators=2, wgmma_in_flight=0),
                dict(accumulators=2, block_n=256)):
        with pytest.raises(ValueError, match="accumulators is 1, or 2"):
            replace(gluon, **bad)
    with pytest.raises(ValueError, match="accumulators is 1, or 2"):
        replace(swapped_gluon, accumulators=2)
    # siblings: the unswapped Gluon tree's schedule, one accumulator's registers, power-of-two tiles,
    # wgmmas in flight; the tl kernel runs its tile without it
    assert mc.tl_tile(replace(gluon, block_n=64, siblings=True)) == replace(ws, block_n=64)
    for bad in (dict(accumulators=2), dict(block_n=96), dict(wgmma_in_flight=0)):
        with pytest.raises(ValueError, match="siblings is the unswapped Gluon tree's schedule"):
            replace(gluon, siblings=True, **bad)
    with pytest.raises(ValueError, match="siblings is the unswapped Gluon tree's schedule"):
        replace(swapped_gluon, siblings=True)
    # the row tree's swapped Gluon subtrees run as the tl kernel's tile in the interpreter: the same bits
    tl_swapped = mc.tl_tile(swapped_gluon)
    for split in (1, 2, 4):
        assert torch.equal(row_tree(x[:40], w, 12, torch.float32, split=split, config=swapped_gluon),
                           row_tree(x[:40], w, 12, torch.float32, split=1, config=tl_swapped)), split
    with pytest.raises(ValueError, match="steps_per_stage is the swapped Gluon kernel's"):
        replace(ws, steps_per_stage=2)
    assert mc.tl_tile(swapped_gluon) == replace(swapped_gluon, gluon=False, warp_specialize=False, steps_per_stage=1)
    # the swapped Gluon subtrees' programs fill at most half the SMs: Qwen3-8B's 64 tiles one a tile,
    # a smaller model's 32 two, never more programs than chunks
    from lockstep.kernels._triton import splitk

    monkeypatch.setattr(splitk, "resident_programs", lambda device: 132)
    assert [splitk.half_wave_split(t, 8, torch.device("cpu")) for t in (64, 40, 32, 16, 1)] == [1, 1, 2, 4, 8]
    assert splitk.half_wave_split(1, 2, torch.device("cpu")) == 2
    # swap_ws.py's launcher takes whole slots of K steps only (matmul._gemm runs the tl kernel's same
    # sums otherwise) and buffers that fit
    from lockstep.kernels._triton.swap_ws import gemm_swap_ws, swap_ws_fits
    sg, bf = replace(swapped_gluon, block_m=64), torch.bfloat16
    assert swap_ws_fits(4096, sg, bf) and not swap_ws_fits(4160, sg, bf)
    assert swap_ws_fits(4160, replace(sg, steps_per_stage=5), bf)  # 65 steps: 13 slots of 5
    xb, wb, ob = torch.zeros(64, 4160, dtype=bf), torch.zeros(64, 4160, dtype=bf), torch.empty(64, 64, dtype=bf)
    with pytest.raises(ValueError, match="not whole slots of 2 K steps"):
        gemm_swap_ws(xb, wb, ob, sg)
    with pytest.raises(ValueError, match="more than 232448"):
        gemm_swap_ws(xb[:, :4096], wb[:, :4096], ob, replace(sg, num_stages=8))
    with pytest.raises(ValueError, match="the swapped Gluon kernel takes"):
        gemm_swap_ws(xb, wb, ob, swapped)
    for bad in (dict(chunks=8, chunk=512, split=2), dict(chunks=2, chunk=2048, split=4, ws=ob, tickets=ob)):
        with pytest.raises(ValueError, match="split .* must be 1, 2, 4 or 8, at most the"):  # no workspace; > chunks
            gemm_swap_ws(xb[:, :4096], wb[:, :4096], ob, sg, **bad)
    with pytest.raises(ValueError, match="no power of two .* needs gluon=True"):
        replace(ws, block_n=96)
    from lockstep.kernels._triton.splitk_ws import split_width
    assert [split_width(n) for n in (64, 96, 192, 256)] == [(64, 0), (64, 32), (128, 64), (256, 0)]
    for bad_width in (8, 112, 72):  # too narrow; 64 + 48 and 64 + 8 are no two wgmma widths the kernel takes
        with pytest.raises(ValueError, match="power of two from 16"):
            split_width(bad_width)
    for cfg in (replace(ws, num_stages=5), replace(swapped, num_stages=5)):  # `linear` only: the tree's Gluon kernel takes them
        monkeypatch.setattr(mc, "CONFIGS_FP32", [(None, cfg)])
        with pytest.raises(ValueError, match="more than 4 stages"):
            K.linear(x[:40], w)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_row_parallel_linear_row_invariant():
    w = torch.randn(24, 64)
    _assert_row_invariant(lambda x: K.row_parallel_linear(x, w), lambda m: (torch.randn(m, 64),),
                          (torch.randn(64),), sizes=[1, 17, 70])


_ROW_TREE_PROBE = r"""
import json
from dataclasses import replace
from sm90 import compile_sm90
import torch
from lockstep.kernels._triton import splitk as S, splitk_ws as W, swap_ws as SW
from lockstep.kernels._triton.matmul_configs import CONFIGS_16BIT, ROW_CONFIGS_16BIT, WIDTH_CONFIGS_16BIT

out, odd = [], "not probed"
# linear: one chunk (its swapped Gluon configs run swap_ws.py: _GEMM_PROBE)
gluon_linear = [(cfg, (1,)) for *_, cfg in WIDTH_CONFIGS_16BIT + CONFIGS_16BIT if cfg.gluon and not cfg.swap_ab]
linear_cfgs = [cfg for cfg, _ in gluon_linear]
# (and the many-tile bucket's tile without its sibling schedule: what that schedule is compared with)
one_by_one = [(replace(ROW_CONFIGS_16BIT[-1][1], siblings=False), (8, 4, 2))]
for cfg, chunk_counts in [(cfg, (8, 4, 2, 1)) for _, cfg in ROW_CONFIGS_16BIT] + one_by_one + gluon_linear:
    if cfg.gluon and cfg.swap_ab:  # the decode bucket's subtrees (swap_ws.py) at every TP size and split
        for chunks in chunk_counts:
            for split in [s for s in (1, 2, 4, 8) if s <= chunks]:
                for rows in (16, cfg.block_m) if split <= 2 else (16, min(cfg.block_m, 64)):  # as row_tree splits
                    descs = {"x_desc": f"tensordesc<bf16[{rows}, 64],{W.gluon_layout([rows, 64])!r}>",
                             "w_desc": f"tensordesc<bf16[64, 64],{W.gluon_layout([64, 64])!r}>",
                             "out_ptr": "*bf16" if chunks == 8 else "*fp32", "ws_ptr": "*fp32", "ticket_ptr": "*i32"}
                    ce = dict(CHUNKS=chunks, SPLIT=split, STAGES=cfg.num_stages, STEPS=cfg.steps_per_stage)
                    r = compile_sm90(SW._gemm_swap_ws_kernel, lambda n: descs.get(n, "i32"), ce, cfg.num_warps, 1)
                    out.append(dict(r, tile=[rows, cfg.block_n], split=split, chunks=chunks, gluon=True))
        continue
    if cfg.warp_specialize:  # the Gluon tree (splitk_ws.py), as row_tree launches it
        for chunks in chunk_counts:  # the tree at TP 1, 2, 4, 8; `linear`'s product
            head, tail = W.split_width(cfg.block_n)
            out_dtype = torch.bfloat16 if chunks == 8 or cfg in linear_cfgs else torch.float32  # a TP root: fp32
            odt = {torch.bfloat16: "bf16", torch.float32: "fp32"}[out_dtype]
            tma = W.tma_store_fits(cfg, chunks, 64, 2, out_dtype.itemsize)  # as row_tree_ws decides
            descs = {"x_desc": f"tensordesc<bf16[{W.HALF}, 64],{W.gluon_layout([W.HALF, 64])!r}>",
                     "w_desc": f"tensordesc<bf16[{head}, 64],{W.gluon_layout([head, 64])!r}>",
                     "wt_desc": f"tensordesc<bf16[{tail or head}, 64],{W.gluon_layout([tail or head, 64])!r}>",
                     "out_ptr": f"*{odt}"}
            for name, cols in (("o_desc", head), ("ot_desc", tail or head)):
                descs[name] = (f"tensordesc<{odt}[{W.HALF}, {cols}],{W.gluon_layout([W.HALF, cols], out_dtype)!r}>"
                               if tma else descs["w_desc"])
            ce = dict(CHUNKS=chunks, GROUP_M=cfg.group_m, STAGES=cfg.num_stages, TAIL=tail,
                      IN_FLIGHT=cfg.wgmma_in_flight, ALTERNATE=cfg.accumulators == 2 and chunks > 1, TMA_STORE=tma,
                      SIBLINGS=cfg.siblings and chunks > 1)
            r = compile_sm90(W._row_tree_ws_kernel, lambda n: descs.get(n, "i32"), ce, cfg.num_warps, 1,
                             count=("wgmma.wait_group",))
            out.append(dict(r, tile=[cfg.block_m, cfg.block_n], split=1, chunks=chunks, gluon=True, tma=tma,
                            siblings=cfg.siblings and chunks > 1))
            if cfg.siblings and chunks == 1:  # the sibling schedule asked for at an odd chunk count
                try:
                    compile_sm90(W._row_tree_ws_kernel, lambda n: descs.get(n, "i32"), dict(ce, SIBLINGS=True),
                                 cfg.num_warps, 1)
                    odd = "compiled"
                except Exception as e:  # noqa: BLE001  the compiler's error and its causes, for the test
                    odd, cause = "", e
                    while cause is not None:
                        odd, cause = odd + str(cause) + "\n", cause.__cause__ or cause.__context__
        continue
    descs = {"x_desc": f"tensordesc<bf16[{cfg.block_m}, 64]>", "w_desc": f"tensordesc<bf16[{cfg.block_n}, 64]>",
             "out_ptr": "*bf16", "ws_ptr": "*fp32", "ticket_ptr": "*i32"}
    for split in (1, 2, 4, 8):
        for rows in sorted({cfg.block_m, 16 if cfg.swap_ab else cfg.block_m}):  # a swapped tile's x rows: 16..block_m
            ce = dict(CHUNKS=8, SPLIT=split, BLOCK_M=rows, BLOCK_N=cfg.block_n, BLOCK_K=64, GROUP_M=cfg.group_m,
                      WIDEN_OPERANDS=False, PER_CHUNK_LOOPS=split > 1, SWAP=cfg.swap_ab)  # as row_tree launches it
            descs["x_desc"] = f"tensordesc<bf16[{rows}, 64]>"
            r = compile_sm90(S._row_tree_kernel, lambda n: descs.get(n, "i32"), ce, cfg.num_warps, cfg.num_stages)
            out.append(dict(r, tile=[rows, cfg.block_n], split=split))
print(json.dumps(dict(results=out, odd=odd)))
"""


def test_row_tree_compiles_to_wgmma():
    """Compiled for sm_90 (bf16), the row-parallel tile at every subtree split runs its dots as
    wgmma (the instruction whose bits the GEMM buckets share). The split-2 subtree (4 chunks, one
    loop each: the 8B decode and prefill shapes) keeps its tree in registers; split 1 (four 64x128
    fp32 tiles live: 256 registers a thread) and the split-8 root (eight tiles loaded at once)
    spill a little, and were still the fastest measured (benchmarks/sweep_rowtree.py). Every tile of
    the table, the swapped decode tile (weight rows as the M side, 16 or 64 rows of x) included; the
    many-tile buckets' Gluon kernel at every TP size's chunk count (and `linear`'s Gluon buckets,
    one chunk) is warp-specialised, wgmma, and fits its registers and shared memory; asked for the
    sibling schedule at one chunk, it refuses to compile."""
    from sm90 import probe

    probed = probe(_ROW_TREE_PROBE)
    results = probed["results"]
    assert "chunks in pairs" in probed["odd"], f"the sibling schedule at one chunk: {probed['odd'][-500:]}"
    for r in results:
        assert {version for version, _ in r["mma"]} == {"3"} and r["warp_specialized"] == bool(r.get("gluon")), r
    assert all(r["spill_bytes"] == 0 for r in results if r["split"] == 2 and not r.get("gluon")), results
    gluon = [r for r in results if r.get("gluon")]
    assert {r["chunks"] for r in gluon} == {8, 4, 2, 1}, "the tables have Gluon buckets: probe every chunk count"
    assert any(r.get("tma") for r in gluon), "the tables have TMA-store Gluon buckets: probe them"
    # the many-tile bucket's sibling schedule holds two accumulators and the pair's holder: no more than
    # one accumulator and its two holders, so nothing spills (two alternating accumulators there spill
    # 256 bytes); and it is its own code: more wgmma waits than the same tile's schedule of one
    # accumulator, which waits once a chunk and a step
    sib = [r for r in gluon if r.get("siblings")]
    assert {r["chunks"] for r in sib} == {8, 4, 2} and all(r["spill_bytes"] == 0 for r in sib), sib
    for r in sib:
        plain = [p for p in gluon if not p.get("siblings") and "tma" in p and (p["tile"], p["chunks"], p["tma"]) == (
            r["tile"], r["chunks"], r["tma"])]
        assert plain and r["ptx"]["wgmma.wait_group"] > plain[0]["ptx"]["wgmma.wait_group"], (r, plain)
    for r in gluon:  # the pending subtrees fit (at most a few spilled bytes; the swapped split-8 root's
        # eight loads a little more, as the tl kernel's) and so do the stages
        # (the whole tree of 128 rows of x, the 65-128-row bucket, 136 bytes: the fastest measured, matmul_configs.py)
        limit = 512 if r["split"] == 8 else 136 if r["tile"][0] == 128 and r["split"] == 1 else 64
        assert r["spill_bytes"] <= limit and r["shared_bytes"] <= 227 * 1024, r


_GEMM_PROBE = r"""
import json
from sm90 import compile_sm90
from lockstep.kernels._triton import matmul as M, splitk_ws as W, swap_ws as S
from lockstep.kernels._triton.matmul_configs import CONFIGS_16BIT, WIDTH_CONFIGS_16BIT, tl_tile

out = []
types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "bias_ptr": "*bf16"}
for cfg in [c for _, c in CONFIGS_16BIT] + [c for *_, c in WIDTH_CONFIGS_16BIT]:
    if cfg.gluon and cfg.swap_ab:  # swap_ws.py, as gemm_swap_ws launches it, at its narrowest and widest x tile
        for rows in sorted({16, cfg.block_m}):
            descs = {"x_desc": f"tensordesc<bf16[{rows}, 64],{W.gluon_layout([rows, 64])!r}>",
                     "w_desc": f"tensordesc<bf16[64, 64],{W.gluon_layout([64, 64])!r}>", "out_ptr": "*bf16"}
            descs.update(ws_ptr="*fp32", ticket_ptr="*i32")
            ce = dict(CHUNKS=1, SPLIT=1, STAGES=cfg.num_stages, STEPS=cfg.steps_per_stage)
            r = compile_sm90(S._gemm_swap_ws_kernel, lambda n: descs.get(n, "i32"), ce, cfg.num_warps, 1)
            out.append(dict(r, rows=rows, weight_rows=cfg.block_n, ws=True, gluon=True))
for cfg in [tl_tile(c) for _, c in CONFIGS_16BIT] + [tl_tile(c) for *_, c in WIDTH_CONFIGS_16BIT]:  # as matmul._gemm
    if cfg.swap_ab:
        for rows in sorted({16, cfg.block_m}):
            ce = dict(HAS_BIAS=False, BLOCK_X=rows, BLOCK_W=cfg.block_n, BLOCK_K=64, WIDEN_OPERANDS=False,
                      WARP_SPECIALIZE=cfg.warp_specialize)
            r = compile_sm90(M._gemm_swap_kernel, lambda n: types.get(n, "i32"), ce, cfg.num_warps, cfg.num_stages)
            out.append(dict(r, rows=rows, weight_rows=cfg.block_n, ws=cfg.warp_specialize))
    # unswapped: as `linear` launches it (x @ weight^T), and in the backward's layouts (dx = g @ W,
    # dW = g^T @ x), which run a swapped config unswapped
    ws = cfg.warp_specialize and not cfg.swap_ab
    for a_t, b_t in ((False, True), (False, False), (True, False)):
        ce = dict(A_TRANSPOSED=a_t, B_TRANSPOSED=b_t, HAS_BIAS=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=64, GROUP_M=cfg.group_m, WIDEN_OPERANDS=False, WARP_SPECIALIZE=ws)
        r = compile_sm90(M._gemm_kernel, lambda n: types.get(n, "i32"), ce, cfg.num_warps, cfg.num_stages)
        out.append(dict(r, rows=cfg.block_m, weight_rows=cfg.block_n, ws=ws))
print(json.dumps(out))
"""


def test_gemm_table_compiles_to_wgmma():
    """Compiled for sm_90 (bf16), every config of the GEMM table runs its dots as wgmma without
    spills: a swapped config at its narrowest (16 rows of x) and widest x tile (the instruction of
    the unswapped buckets, whose elements are the same sums: the premise of swapping; the GPU row
    tests check the bits), never mma.sync; every config also unswapped, in the forward's and the
    backward's operand layouts; a warp-specialised one really split into a producer and consumers,
    the others not."""
    from sm90 import probe

    results = probe(_GEMM_PROBE)
    assert {r["rows"] for r in results} >= {16, 64, 128}, results
    assert any(r.get("gluon") for r in results), "the table has a swapped Gluon bucket: probe it"
    for r in results:
        assert {version for version, _ in r["mma"]} == {"3"} and r["spill_bytes"] == 0, r
        assert r["warp_specialized"] == r["ws"] and r["shared_bytes"] <= 227 * 1024, r


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [80, 300])
def test_rms_norm_row_invariant(dtype, h):
    w = torch.randn(h).to(dtype)
    _assert_row_invariant(lambda x: K.rms_norm(x, w, 1e-6), lambda m: (torch.randn(m, h).to(dtype),),
                          (torch.randn(h).to(dtype),))
    # a row sliced out of a batch (with h=300 its data is not 16-byte aligned) gives the same bits
    batch = torch.randn(5, h).to(dtype)
    assert torch.equal(K.rms_norm(batch[3:4], w, 1e-6)[0], K.rms_norm(batch, w, 1e-6)[3])


def _rms_norm_f64(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_accuracy_and_grad(dtype):
    x = (torch.randn(4, 9, 80) * 3).to(dtype).requires_grad_()
    w = torch.randn(80).to(dtype).requires_grad_()
    out = K.rms_norm(x, w, 1e-6)
    assert out.dtype == dtype
    xd, wd = _f64_leaves(x, w)
    ref = _rms_norm_f64(xd, wd, 1e-6)
    _assert_within(out, ref.detach(), ref.detach().abs(), REL[dtype])
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, w), g)
    _assert_grads_close(grads, torch.autograd.grad(ref, (xd, wd), g.double()), dtype)
    again = torch.autograd.grad(K.rms_norm(x, w, 1e-6), (x, w), g)
    assert all(torch.equal(a, r) for a, r in zip(grads, again)), "backward is not deterministic"


def test_rms_norm_promotes_like_the_reference():
    x, w = torch.randn(3, 32).to(torch.bfloat16), torch.randn(32)
    assert K.rms_norm(x, w, 1e-6).dtype == torch.float32
    with pytest.raises(ValueError, match="rms_norm expects"):
        K.rms_norm(x, torch.randn(31), 1e-6)


# ---------------------------------------------------------------- SwiGLU


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_row_invariant(dtype):
    _assert_row_invariant(lambda g, u: K.silu_mul(g, u),
                          lambda m: ((torch.randn(m, 40) * 4).to(dtype), torch.randn(m, 40).to(dtype)),
                          ((torch.randn(40) * 4).to(dtype), torch.randn(40).to(dtype)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_reads_row_views_of_a_fused_output(dtype):
    """gate/up as the two halves of one [rows, 2 * cols] GEMM output (linear_rows): read in place,
    the same bits and gradients as on contiguous copies."""
    fused = torch.randn(2, 5, 2 * 36).to(dtype).requires_grad_()
    gate, up = fused.split(36, -1)
    out = K.silu_mul(gate, up)
    g = torch.randn_like(out)
    (d_fused,) = torch.autograd.grad(out, fused, g)
    gate_c, up_c = (t.detach().contiguous().requires_grad_() for t in (gate, up))
    ref = K.silu_mul(gate_c, up_c)
    assert out.is_contiguous() and torch.equal(out, ref)
    assert torch.equal(d_fused, torch.cat(torch.autograd.grad(ref, (gate_c, up_c), g), -1))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # numpy, interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_accuracy_and_grad(dtype):
    gate = (torch.randn(6, 24) * 30).to(dtype)
    gate[0, :2] = torch.tensor([-100.0, 100.0])  # exp(-g) overflows to inf for the first
    gate.requires_grad_()
    up = torch.randn(6, 24).to(dtype).requires_grad_()
    out = K.silu_mul(gate, up)
    gd, ud = _f64_leaves(gate, up)
    ref = F.silu(gd) * ud
    _assert_within(out, ref.detach(), ref.detach().abs(), REL[dtype])
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (gate, up), g)
    _assert_grads_close(grads, torch.autograd.grad(ref, (gd, ud), g.double()), dtype)


# ---------------------------------------------------------------- RoPE


def _angles(positions, d=16):
    return K.rope_cos_sin(positions, d, 10000.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_row_invariant(dtype):
    def batch(m):
        cos, sin = _angles(torch.randint(0, 4096, (m,)))
        return torch.randn(m, 4, 16).to(dtype), cos, sin

    cos, sin = _angles(torch.tensor([1234]))
    _assert_row_invariant(lambda x, c, s: K.apply_rope(x, c, s), batch,
                          (torch.randn(4, 16).to(dtype), cos[0], sin[0]))


def test_rope_layouts_match():
    """[B, T, H, D] with per-sequence and shared cos/sin, and a token alone, agree bit for bit."""
    x = torch.randn(2, 7, 3, 16)
    cos, sin = _angles(torch.arange(7))
    shared = K.apply_rope(x, cos, sin)
    per_seq = K.apply_rope(x, cos.expand(2, 7, 16), sin.expand(2, 7, 16))
    assert torch.equal(shared, per_seq)
    assert torch.equal(shared[1, 5], K.apply_rope(x[1, 5:6], cos[5:6], sin[5:6])[0])
    with pytest.raises(ValueError, match="even D"):
        K.apply_rope(torch.randn(2, 3, 15), cos[:2, :15], sin[:2, :15])
    with pytest.raises(ValueError, match="do not broadcast"):
        K.apply_rope(x, cos[:5], sin[:5])


def _rope_f64(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_accuracy_and_grad(dtype):
    x = torch.randn(2, 9, 3, 16).to(dtype).requires_grad_()
    cos, sin = _angles(torch.randint(0, 4096, (2, 9)))
    out = K.apply_rope(x, cos, sin)
    # the reference casts cos/sin to x's dtype first
    cos_d, sin_d = cos.to(dtype).double(), sin.to(dtype).double()
    (xd,) = _f64_leaves(x)
    ref = _rope_f64(xd, cos_d, sin_d)
    magnitude = x.detach().double().abs()
    scale = magnitude * cos_d.abs().unsqueeze(-2) + magnitude.roll(8, -1) * sin_d.abs().unsqueeze(-2)
    _assert_within(out, ref.detach(), scale, REL[dtype])
    g = torch.randn_like(out)
    _assert_grads_close(torch.autograd.grad(out, x, g), torch.autograd.grad(ref, xd, g.double()), dtype)


def test_elementwise_custom_ops_pass_opcheck():
    from lockstep.kernels._triton.activation import silu_mul_op
    from lockstep.kernels._triton.norm import rms_norm_op
    from lockstep.kernels._triton.rope import apply_rope_op

    cos, sin = _angles(torch.arange(5), 8)
    torch.library.opcheck(rms_norm_op, (_leaf(3, 16), _leaf(16), 1e-6))
    torch.library.opcheck(silu_mul_op, (_leaf(3, 8), _leaf(3, 8)))
    torch.library.opcheck(apply_rope_op, (_leaf(2, 5, 3, 8), cos, sin))


# ---------------------------------------------------------------- GPU tier (Qwen3-8B shapes, bf16)

GPU_M = [1, 8, 64, 96, 128, 256, 1024, 4096]
BF16 = torch.bfloat16


def _assert_row0_matches_alone(fn, inputs):
    """fn(*[t[:m] for t in inputs])[0] equals fn on the first row alone, for every m in GPU_M."""
    alone = fn(*(t[:1] for t in inputs))[0]
    for m in GPU_M:
        assert torch.equal(fn(*(t[:m] for t in inputs))[0], alone), f"row 0 changed at M={m}"


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(4096, 4096), (4096, 6144), (4096, 12288), (12288, 4096), (4096, 24576)])
def test_gpu_linear_row_invariant_qwen3_8b(k, n):
    from lockstep.kernels._triton.matmul_configs import CONFIGS_16BIT, WIDTH_CONFIGS_16BIT, config_for

    assert {config_for(m, BF16) for m in GPU_M} == {cfg for _, cfg in CONFIGS_16BIT}, \
        "GPU_M must hit every tile bucket of the config table"
    assert {config_for(m, BF16, width) for m in GPU_M for width in (24576, 6144)} >= \
        {cfg for *_, cfg in WIDTH_CONFIGS_16BIT}, "GPU_M must hit every width config at gate/up's and qkv's widths"
    x = torch.randn(max(GPU_M), k, device="cuda", dtype=BF16)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(BF16)
    _assert_row0_matches_alone(lambda rows: K.linear(rows, w), (x,))
    out = K.linear(x[:256], w).float()
    torch.testing.assert_close(out, x[:256].float() @ w.float().t(), rtol=2**-7, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [4096, 12288], ids=["o_proj", "down_proj"])
def test_gpu_row_parallel_linear_row_invariant_qwen3_8b(k):
    """Row 0 of the one-launch row-parallel GEMM at every M bucket (and so at every subtree split
    the SM count picks) equals row 0 alone; the table's kernel (the Gluon tree at many tiles)
    gives the tl kernel's bits at every split; both capture in a CUDA graph."""
    from lockstep.kernels._triton.matmul_configs import ROW_CONFIGS_16BIT, GemmConfig, row_config_for
    from lockstep.kernels._triton.splitk import row_tree

    assert {row_config_for(m, BF16) for m in GPU_M} == {cfg for _, cfg in ROW_CONFIGS_16BIT}
    x = torch.randn(max(GPU_M), k, device="cuda", dtype=BF16)
    w = (torch.randn(4096, k, device="cuda") / k**0.5).to(BF16)
    _assert_row0_matches_alone(lambda rows: K.row_parallel_linear(rows, w), (x,))
    # the table's kernel at each M (Gluon but at 65-96 rows) against the tl kernel's 64x128 tile at
    # every split; and a TP rank's subtree roots (4, 2, 1 chunks, fp32)
    tl_tile = GemmConfig(64, 128, 8, 4, 4)
    for m in (1, 80, 100, 128, 1000, 1024, 4096):
        table = row_tree(x[:m], w, k // 8, BF16)
        for s in (1, 2, 4, 8):
            assert torch.equal(row_tree(x[:m], w, k // 8, BF16, split=s, config=tl_tile), table), (m, s)
    for chunks in (4, 2, 1):
        xs, ws = x[:1000, :chunks * k // 8].contiguous(), w[:, :chunks * k // 8].contiguous()
        assert torch.equal(row_tree(xs, ws, k // 8, torch.float32),
                           row_tree(xs, ws, k // 8, torch.float32, split=1, config=tl_tile)), chunks
    for m in (128, 1024):
        graph, eager, stream = torch.cuda.CUDAGraph(), K.row_parallel_linear(x[:m], w), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # the capture stream's ticket counters made outside the graph
            K.row_parallel_linear(x[:m], w)
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            captured = K.row_parallel_linear(x[:m], w)
        for _ in range(3):  # each tile's last program leaves its ticket at zero for the next replay
            graph.replay()
            assert torch.equal(captured, eager)


def test_ticket_counters_made_inside_a_capture_are_zeroed_until_an_eager_call(monkeypatch):
    """_tickets' bookkeeping (the GPU test below replays the graphs): counters made while a capture
    runs are zeroed before each later captured launch, then once by the first eager launch, then
    never again (a kernel leaves its counters at zero)."""
    from lockstep.kernels._triton import _tickets

    dev = torch.device("cpu")
    monkeypatch.setattr(_tickets, "_BUFFERS", {})
    monkeypatch.setattr(_tickets, "_ZEROED_IN_GRAPH", set())
    monkeypatch.setattr(_tickets, "_capturing", lambda device: True)  # as under torch.cuda.graph
    made = _tickets.zeroed_tickets(dev, 8)
    made.fill_(5)  # what the memory holds before the making graph's memset node ever runs
    assert _tickets.zeroed_tickets(dev, 8) is made and not made[:8].any(), "a later captured launch counted from 5"
    made.fill_(5)
    monkeypatch.setattr(_tickets, "_capturing", lambda device: False)
    assert not _tickets.zeroed_tickets(dev, 8).any(), "the first eager launch counted from 5"
    made.fill_(5)
    assert _tickets.zeroed_tickets(dev, 8)[0] == 5, "an eager launch after that paid for a memset"


@pytest.mark.gpu
def test_gpu_ticket_counters_first_made_inside_a_capture_hold_in_every_graph():
    """Counters first made while a graph is captured are zeroed only by that graph's node: a second
    graph captured on the stream and replayed first, over memory holding anything, still merges
    (each captured launch zeroes them), and an eager call on the stream then zeroes them for good."""
    from lockstep.kernels._triton import _tickets
    from lockstep.kernels._triton.splitk import row_tree

    x = torch.randn(8, 4096, device="cuda", dtype=BF16)
    w = (torch.randn(4096, 4096, device="cuda") / 64).to(BF16)
    tree = lambda: row_tree(x, w, 512, BF16, split=4)  # noqa: E731  the decode bucket, 4 subtrees a tile
    eager = tree()
    stream, first, second = torch.cuda.Stream(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    key = (x.device, stream.cuda_stream)
    _tickets._BUFFERS.pop(key, None)  # the pool's stream may have served an earlier test
    _tickets._ZEROED_IN_GRAPH.discard(key)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(first, stream=stream):
        out_first = tree()
    with torch.cuda.graph(second, stream=stream):
        out_second = tree()
    assert key in _tickets._ZEROED_IN_GRAPH, "the split tree took no tickets"
    tickets = _tickets._BUFFERS[key]
    tickets.fill_(1 << 20)  # what the first graph's memory may hold before its memset ever ran
    second.replay()
    assert torch.equal(out_second, eager), "a graph replayed before the one that made its counters"
    first.replay()
    assert torch.equal(out_first, eager)
    tickets.fill_(1 << 20)
    with torch.cuda.stream(stream):
        again = tree()
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(again, eager) and key not in _tickets._ZEROED_IN_GRAPH
    assert not tickets.any(), "an eager launch left a counter it took a ticket from off zero"


@pytest.mark.gpu
@pytest.mark.parametrize("k", [4096, 12288], ids=["o_proj", "down_proj"])
def test_gpu_gluon_row_tree_schedules_give_the_tl_bits(k):
    """The row tree's Gluon schedules give the tl kernel's bits on the same tiles: the swapped
    subtrees of swap_ws.py (two accumulators over the chunks, slots of 1 or 2 K steps, 64 or 128
    weight rows, 64 or 128 rows of x, the ticketed join at a split) at decode sizes, every split and a TP rank's chunk
    counts; the unswapped tree with two accumulators a consumer (64- and 128-column tiles), with
    sibling chunks step by step (GemmConfig.siblings), and with its tiles leaving by TMA store (bf16
    out; a TP rank's fp32 roots where they fit); and a swapped
    split captured in a CUDA graph, replayed (each tile's tickets left at zero for the next replay)."""
    from dataclasses import replace

    from lockstep.kernels._triton.matmul_configs import GemmConfig, tl_tile
    from lockstep.kernels._triton.splitk import row_tree

    x = torch.randn(1000, k, device="cuda", dtype=BF16)
    w = (torch.randn(4096, k, device="cuda") / k**0.5).to(BF16)
    chunk = k // 8
    swapped = GemmConfig(64, 64, 1, 4, 6, swap_ab=True, warp_specialize=True, gluon=True, steps_per_stage=2)
    one_step = replace(swapped, num_stages=8, steps_per_stage=1)
    wide = replace(swapped, block_n=128, num_stages=4)  # 128 weight rows: two wgmmas a step
    rows128 = replace(one_step, block_m=128)  # up to 128 rows of x a tile (the 65-128-row bucket)
    plain = GemmConfig(64, 128, 8, 4, 4)  # the tl kernel's unswapped tile
    alternating = [GemmConfig(128, n, 8, 4, stages, warp_specialize=True, gluon=True, accumulators=acc, tma_store=tma,
                              siblings=sib)
                   for n, stages, acc, tma, sib in ((64, 8, 2, False, False), (128, 4, 2, False, False),
                                                    (64, 7, 2, True, False), (128, 4, 1, True, False),
                                                    (128, 4, 1, True, True), (64, 8, 1, False, True))]
    for chunks in (8, 4, 2, 1):
        xs, ws = x[:, :chunks * chunk].contiguous(), w[:, :chunks * chunk].contiguous()
        dtype = BF16 if chunks == 8 else torch.float32  # unsharded: rounded; a TP rank's root: fp32
        for m in (1, 8, 17, 33, 64, 100, 128) if chunks == 8 else (8, 64, 128):
            ref = row_tree(xs[:m], ws, chunk, dtype, split=1, config=tl_tile(swapped))
            for split in [s for s in (1, 2, 4, 8) if s <= chunks]:
                for cfg in (swapped, one_step, wide, rows128) if chunks == 8 else (swapped, wide, rows128):
                    assert torch.equal(row_tree(xs[:m], ws, chunk, dtype, split=split, config=cfg), ref), \
                        (chunks, m, split, cfg)
        for m in (129, 256, 1000) if chunks == 8 else (1000,):
            ref = row_tree(xs[:m], ws, chunk, dtype, split=1, config=plain)
            for cfg in alternating:
                assert torch.equal(row_tree(xs[:m], ws, chunk, dtype, config=cfg), ref), (chunks, m, cfg)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    eager = row_tree(x[:8], w, chunk, BF16, split=4, config=swapped)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # the capture stream's ticket counters made outside the graph
        row_tree(x[:8], w, chunk, BF16, split=4, config=swapped)
    stream.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        captured = row_tree(x[:8], w, chunk, BF16, split=4, config=swapped)
    for _ in range(3):
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("n, ms", [(24576, (1, 17, 64, 129, 256, 257, 700, 1024)),
                                   (6144, (1, 8, 33, 64, 100, 128, 129, 200, 256, 257, 700, 1024))],
                         ids=["gate_up", "qkv"])
def test_gpu_gluon_linear_gives_the_tl_kernels_bits(monkeypatch, n, ms):
    """`linear`'s Gluon configs (the swapped decode bucket, swap_ws.py; gate/up's and qkv's widths at
    129-1,024 rows; qkv's tiles of two products, 96 and 192 columns) give the bits of the tl kernel
    on its form of the tile (tl_tile), with and without a bias."""

    from lockstep.kernels._triton import matmul_configs as mc

    x = torch.randn(1024, 4096, device="cuda", dtype=BF16)
    w = (torch.randn(n, 4096, device="cuda") / 64).to(BF16)
    bias = torch.randn(n, device="cuda", dtype=BF16)
    assert all(mc.config_for(m, BF16, n).gluon for m in ms)
    gluon = {m: (K.linear(x[:m], w), K.linear(x[:m], w, bias)) for m in ms}
    # the decode bucket (swap_ws.py) as vLLM's decode graphs hold it: captured, replayed, the same bits
    graph, stream, eager = torch.cuda.CUDAGraph(), torch.cuda.Stream(), K.linear(x[:8], w)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        K.linear(x[:8], w)  # compiled outside the capture
    stream.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        captured = K.linear(x[:8], w)
    for _ in range(2):
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
    monkeypatch.setattr(mc, "WIDTH_CONFIGS_16BIT", [(*key, mc.tl_tile(c)) for *key, c in mc.WIDTH_CONFIGS_16BIT])
    monkeypatch.setattr(mc, "CONFIGS_16BIT", [(hi, mc.tl_tile(c)) for hi, c in mc.CONFIGS_16BIT])
    for m in ms:
        assert torch.equal(gluon[m][0], K.linear(x[:m], w)), m
        assert torch.equal(gluon[m][1], K.linear(x[:m], w, bias)), m


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [(4096, 1024, 1024), (12288, 12288), (2048, 1024, 1024)],
                         ids=["qwen3_8b_qkv", "qwen3_8b_gate_up", "qwen3_1p7b_qkv"])
def test_gpu_linear_rows_equals_one_linear_per_block(sizes):
    """The fused q/k/v and gate/up launches (vLLM's and megatron's fused weights) give each block's
    own linear bits at every M bucket: the bitwise contract with trainers that hold them apart."""
    k = 4096 if sizes[0] != 2048 else 2048
    w = (torch.randn(sum(sizes), k, device="cuda") / k**0.5).to(BF16)
    x = torch.randn(max(GPU_M), k, device="cuda", dtype=BF16)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for m in GPU_M:
        fused = K.linear_rows(x[:m], w, sizes)
        for out, a, n in zip(fused, starts, sizes):
            assert torch.equal(out, K.linear(x[:m], w[a:a + n])), f"block at row {a} differs at M={m}"


@pytest.mark.gpu
def test_gpu_linear_captures_in_cuda_graph():
    x = torch.randn(64, 4096, device="cuda", dtype=BF16)
    w = torch.randn(4096, 4096, device="cuda", dtype=BF16)
    eager = K.linear(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = K.linear(x, w)
    graph.replay()
    assert torch.equal(captured, eager)


@pytest.mark.gpu
def test_gpu_rms_norm_row_invariant_qwen3_8b():
    x = torch.randn(max(GPU_M), 4096, device="cuda", dtype=BF16)
    w = torch.randn(4096, device="cuda", dtype=BF16)
    _assert_row0_matches_alone(lambda rows: K.rms_norm(rows, w, 1e-6), (x,))


@pytest.mark.gpu
def test_gpu_silu_mul_row_invariant_qwen3_8b():
    gate = torch.randn(max(GPU_M), 12288, device="cuda", dtype=BF16) * 4
    up = torch.randn(max(GPU_M), 12288, device="cuda", dtype=BF16)
    _assert_row0_matches_alone(K.silu_mul, (gate, up))


@pytest.mark.gpu
def test_gpu_rope_row_invariant_qwen3_8b():
    positions = torch.randint(0, 32768, (max(GPU_M),), device="cuda")
    cos, sin = K.rope_cos_sin(positions, 128, 1_000_000.0)
    q = torch.randn(max(GPU_M), 32, 128, device="cuda", dtype=BF16)
    _assert_row0_matches_alone(K.apply_rope, (q, cos, sin))
