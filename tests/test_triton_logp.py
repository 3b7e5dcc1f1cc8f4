"""The Triton backend of linear_logp (kernels/_triton/logp.py).

CPU tier (Triton's interpreter, small shapes): logp and entropy agree with a float64 log_softmax
(fp32 and bf16; float and per-row temperatures, a padded vocab, a bias, chunks of several tiles);
a row alone equals the row inside batches of random neighbours at random positions, bit for bit;
the row block size changes no bit; gradients agree with float64 autograd; the vocab-sharded form
equals the unsharded one bit for bit; the chunk states agree with the torch reference; the merge
kernel agrees with the reference merge and follows its tree order; the custom ops pass opcheck.
The support logits of top-p replay are the torch reference's bits (and gradients) without its
[T, k, H] products, also on the GPU.
GPU tier (@pytest.mark.gpu, Qwen3's LM head in bf16): row 0 is the same bits at T = 1, 64 and 4096;
logp, entropy and gradients agree with an fp32 computation; the merge kernel equals the torch merge
bit for bit; the warp-specialised Gluon forward gives the tl kernel's bits; CUDA graphs capture
both forwards.
"""
import os
import socket

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import lockstep.kernels as K  # noqa: E402
from lockstep.kernels import logp as logp_module  # noqa: E402

# The interpreter turns a program id used as a loop bound into an int the way NumPy deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

DTYPES = [torch.float32, torch.bfloat16]
SIZES = [1, 3, 16, 17, 40]
# Absolute error bounds on logp and entropy against float64 on the same (already rounded) inputs.
# The kernel keeps logits in fp32 and bf16 products are exact in fp32, so bf16 inputs cost no more
# than the fp32 accumulation; the bf16 bound leaves room for larger logits only.
ATOL = {torch.float32: 2e-5, torch.bfloat16: 1e-4}
# Gradients, as a fraction of the largest reference gradient: bf16 adds the rounding of dlogits
# (to bf16, as the naive bf16 path does) and of the GEMM outputs.
GRAD_REL = {torch.float32: 1e-5, torch.bfloat16: 2**-6}


@pytest.fixture(autouse=True)
def triton_backend():
    K.set_backend("triton")
    yield
    K.set_backend("torch")


def _triton_logp_module():
    from lockstep.kernels._triton import logp

    return logp


def _inputs(t, h, v, dtype, *, real=None, scale=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * scale).to(dtype)
    targets = torch.randint(0, real or v, (t,), generator=g)
    return hidden, weight, targets


def _temperature(kind, t):
    if kind == "per_row":
        return torch.rand(t, generator=torch.Generator().manual_seed(5)) + 0.5
    return kind


def _naive(hidden, weight, targets, *, temperature=None, real=None, bias=None):
    """float64 log_softmax + gather and entropy; differentiable w.r.t. hidden, weight, bias."""
    z = hidden.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    if isinstance(temperature, torch.Tensor):
        z = z / temperature.double()[:, None]
    elif temperature is not None:
        z = z / temperature
    if real is not None:
        z = z.masked_fill(torch.arange(z.shape[1]) >= real, float("-inf"))
    lsm = z.log_softmax(-1)
    entropy = -(lsm.exp() * lsm.masked_fill(torch.isinf(lsm), 0.0)).sum(-1)
    return lsm.gather(1, targets[:, None])[:, 0], entropy


def _assert_matches_naive(hidden, weight, targets, dtype, **kw):
    out = K.linear_logp(hidden, weight, targets, with_entropy=True, real_vocab_size=kw.get("real"),
                        temperature=kw.get("temperature"), bias=kw.get("bias"))
    ref_logp, ref_entropy = _naive(hidden, weight, targets, **kw)
    assert (out.logp.double() - ref_logp).abs().max() <= ATOL[dtype]
    assert (out.entropy.double() - ref_entropy).abs().max() <= ATOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature,with_bias", [(None, False), (0.7, True), ("per_row", False)],
                         ids=["plain", "float_temperature_bias", "per_row_temperature"])
def test_logp_and_entropy_match_float64(dtype, temperature, with_bias):
    hidden, weight, targets = _inputs(13, 48, 300, dtype, real=290)  # 48: a K tail for both BLOCK_K
    bias = (torch.randn(300) * 0.5).to(dtype) if with_bias else None
    _assert_matches_naive(hidden, weight, targets, dtype, temperature=_temperature(temperature, 13), real=290,
                          bias=bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunks_of_several_tiles_match_float64(dtype):
    # 64 chunks of 132 columns: two 128-column tiles (bf16), five 32-column tiles (fp32) per chunk
    assert logp_module.NUM_VOCAB_CHUNKS == 64, "resize this test's vocab with the chunk count"
    hidden, weight, targets = _inputs(5, 16, 8400, dtype, real=8390)
    _assert_matches_naive(hidden, weight, targets, dtype, temperature=_temperature("per_row", 5), real=8390)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_passed_back_give_the_same_bits(dtype, backend):
    """An engine samples from lm_head_logits and passes them back: linear_logp then folds them
    instead of multiplying again, with the bits (and gradients) of the call without them, on a
    whole vocab and on a shard, with bias, per-row temperatures and entropy."""
    hidden, weight, targets = _inputs(13, 48, 300, dtype, real=290)
    bias = (torch.randn(300) * 0.5).to(dtype)
    temperature = _temperature("per_row", 13)
    with K.using_backend(backend):
        z = K.lm_head_logits(hidden, weight)
        assert z.dtype == torch.float32 and z.shape == (13, 300)
        kw = dict(bias=bias, temperature=temperature, real_vocab_size=290, with_entropy=True)
        plain, reused = K.linear_logp(hidden, weight, targets, **kw), K.linear_logp(hidden, weight, targets, logits=z, **kw)
        assert torch.equal(plain.logp, reused.logp) and torch.equal(plain.entropy, reused.entropy)
        # a shard (chunks 10..29 of the same head): the same chunk states
        width = logp_module.chunk_width(300)
        lo, hi = 10 * width, 30 * width
        zs = K.lm_head_logits(hidden, weight[lo:hi], full_vocab_size=300)
        assert zs.shape == (13, hi - lo)
        st = [logp_module.chunk_states(hidden, weight[lo:hi], targets, vocab_start=lo, width=width, real_vocab_size=290,
                                       bias=None, temperature=temperature, with_entropy=False, logits=x) for x in (None, zs)]
        assert torch.equal(st[0].m, st[1].m) and torch.equal(st[0].s, st[1].s)
        assert torch.equal(st[0].target_z, st[1].target_z)
        # gradients flow to hidden and weight as without the logits
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        g_plain = torch.autograd.grad(K.linear_logp(h, w, targets, **kw).logp.sum(), (h, w))
        g_reused = torch.autograd.grad(K.linear_logp(h, w, targets, logits=K.lm_head_logits(h.detach(), w.detach()),
                                                     **kw).logp.sum(), (h, w))
        assert all(torch.equal(a, b) for a, b in zip(g_plain, g_reused))
        with pytest.raises(ValueError, match="logits must be"):
            K.linear_logp(hidden, weight, targets, logits=z[:, :10])
    # the products differ from a perturbed head's: the fold does read them
    with K.using_backend(backend):
        other = K.linear_logp(hidden, weight, targets, logits=z * 1.5, real_vocab_size=290)
        assert not torch.equal(other.logp, K.linear_logp(hidden, weight, targets, real_vocab_size=290).logp)


def _assert_row_invariant(fn, make_batch, row):
    """fn(*batch)[pos], with `row` (a tuple of per-row tensors) written at `pos` of a batch of
    random neighbours from make_batch(m), equals fn on the row alone, bit for bit."""
    alone = fn(*(part.unsqueeze(0) for part in row))[0]
    for m in SIZES:
        for pos in sorted({0, int(torch.randint(m, ())), m - 1}):
            batch = make_batch(m)
            for full, part in zip(batch, row):
                full[pos] = part
            assert torch.equal(fn(*batch)[pos], alone), f"row changed at batch size {m}, position {pos}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_is_batch_invariant(dtype):
    v, real, h = 40, 37, 24
    weight = (torch.randn(v, h) * 0.3).to(dtype)

    def fn(hidden, targets, temperature):
        out = K.linear_logp(hidden, weight, targets, temperature=temperature, real_vocab_size=real,
                            with_entropy=True)
        return torch.stack([out.logp, out.entropy], -1)

    def make_batch(m):
        return torch.randn(m, h).to(dtype), torch.randint(0, real, (m,)), torch.rand(m) + 0.5

    _assert_row_invariant(fn, make_batch, (torch.randn(h).to(dtype), torch.tensor(real - 1), torch.tensor(0.8)))


def test_row_block_size_changes_no_bit(monkeypatch):
    """100 rows as one 128-row block or as two 64-row blocks: the same chunk states."""
    triton_logp = _triton_logp_module()
    hidden, weight, targets = _inputs(100, 24, 300, torch.bfloat16, real=290)
    kw = dict(vocab_start=0, width=logp_module.chunk_width(300), real_vocab_size=290, bias=None,
              temperature=0.7, with_entropy=True)
    monkeypatch.setattr(triton_logp, "BLOCK_T_WARPS", {128: 8})
    one_block = triton_logp.chunk_states(hidden, weight, targets, **kw)
    monkeypatch.setattr(triton_logp, "BLOCK_T_WARPS", {64: 4})
    two_blocks = triton_logp.chunk_states(hidden, weight, targets, **kw)
    for a, b in zip(one_block, two_blocks):
        assert torch.equal(a, b)


def test_row_blocks_are_the_largest_that_fill_the_waves(monkeypatch):
    """On 132 SMs with Qwen3's 64 vocab chunks: T=256 takes 128-row blocks (128 programs, one wave
    97% full; with 64-row blocks the forward took 3.7x the bare GEMM there, timed eagerly), T=128
    64-row ones (64 programs of 128 rows would leave half the SMs idle), a 1,216-tile LM-head launch
    128 rows from T=1 on."""
    triton_logp = _triton_logp_module()
    monkeypatch.setattr(triton_logp, "resident_programs", lambda device: 132)
    cuda = torch.device("cuda")
    assert [triton_logp._block_t(t, 64, cuda) for t in (1, 128, 200, 256, 4096)] == [64, 64, 128, 128, 128]
    assert triton_logp._block_t(1, 1216, cuda) == 128


def _grads(hidden, weight, bias, targets, temperature, real, g_logp, g_entropy):
    out = K.linear_logp(hidden, weight, targets, bias=bias, temperature=temperature, real_vocab_size=real,
                        with_entropy=True)
    return torch.autograd.grad((out.logp * g_logp).sum() + (out.entropy * g_entropy).sum(), (hidden, weight, bias))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_float64(dtype, monkeypatch):
    # 64 chunks of 40 columns, the last one of 10: with fp32's 32-column tiles, the backward's
    # trailing tile of the last chunk is empty
    assert logp_module.chunk_width(2530) == 40 and 2530 - 63 * 40 == 10
    t, h, v, real = 11, 24, 2530, 2525
    hidden, weight, targets = _inputs(t, h, v, dtype, real=real)
    hidden, weight = hidden.requires_grad_(), weight.requires_grad_()
    bias = (torch.randn(v) * 0.1).to(dtype).requires_grad_()
    temperature = _temperature("per_row", t)
    g_logp, g_entropy = torch.randn(t), torch.randn(t)
    grads = _grads(hidden, weight, bias, targets, temperature, real, g_logp, g_entropy)
    leaves = tuple(x.detach().double().requires_grad_() for x in (hidden, weight, bias))
    ref_logp, ref_entropy = _naive(leaves[0], leaves[1], targets, temperature=temperature, real=real, bias=leaves[2])
    refs = torch.autograd.grad((ref_logp * g_logp).sum() + (ref_entropy * g_entropy).sum(), leaves)
    for got, ref in zip(grads, refs):
        assert got.dtype == dtype and torch.isfinite(got).all()
        assert (got.double() - ref).abs().max() <= GRAD_REL[dtype] * ref.abs().max()
    # one chunk per backward slice: the same gradients up to the order of grad_hidden's fp32 sum
    # (and the GEMM shapes, which may move a bf16 rounding)
    monkeypatch.setattr(_triton_logp_module(), "BACKWARD_SLICE_BYTES", 1)
    for got, sliced in zip(grads, _grads(hidden, weight, bias, targets, temperature, real, g_logp, g_entropy)):
        assert (got.double() - sliced.double()).abs().max() <= GRAD_REL[dtype] * got.abs().max()


def test_chunk_states_agree_with_torch_reference():
    """The shard of chunks 3..7 of a 320-column vocab (10-column chunks): chunk 6 straddles
    real_vocab_size, chunk 7 lies past it (all -inf: max -inf, sums 0)."""
    width = 10
    hidden, weight, _ = _inputs(9, 32, 320, torch.float32)
    targets = torch.tensor([0, 35, 39, 40, 64, 29, 60, 50, 10])  # inside and outside the shard
    kw = dict(vocab_start=3 * width, width=width, real_vocab_size=65, bias=torch.randn(50) * 0.1,
              temperature=torch.rand(9) + 0.5, with_entropy=True)
    ours = _triton_logp_module().chunk_states(hidden, weight[30:80], targets, **kw)
    ref = logp_module.torch_chunk_states(hidden, weight[30:80], targets, **kw)
    assert torch.equal(ours.m.isinf(), ref.m.isinf())
    elsewhere = (targets < 30) | (targets >= 80)  # the target's logit is another shard's: an exact 0
    assert elsewhere.any() and (ours.target_z[elsewhere] == 0).all() and (ref.target_z[elsewhere] == 0).all()
    finite = ref.m.isfinite()
    assert torch.allclose(ours.m[finite], ref.m[finite], atol=1e-5)
    for a, b in [(ours.s, ref.s), (ours.w, ref.w), (ours.target_z, ref.target_z)]:
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert (ours.s[~finite] == 0).all() and (ours.w[~finite] == 0).all()


def _merge_inputs(t, n, seed=0, device="cpu"):
    """[T, n] chunk states as linear_logp's chunk kernels leave them, every third chunk past the real
    vocab (max -inf, sums 0), and target logits."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(t, n, generator=g) * 4
    m[:, 1::3] = float("-inf")
    s = (torch.rand(t, n, generator=g) * 50 + 1).masked_fill(m.isinf(), 0.0)
    w = (torch.randn(t, n, generator=g) * 20).masked_fill(m.isinf(), 0.0)
    return tuple(x.to(device) for x in (torch.randn(t, generator=g) * 4, m, s, w))


@pytest.mark.parametrize("t,n", [(1, 64), (70, 64), (5, 3), (9, 1)])
def test_merge_kernel_agrees_with_the_reference_merge(t, n):
    """The one-launch merge (logp, lse, entropy from [T, n] chunk states, n padded to a power of two)
    against kernels/logp.py's torch_merge_states, with and without entropy. On the CPU within an ulp
    or two: the interpreter's exp and log are NumPy's (on a GPU the bits are equal, below)."""
    tz, m, s, w = _merge_inputs(t, n)
    for with_w in (w, None):
        got = _triton_logp_module().merge_states(tz, m, s, with_w)
        ref = logp_module.torch_merge_states(tz, m, s, with_w)
        assert (got.entropy is None) == (with_w is None)
        for a, b in zip(got, ref):
            if b is not None:
                assert a.shape == b.shape and (a - b).abs().max() <= 2e-5


def test_merge_kernel_merges_in_the_reference_tree_order():
    """States whose sum depends on the order of the additions: chunk 0 holds 1, the others tiny
    sums below an ulp of 1, all with max 0 (every rescale is exp(0) = 1, exact). merge_tree's
    half-split tree and two other orders (adjacent pairs; one running sum) end some rows ulps of s
    apart, which lse = log(s) near 0 shows far above NumPy's error in the log: the kernel must land
    on merge_tree's."""
    n, rows = 64, 16
    s = torch.rand(rows, n, generator=torch.Generator().manual_seed(3)) * 2.0**-23
    s[:, 0] = 1.0
    m, tz = torch.zeros(rows, n), torch.zeros(rows)
    ref = logp_module.torch_merge_states(tz, m, s, None).lse
    bit_reversed = [int(format(i, "06b")[::-1], 2) for i in range(n)]
    adjacent = logp_module.torch_merge_states(tz, m, s[:, bit_reversed], None).lse
    running = torch.log(torch.stack(list(s.unbind(1))).cumsum(0)[-1])  # cumsum: one running fp32 sum
    for other in (adjacent, running):  # the check can fire: other orders do land elsewhere
        assert (other - ref).abs().max() > 5e-8
    got = _triton_logp_module().merge_states(tz, m, s, None).lse
    assert (got - ref).abs().max() <= 1e-11


def _support_case(t, h, v, k, dtype, device="cpu", seed=5):
    """Inputs of the support logits with repeated ids (one token in many rows' supports)."""
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(t, h, generator=g, device=device).to(dtype)
    weight = (torch.randn(v, h, generator=g, device=device) * 0.5).to(dtype)
    ids = torch.randint(0, v, (t, k), generator=g, device=device)
    return hidden, weight, ids


@pytest.mark.parametrize("dtype", DTYPES)
def test_support_logits_are_the_references_bits(dtype):
    """Top-p replay's support logits without the [T, k, H] products: the reference's bits (its
    bf16-rounded products and tree sums), at hidden widths that are and are not powers of two and k
    not a multiple of a program's slots; the gradients are the reference's too. Negative control: a
    tree pairing neighbouring columns instead changes bits."""
    module = _triton_logp_module()
    for t, h, v, k in ((5, 96, 40, 7), (3, 64, 9, 33), (2, 1, 4, 3)):
        hidden, weight, ids = _support_case(t, h, v, k, dtype)
        ref = logp_module.torch_support_logits(hidden, weight, ids)
        assert torch.equal(module.support_logits(hidden, weight, ids), ref), (t, h, v, k)
    hidden, weight, ids = _support_case(5, 96, 40, 7, dtype)
    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ht, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    g = torch.randn(5, 7).to(dtype)
    (logp_module.torch_support_logits(hr, wr, ids) * g).sum().backward()
    (module.support_logits(ht, wt, ids) * g).sum().backward()
    assert torch.equal(ht.grad, hr.grad) and torch.equal(wt.grad, wr.grad)
    # the control: neighbouring columns paired first, the same products
    prods = hidden.unsqueeze(1) * weight[ids]
    pairs = prods.view(5, 7, 48, 2).sum(-1)
    assert not torch.equal(logp_module.tree_sum(pairs, -1), logp_module.torch_support_logits(hidden, weight, ids))


def test_support_replay_through_triton_equals_torch():
    """linear_logp with support_ids gives the torch backend's bits on the Triton backend (sharded
    supports included: ids outside the shard read 0), and rejects mixed dtypes by name."""
    hidden, weight, _ = _support_case(6, 48, 30, 5, torch.bfloat16, seed=9)
    ids = torch.randint(-1, 30, (6, 5), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 30, (6,), generator=torch.Generator().manual_seed(2))
    ids[:, 2] = targets
    got = K.linear_logp(hidden, weight, targets, support_ids=ids, with_entropy=True, temperature=0.8)
    with K.using_backend("torch"):
        ref = K.linear_logp(hidden, weight, targets, support_ids=ids, with_entropy=True, temperature=0.8)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    calls = K.kernel_calls()
    K.linear_logp(hidden, weight, targets, support_ids=ids)
    assert K.kernel_calls()["linear_logp_support_logits"] == calls.get("linear_logp_support_logits", 0) + 1
    with pytest.raises(ValueError, match="one dtype"):
        _triton_logp_module().support_logits(hidden, weight.float(), ids.clamp(min=0))


def test_support_logits_launch_the_kernel_at_every_size(monkeypatch):
    """The Triton backend's support logits launch _support_logits_kernel however small the support
    (never the reference's [T, k, H] products in its place): one launch a call."""
    module = _triton_logp_module()
    launches = []
    real = module._support_logits
    monkeypatch.setattr(module, "_support_logits", lambda *a: launches.append(a) or real(*a))
    for t, h, v, k in ((1, 8, 4, 1), (3, 64, 9, 33)):
        module.support_logits(*_support_case(t, h, v, k, torch.float32))
    assert len(launches) == 2


def test_empty_batch():
    hidden, weight, _ = _inputs(0, 16, 64, torch.float32)
    out = K.linear_logp(hidden, weight, torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert out.logp.shape == (0,) and out.entropy.shape == (0,)


def test_inference_calls_skip_the_custom_ops_with_their_bits(monkeypatch):
    """An inference call (the sampler's replay: no input requires grad) runs the functions the custom
    ops wrap, without their dispatch, and gets the ops' bits; a call that autograd records goes
    through the ops (their registered backward). Control: the same blocked ops stop the recorded
    call on each of the four routes."""
    module = _triton_logp_module()
    hidden, weight, targets = _inputs(5, 32, 200, torch.float32, real=190)
    temperature = _temperature("per_row", 5)
    _, _, ids = _support_case(5, 32, 200, 4, torch.float32)
    ids[:, 0] = targets  # each row's target is in its support
    kw = dict(temperature=temperature, real_vocab_size=190, with_entropy=True)
    width = logp_module.chunk_width(200)

    def replays(h, w, z):
        return K.linear_logp(h, w, targets, logits=z, **kw), K.linear_logp(h, w, targets, support_ids=ids, **kw)

    z_op = module.head_logits_op(hidden, weight, width)
    recorded = replays(hidden.clone().requires_grad_(), weight.clone().requires_grad_(), z_op)
    for name in ("_chunk_states_op", "_merge_op", "head_logits_op", "_support_logits_op"):
        monkeypatch.setattr(module, name, _blocked(name))
    z = K.lm_head_logits(hidden, weight)
    assert torch.equal(z, z_op)
    for got, want in zip(replays(hidden, weight, z), recorded):
        assert torch.equal(got.logp, want.logp.detach()) and torch.equal(got.entropy, want.entropy.detach())
    tz, m, s, _ = _merge_inputs(4, 8)
    for name, call in (("_chunk_states_op", lambda h: K.linear_logp(h, weight, targets)),
                       ("_merge_op", lambda h: logp_module.merge_states(tz, m, s.requires_grad_(), None)),
                       ("head_logits_op", lambda h: K.lm_head_logits(h, weight)),
                       ("_support_logits_op", lambda h: K.linear_logp(h, weight, targets, support_ids=ids))):
        with pytest.raises(AssertionError, match=name):
            call(hidden.clone().requires_grad_())


def _blocked(name):
    def op(*args):
        raise AssertionError(f"{name} dispatched")
    return op


def test_custom_op_passes_opcheck():
    hidden, weight, targets = _inputs(3, 16, 16, torch.float32)
    args = (hidden.requires_grad_(), weight.requires_grad_(), targets, None, torch.full((3,), 0.9), 0, 1, 15, True)
    module = _triton_logp_module()
    torch.library.opcheck(module._chunk_states_op, (*args, None))
    logits = module.head_logits_op(hidden.detach(), weight.detach(), 1)
    torch.library.opcheck(module._chunk_states_op, (*args, logits))
    torch.library.opcheck(module.head_logits_op, (hidden.detach(), weight.detach(), 1))
    tz, m, s, w = _merge_inputs(4, 8)
    for with_w in (w.requires_grad_(), None):
        torch.library.opcheck(module._merge_op, (tz.requires_grad_(), m, s.requires_grad_(), with_w))
    hidden, weight, ids = _support_case(3, 16, 8, 5, torch.float32)
    torch.library.opcheck(module._support_logits_op, (hidden.requires_grad_(), weight.requires_grad_(), ids))


# ---------------------------------------------------------------- vocab-sharded (gloo)

SHARD_V, SHARD_REAL, SHARD_H, SHARD_T = 256, 250, 24, 9


def _shard_inputs():
    return _inputs(SHARD_T, SHARD_H, SHARD_V, torch.float32, real=SHARD_REAL, scale=0.5, seed=11)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharded_logp(hidden, weight, targets, **kw):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    out = K.linear_logp(h, w, targets, temperature=0.7, with_entropy=True, real_vocab_size=SHARD_REAL, **kw)
    out.logp.sum().backward()
    return {"logp": out.logp.detach(), "entropy": out.entropy.detach(), "grad_h": h.grad, "grad_w": w.grad}


def _rank(rank, world, port, out_dir):
    from helpers import fixed_order_interpreter_dot

    fixed_order_interpreter_dot()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    K.set_backend("triton")
    hidden, weight, targets = _shard_inputs()
    shard = SHARD_V // world
    result = _sharded_logp(hidden, weight[rank * shard:(rank + 1) * shard], targets, vocab_start=rank * shard,
                           full_vocab_size=SHARD_V, group=dist.group.WORLD)
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_equals_unsharded_bitwise(world, tmp_path):
    mp.spawn(_rank, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    ref = _sharded_logp(*_shard_inputs())
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    for r in ranks:  # every rank ends with the full result
        assert torch.equal(r["logp"], ref["logp"]) and torch.equal(r["entropy"], ref["entropy"])
    # gradients: each rank holds its shard's weight gradient and a partial hidden gradient
    assert torch.allclose(torch.cat([r["grad_w"] for r in ranks]), ref["grad_w"], atol=1e-6)
    assert torch.allclose(sum(r["grad_h"] for r in ranks), ref["grad_h"], atol=1e-5)


# ---------------------------------------------------------------- GPU tier: Qwen3's LM head

QWEN3_V, QWEN3_H = 151936, 4096


def _qwen3_head(t, *, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(t, QWEN3_H, generator=g, device="cuda").bfloat16()
    weight = (torch.randn(QWEN3_V, QWEN3_H, generator=g, device="cuda") * 0.02).bfloat16()
    targets = torch.randint(0, QWEN3_V, (t,), generator=g, device="cuda")
    return hidden, weight, targets


@pytest.mark.gpu
def test_gpu_row0_bitwise_across_batch_sizes_qwen3():
    hidden, weight, targets = _qwen3_head(1)
    rows = {}
    for t in (1, 64, 256, 4096):  # 64- and 128-row blocks (T = 256: one wave of 128-row programs)
        batch = torch.randn(t, QWEN3_H, device="cuda").bfloat16()
        batch[0] = hidden[0]
        tgt = torch.randint(0, QWEN3_V, (t,), device="cuda")
        tgt[0] = targets[0]
        out = K.linear_logp(batch, weight, tgt, temperature=0.8, with_entropy=True)
        rows[t] = torch.stack([out.logp[0], out.entropy[0]])
    assert all(torch.equal(rows[1], rows[t]) for t in (64, 256, 4096))


def _fp32_naive(hidden, weight, targets):
    lsm = (hidden.float() @ weight.float().t()).log_softmax(-1)
    return lsm.gather(1, targets[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_support_logits_are_the_references_bits(dtype):
    """On the GPU (cvt.rn rounding, no fma under SUPPORT_OPTIONS) the support logits of Qwen3's
    hidden width are the torch reference's bits, at a decode batch and a training batch of rows."""
    module = _triton_logp_module()
    for t, k in ((128, 300), (1000, 17)):
        hidden, weight, ids = _support_case(t, 4096, 5000, k, dtype, device="cuda", seed=t)
        assert torch.equal(module.support_logits(hidden, weight, ids),
                           logp_module.torch_support_logits(hidden, weight, ids)), (t, k)


@pytest.mark.gpu
def test_gpu_merge_kernel_equals_the_torch_merge_bitwise():
    """On the GPU the one-launch merge is torch_merge_states' bits: the same operations, each
    rounded on its own, libdevice's expf / logf (CUDA's, which torch's kernels call) without
    flush-to-zero. Random states (with -inf chunks), and the chunk states of Qwen3's LM head."""
    module = _triton_logp_module()
    cases = [_merge_inputs(t, n, seed=t, device="cuda") for t, n in ((4096, 64), (3, 16), (7, 1), (5, 40))]
    hidden, weight, targets = _qwen3_head(256)
    st = module.chunk_states(hidden, weight, targets, vocab_start=0, width=logp_module.chunk_width(QWEN3_V),
                             real_vocab_size=QWEN3_V, bias=None, temperature=0.7, with_entropy=True)
    cases.append((st.target_z, st.m, st.s, st.w))
    for tz, m, s, w in cases:
        for with_w in (w, None):
            got = module.merge_states(tz, m, s, with_w)
            ref = logp_module.torch_merge_states(tz, m, s, with_w)
            assert all(b is None and a is None or torch.equal(a, b) for a, b in zip(got, ref)), m.shape


@pytest.mark.gpu
def test_gpu_accuracy_vs_fp32_qwen3():
    hidden, weight, targets = _qwen3_head(4096)
    out = K.linear_logp(hidden, weight, targets, with_entropy=True)
    with torch.no_grad():
        ref_logp, ref_entropy = _fp32_naive(hidden, weight, targets)
    assert (out.logp - ref_logp).abs().max() <= 1e-3
    assert (out.entropy - ref_entropy).abs().max() <= 1e-3


@pytest.mark.gpu
def test_gpu_gradients_vs_fp32_qwen3():
    hidden, weight, targets = _qwen3_head(512)
    hidden.requires_grad_()
    weight.requires_grad_()
    g = torch.randn(512, device="cuda")
    grads = torch.autograd.grad((K.linear_logp(hidden, weight, targets).logp * g).sum(), (hidden, weight))
    h32, w32 = (x.detach().float().requires_grad_() for x in (hidden, weight))
    refs = torch.autograd.grad((_fp32_naive(h32, w32, targets)[0] * g).sum(), (h32, w32))
    for got, ref in zip(grads, refs):
        assert (got.float() - ref).abs().max() <= 2**-6 * ref.abs().max()


@pytest.mark.gpu
def test_gpu_warp_specialized_forward_gives_the_tl_kernels_bits(monkeypatch):
    """The Gluon forward (WS_FORWARD) and the tl kernel give the same chunk states, bit for bit:
    row-block tails (T = 300), chunks ending inside a tile, a K tail (H = 1,000), a TP shard's
    vocab_start with padded columns past the real vocab, targets in and out of the shard, a bias,
    temperatures and entropy; and on Qwen3's head at T = 256 and 4,096. Each case is checked to
    take the Gluon route, so the comparison cannot be the tl kernel against itself."""
    triton_logp = _triton_logp_module()
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialised forward is Hopper's (wgmma)")
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for t, h, v, start, real, bias, temp, ent in [(300, 1000, 9000, 9000, 17000, True, 0.7, True),
                                                   (256, 1000, 9000, 0, 8990, False, None, False),
                                                   (129, 512, 9000, 0, 9000, False, 1.3, True)]:
        hidden = torch.randn(t, h, device="cuda", generator=g).bfloat16()
        weight = (torch.randn(v, h, device="cuda", generator=g) * 0.05).bfloat16()
        targets = torch.randint(max(0, start - 500), start + v + 500, (t,), device="cuda", generator=g)
        kw = dict(vocab_start=start, width=logp_module.chunk_width(v), real_vocab_size=real,
                  bias=torch.randn(v, device="cuda", generator=g).bfloat16() if bias else None, temperature=temp,
                  with_entropy=ent)
        cases.append((hidden, weight, targets, kw))
    for t in (256, 4096):
        hidden, weight, targets = _qwen3_head(t, seed=t)
        cases.append((hidden, weight, targets, dict(vocab_start=0, width=logp_module.chunk_width(QWEN3_V),
                                                    real_vocab_size=QWEN3_V, bias=None, temperature=0.8,
                                                    with_entropy=True)))
    # where it runs by default: Qwen3's head at T = 4,096, not at 256 (one item a program)
    assert [triton_logp._warp_specialized(torch.empty(t, 8, device="cuda", dtype=torch.bfloat16), 64)
            for t in (256, 4096)] == [False, True]
    monkeypatch.setattr(triton_logp, "WS_MIN_ITEMS_PER_PROGRAM", 0)  # every case below: the Gluon kernel
    for hidden, weight, targets, kw in cases:
        n_chunks = -(-weight.shape[0] // kw["width"])
        monkeypatch.setattr(triton_logp, "WS_FORWARD", True)
        assert triton_logp._warp_specialized(hidden, n_chunks), (hidden.shape, n_chunks)
        gluon = triton_logp.chunk_states(hidden, weight, targets, **kw)
        monkeypatch.setattr(triton_logp, "WS_FORWARD", False)
        tl_kernel = triton_logp.chunk_states(hidden, weight, targets, **kw)
        for a, b in zip(gluon, tl_kernel):
            assert (a is None and b is None) or torch.equal(a, b), (hidden.shape, kw)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [64, 4096])
def test_linear_logp_is_captured_in_a_cuda_graph(t):
    """No host sync inside linear_logp: a CUDA graph captures it, and its replays on new inputs (the
    static buffers refilled) give the eager bits; at T = 64 through the tl kernel, at 4,096 through
    the warp-specialised Gluon forward on Hopper."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(t, 512, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(4096, 512, device="cuda", generator=g) * 0.05).bfloat16()
    targets = torch.randint(0, 4000, (t,), device="cuda", generator=g)
    if torch.cuda.get_device_capability()[0] == 9:
        assert _triton_logp_module()._warp_specialized(hidden, logp_module.NUM_VOCAB_CHUNKS) == (t == 4096)
    with K.using_backend("triton"):
        K.linear_logp(hidden, weight, targets, real_vocab_size=4000, temperature=0.7)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = K.linear_logp(hidden, weight, targets, real_vocab_size=4000, temperature=0.7)
        for seed in (1, 2):
            gen = torch.Generator(device="cuda").manual_seed(seed)
            hidden.copy_(torch.randn(hidden.shape, device="cuda", generator=gen).bfloat16())
            targets.copy_(torch.randint(0, 4000, (t,), device="cuda", generator=gen))
            graph.replay()
            eager = K.linear_logp(hidden, weight, targets, real_vocab_size=4000, temperature=0.7)
            assert torch.equal(out.logp, eager.logp)


@pytest.mark.gpu
def test_gpu_sampler_replay_never_synchronises_the_host():
    """The vLLM sampler's replay (the provider route, per-row temperatures, the engine's own ids)
    inside K.skipping_value_checks runs with torch's sync debugger set to raise on any host sync."""
    from lockstep.framework.models.ops import ALL_R, build_ops

    hidden, weight, targets = _qwen3_head(128)
    temperature = torch.full((128,), 0.7, device="cuda")
    ops = build_ops(ALL_R)
    with K.using_backend("triton"):
        ops.logp.linear_logp(hidden, weight, targets, temperature=temperature)  # compile first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with K.skipping_value_checks():
                out = ops.logp.linear_logp(hidden, weight, targets, temperature=temperature)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out.logp).all()


_SM90_PROBE = r"""
import json
from sm90 import compile_sm90
from lockstep.kernels._triton import logp as L

descs = {"h_desc": "tensordesc<bf16[128, 64]>", "w_desc": "tensordesc<bf16[128, 64]>", "b_ptr": "*bf16",
         "temp_ptr": "*fp32", "tgt_ptr": "*i64", "m_ptr": "*fp32", "s_ptr": "*fp32", "ent_ptr": "*fp32",
         "tz_ptr": "*fp32", "z_ptr": "*fp32"}
cfg = L.TILE_CONFIGS[__import__("torch").bfloat16]
out = {}
for mode, load in {"multiply": False, "load_z": True}.items():
    ce = dict(HAS_BIAS=False, HAS_TEMP=True, WITH_ENTROPY=False, UPCAST=False, BLOCK_T=128, BLOCK_V=cfg.block_v,
              BLOCK_K=cfg.block_k, LOG2_V=cfg.block_v.bit_length() - 1, GROUP_T=L.GROUP_T, LOAD_Z=load)
    out[mode] = compile_sm90(L._chunk_states_kernel, lambda n: descs.get(n, "i32"), ce, L.BLOCK_T_WARPS[128],
                             cfg.num_stages)
ce = dict(UPCAST=False, BLOCK_T=128, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, GROUP_T=L.GROUP_T)
out["store_z"] = compile_sm90(L._head_logits_kernel, lambda n: descs.get(n, "i32"), ce, L.BLOCK_T_WARPS[128],
                              cfg.num_stages)
ce = dict(HAS_BIAS=True, HAS_TEMP=True, WITH_ENTROPY=True, UPCAST=False, BLOCK_T=128, BLOCK_V=cfg.block_v,
          BLOCK_K=cfg.block_k, LOG2_V=cfg.block_v.bit_length() - 1, GROUP_T=L.GROUP_T)
dl_descs = dict(descs, gs_ptr="*fp32", gw_ptr="*fp32", gt_ptr="*fp32", out_ptr="*bf16")
out["dlogits"] = compile_sm90(L._dlogits_kernel, lambda n: dl_descs.get(n, "i32"), ce, L.BLOCK_T_WARPS[128],
                              cfg.num_stages)
# the warp-specialised forward as _launch_ws launches it (without and with every option)
from lockstep.kernels._triton.splitk_ws import gluon_layout
ws_descs = dict(descs, h_desc=f"tensordesc<bf16[{L.HALF}, 64],{gluon_layout([L.HALF, 64])!r}>",
                w_desc=f"tensordesc<bf16[{L.WS_BLOCK_V}, 64],{gluon_layout([L.WS_BLOCK_V, 64])!r}>")
for on in (False, True):
    ce = dict(HAS_BIAS=on, HAS_TEMP=on, WITH_ENTROPY=on, LOG2_V=cfg.block_v.bit_length() - 1, GROUP_T=L.GROUP_T,
              STAGES=L.WS_STAGES)
    if not on:
        ce.update(b_ptr=None, temp_ptr=None)
    out[f"ws_{on}"] = compile_sm90(L._chunk_states_ws_kernel, lambda n: ws_descs.get(n, "i32"), ce, 4, 1)
# the support logits at fp32, with the launcher's options and with fusion allowed (the control)
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sup = dict(h_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i64", z_ptr="*fp32", k="i32", H="i32", stride_h="i32",
           stride_w="i32")
for fused in (False, True):
    opts = dict(L.SUPPORT_OPTIONS, num_warps=1, num_stages=1, **(dict(enable_fp_fusion=True) if fused else {}))
    ptx = triton.compile(ASTSource(L._support_logits_kernel, sup, dict(SLOTS=4, LOG2_H=12)),
                         target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
    out[f"support_fma_{fused}"] = len(re.findall(r"\bfma\.", ptx))
print(json.dumps(out))
"""


def test_chunk_state_kernel_variants_compile_for_sm90():
    """Compiled for sm_90 (bf16, 128-row blocks, the table's stages): the multiplying chunk-state
    kernel and the logit-storing kernel run wgmma without spills; every tl kernel, the backward's
    included, fits its shared memory; the variant that folds stored logits keeps them
    in the accumulator's layout (a blocked tile spilled 19 KB and took minutes to compile)."""
    from sm90 import probe

    r = probe(_SM90_PROBE)
    assert {v for v, _ in r["multiply"]["mma"]} == {"3"} and r["multiply"]["spill_bytes"] == 0, r
    assert {v for v, _ in r["store_z"]["mma"]} == {"3"} and r["store_z"]["spill_bytes"] == 0, r
    assert r["load_z"]["spill_bytes"] <= 1024, r
    # the table's stages fit a Hopper SM's 227 KiB of shared memory in every kernel (a launch past
    # it fails with "out of resources"), WS_STAGES in the Gluon forward's
    assert all(r[k]["shared_bytes"] <= 227 * 1024 for k in ("multiply", "load_z", "store_z", "dlogits", "ws_False",
                                                            "ws_True")), r
    # the Gluon forward: wgmma's m64n128 steps (tl.dot's at 128-row blocks), warp-specialised; no
    # spill without the options (bias, temperature, entropy), a little with all of them
    for on in (False, True):
        ws = r[f"ws_{on}"]
        assert ws["mma"] == [["3", "[16, 128, 16]"]] and ws["warp_specialized"], r
        assert ws["spill_bytes"] <= (2048 if on else 0), r
    # the support logits keep each product's rounding apart from its first sum: no fma under the
    # launcher's options (SUPPORT_OPTIONS), where Triton's default fusion makes them
    assert r["support_fma_False"] == 0 and r["support_fma_True"] > 0, r
