"""Batch invariance of every lockstep op (torch reference backend): a row computed alone, inside
batches of random sizes with random neighbours, at random positions, and with padding gives the
same bits; accuracy against float64; gradients against an autograd float64 reference."""
import math

import pytest
import torch
import torch.nn.functional as F

import lockstep.kernels as K

SIZES = [1, 2, 5, 16, 17, 40, 130]


def _embed_row(row, m, pos, make):
    batch = make(m)
    batch[pos] = row
    return batch


def _check_rowwise(fn, make, row):
    ref = fn(row.unsqueeze(0))[0]
    for m in SIZES:
        for pos in {0, m // 2, m - 1}:
            out = fn(_embed_row(row, m, pos, make))[pos]
            assert torch.equal(out, ref), f"row changed at batch size {m}, position {pos}"


@pytest.mark.parametrize("k,n", [(48, 96), (64, 1), (4096, 1), (4096, 16), (4096, 300)])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_batch_invariant(k, n, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w = torch.randn(n, k)
        _check_rowwise(lambda x: K.linear(x, w), lambda m: torch.randn(m, k), torch.randn(k))
    finally:
        torch.set_num_threads(before)


def test_linear_accuracy_and_grad():
    x = torch.randn(33, 48, requires_grad=True)
    w = torch.randn(20, 48, requires_grad=True)
    b = torch.randn(20, requires_grad=True)
    out = K.linear(x, w, b)
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = F.linear(xd, wd, bd)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, w, b), g)
    refs = torch.autograd.grad(ref, (xd, wd, bd), g.double())
    for a, r in zip(grads, refs):
        assert torch.allclose(a.double(), r, rtol=1e-4, atol=1e-4)


def test_matmul_shape_error():
    with pytest.raises(ValueError, match="matmul expects"):
        K.matmul(torch.randn(3, 4), torch.randn(5, 6))


def test_rms_norm_invariant_and_accurate():
    w = torch.randn(80)
    fn = lambda x: K.rms_norm(x, w, 1e-6)
    _check_rowwise(fn, lambda m: torch.randn(m, 80), torch.randn(80))
    x = torch.randn(7, 80)
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert torch.allclose(fn(x).double(), ref, rtol=1e-5, atol=1e-6)


def test_silu_mul_invariant_accurate_and_grad():
    _check_rowwise(lambda x: K.silu_mul(x[:, :24], x[:, 24:]), lambda m: torch.randn(m, 48) * 4,
                   torch.randn(48) * 4)
    g = (torch.randn(6, 24) * 30).requires_grad_()
    u = torch.randn(6, 24).requires_grad_()
    out = K.silu_mul(g, u)
    gd, ud = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    ref = F.silu(gd) * ud
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    a = torch.autograd.grad(out, (g, u), grad)
    r = torch.autograd.grad(ref, (gd, ud), grad.double())
    for x, y in zip(a, r):
        assert torch.isfinite(x).all()
        assert torch.allclose(x.double(), y, rtol=1e-4, atol=1e-5)


def test_rope_depends_only_on_position():
    cos, sin = K.rope_cos_sin(torch.arange(50), 16, 10000.0)
    c1, s1 = K.rope_cos_sin(torch.tensor([37]), 16, 10000.0)
    assert torch.equal(cos[37], c1[0]) and torch.equal(sin[37], s1[0])
    x = torch.randn(50, 4, 16)
    full = K.apply_rope(x, cos, sin)
    alone = K.apply_rope(x[37:38], c1, s1)
    assert torch.equal(full[37], alone[0])
    # accuracy: rotation preserves the norm of each (i, i + D/2) pair
    assert torch.allclose(full.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)


def _attention_f64(q, k, v, q_pos):
    b, tq, h, d = q.shape
    g = h // k.shape[2]
    kk = k.double().repeat_interleave(g, 2)
    vv = v.double().repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) / math.sqrt(d)
    mask = torch.arange(k.shape[1])[None, None, None, :] > q_pos[:, None, :, None]
    s = s.masked_fill(mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv)


@pytest.mark.parametrize("d", [16, 128])
def test_attention_training_prefill_decode_identical(d):
    torch.manual_seed(1)
    b, s, h, hkv = 3, 41, 4, 2
    q, k, v = torch.randn(b, s, h, d), torch.randn(b, s, hkv, d), torch.randn(b, s, hkv, d)
    pos = torch.arange(s).expand(b, s)
    train = K.causal_attention(q, k, v, pos)
    assert torch.allclose(train.double(), _attention_f64(q, k, v, pos), atol=1e-5)
    # prefill of the first 20 tokens of sequence 1 alone
    pre = K.causal_attention(q[1:2, :20], k[1:2, :20], v[1:2, :20], pos[1:2, :20])
    assert torch.equal(pre[0], train[1, :20])
    # decode of each later token of sequence 1 alone, against a larger zero-padded cache
    kc = torch.zeros(1, 64, hkv, d)
    vc = torch.zeros(1, 64, hkv, d)
    kc[0, :s], vc[0, :s] = k[1], v[1]
    for t in (20, 31, 32, 40):
        dec = K.causal_attention(q[1:2, t:t + 1], kc, vc, torch.tensor([[t]]))
        assert torch.equal(dec[0, 0], train[1, t]), f"decode of token {t} differs from training"
    # same tokens inside a batch of 7 random decodes at random positions
    qb = torch.randn(7, 1, h, d)
    kb, vb = torch.randn(7, 64, hkv, d), torch.randn(7, 64, hkv, d)
    pb = torch.randint(0, 64, (7, 1))
    qb[4, 0], kb[4], vb[4], pb[4, 0] = q[1, 40], kc[0], vc[0], 40
    assert torch.equal(K.causal_attention(qb, kb, vb, pb)[4, 0], train[1, 40])


def test_attention_grad_matches_reference():
    b, s, h, hkv, d = 2, 19, 4, 1, 8
    q = torch.randn(b, s, h, d, requires_grad=True)
    k = torch.randn(b, s, hkv, d, requires_grad=True)
    v = torch.randn(b, s, hkv, d, requires_grad=True)
    pos = torch.arange(s).expand(b, s)
    out = K.causal_attention(q, k, v, pos)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(_attention_f64(qd, kd, vd, pos), (qd, kd, vd), g.double())
    for a, r in zip(grads, ref):
        assert torch.allclose(a.double(), r, atol=1e-5)


def _naive_logp(h, w, t, temp=1.0, real=None):
    z = (h.double() @ w.double().t()) / temp
    if real is not None:
        z[:, real:] = float("-inf")
    lsm = z.log_softmax(-1)
    return lsm.gather(1, t[:, None])[:, 0], -(lsm.exp() * lsm.nan_to_num(neginf=0)).sum(-1)


@pytest.mark.parametrize("vocab,real", [(50, None), (64, 57), (2 * 4096 + 300, None)])
def test_linear_logp_accuracy(vocab, real):
    torch.manual_seed(2)
    h, w = torch.randn(11, 32), torch.randn(vocab, 32) * 0.3
    t = torch.randint(0, real or vocab, (11,))
    out = K.linear_logp(h, w, t, temperature=0.7, real_vocab_size=real, with_entropy=True)
    ref, ent = _naive_logp(h, w, t, 0.7, real)
    assert torch.allclose(out.logp.double(), ref, atol=2e-5)
    assert torch.allclose(out.entropy.double(), ent, atol=2e-5)


def test_linear_logp_batch_invariant():
    w = torch.randn(300, 32)
    for temp in (1.0, 0.6):
        def fn(x):
            return K.linear_logp(x[:, :32], w, x[:, 32].long(), temperature=temp, with_entropy=True).logp
        row = torch.cat([torch.randn(32), torch.tensor([123.0])])
        _check_rowwise(fn, lambda m: torch.cat([torch.randn(m, 32), torch.randint(0, 300, (m, 1)).float()], 1), row)


def test_linear_logp_support_replay():
    torch.manual_seed(3)
    h, w = torch.randn(5, 16), torch.randn(40, 16)
    ids = torch.tensor([[3, 7, 9, -1], [1, -1, -1, -1], [0, 39, 2, 5], [11, 12, -1, -1], [4, 5, 6, 7]])
    t = torch.tensor([7, 1, 39, 11, 6])
    out = K.linear_logp(h, w, t, support_ids=ids, with_entropy=True)
    for r in range(5):
        keep = ids[r][ids[r] >= 0]
        z = (h[r].double() @ w[keep].double().t()).log_softmax(-1)
        assert abs(out.logp[r].item() - z[(keep == t[r]).nonzero()[0, 0]].item()) < 1e-5
    assert out.logp[1].item() == 0.0  # a support of one token has probability 1
    # width of the padded support never changes the result
    wide = torch.cat([ids, torch.full((5, 9), -1)], 1)
    assert torch.equal(K.linear_logp(h, w, t, support_ids=wide).logp, out.logp)
    with pytest.raises(ValueError, match="not in its support"):
        K.linear_logp(h, w, torch.tensor([8, 1, 39, 11, 6]), support_ids=ids)


def test_linear_logp_grad_matches_reference():
    h = torch.randn(6, 16, requires_grad=True)
    w = torch.randn(70, 16, requires_grad=True)
    t = torch.randint(0, 70, (6,))
    out = K.linear_logp(h, w, t, temperature=0.8)
    g = torch.randn(6)
    gh, gw = torch.autograd.grad(out.logp, (h, w), g)
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = ((hd @ wd.t()) / 0.8).log_softmax(-1).gather(1, t[:, None])[:, 0]
    rh, rw = torch.autograd.grad(ref, (hd, wd), g.double())
    assert torch.allclose(gh.double(), rh, atol=1e-5) and torch.allclose(gw.double(), rw, atol=1e-5)


def test_linear_logp_reference_groups_never_change_a_bit(monkeypatch):
    """The reference folds whole vocab chunks in groups bounded by memory: one chunk per group
    (the chunk-at-a-time loop it replaced) and every chunk in one group give the same values and
    gradients, with bias, temperature, padding columns and entropy, and from passed-back logits."""
    from lockstep.kernels import logp as L

    torch.manual_seed(5)
    h = torch.randn(9, 16, requires_grad=True)
    w = (torch.randn(301, 16) * 0.3).requires_grad_()
    bias, t = torch.randn(301), torch.randint(0, 290, (9,))

    def run():
        out = K.linear_logp(h, w, t, bias=bias, temperature=torch.full((9,), 0.7), real_vocab_size=290,
                            with_entropy=True)
        with torch.no_grad():
            reused = K.linear_logp(h, w, t, temperature=0.7, logits=K.lm_head_logits(h, w)).logp
        return (out.logp, out.entropy, *torch.autograd.grad((out.logp + out.entropy).sum(), (h, w)), reused)

    whole = run()
    monkeypatch.setattr(L, "_GROUP_ELEMENTS", 1)  # one chunk per group
    for a, b in zip(whole, run()):
        assert torch.equal(a, b)


def test_backend_selection_errors():
    with pytest.raises(ValueError, match="valid: torch, triton"):
        K.set_backend("cuda-magic")


def test_support_order_never_matters():
    torch.manual_seed(4)
    h, w = torch.randn(3, 16), torch.randn(40, 16)
    ids = torch.tensor([[3, 7, 9, 30, -1], [5, 1, -1, -1, -1], [39, 0, 2, 8, 11]])
    t = torch.tensor([9, 1, 8])
    ref = K.linear_logp(h, w, t, support_ids=ids)
    shuffled = torch.stack([row[torch.randperm(5)] for row in ids])
    assert torch.equal(K.linear_logp(h, w, t, support_ids=shuffled).logp, ref.logp)
