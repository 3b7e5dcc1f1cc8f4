"""The provider ABI and its mode rules, against a table of malformed provider results."""
from types import SimpleNamespace

import pytest
import torch

from lockstep.framework.models.ops import native_request_logp
from lockstep.framework.provider import (LinearLogpContext, LinearLogpProviderUnavailable, LinearLogpRequest,
                                         LinearProjection, ProviderError, RouteRecord, TokenLayout, VocabPartition,
                                         compute_linear_logp, load_provider)
from lockstep.kernels.provider import linear_logp_provider


def request(with_entropy=False, grad=False, T=5, V=24, H=8):
    torch.manual_seed(0)
    h = torch.randn(T, H, requires_grad=grad)
    w = torch.randn(V, H)
    return LinearLogpRequest(LinearLogpContext(h, LinearProjection(w), VocabPartition.whole(V, V - 2)),
                             torch.randint(0, V - 2, (T,)), with_entropy=with_entropy)


def good(req):
    return linear_logp_provider(req)


def mutate(**changes):
    def provider(req):
        out = vars(good(req)).copy()
        for k, fn in changes.items():
            out[k] = fn(out[k]) if callable(fn) else fn
        return SimpleNamespace(**out)
    return provider


class Unavailable(Exception):
    linear_logp_provider_unavailable = True  # the attribute, not the lockstep class


def raises(exc):
    def provider(req):
        raise exc
    return provider


MALFORMED = [  # (name, provider, request kwargs, error pattern)
    ("wrong shape", mutate(logp=lambda t: t[:-1]), {}, r"shape \(4,\), expected \[5\]"),
    ("2-d logp", mutate(logp=lambda t: t[:, None]), {}, r"shape \(5, 1\)"),
    ("wrong dtype", mutate(logp=lambda t: t.double()), {}, r"dtype torch.float64, expected torch.float32"),
    ("wrong device", mutate(logp=lambda t: t.to("meta")), {}, r"is on meta"),
    ("NaN", mutate(logp=lambda t: t.clone().index_fill(0, torch.tensor([2]), float("nan"))), {}, r"non-finite"),
    ("inf", mutate(logp=lambda t: t.clone().index_fill(0, torch.tensor([0]), float("-inf"))), {}, r"non-finite"),
    ("not a tensor", mutate(logp=lambda t: t.tolist()), {}, r"is list, not a tensor"),
    ("missing backend_id", mutate(backend_id=""), {}, r"non-empty backend_id and contract_id"),
    ("missing contract_id", mutate(contract_id=None), {}, r"non-empty backend_id and contract_id"),
    ("missing attribute", lambda req: SimpleNamespace(logp=good(req).logp), {}, r"lacks attribute"),
    ("detached grad", mutate(logp=lambda t: t.detach()), {"grad": True}, r"detached from autograd"),
    ("entropy absent", mutate(entropy=None), {"with_entropy": True}, r"entropy was requested"),
    ("entropy unasked", mutate(entropy=lambda e: torch.zeros(5)), {}, r"not requested"),
    ("entropy bad shape", mutate(entropy=lambda e: e[:2]), {"with_entropy": True}, r"\.entropy has shape"),
    ("ValueError", raises(ValueError("bug")), {}, r"raised ValueError: bug"),
    ("RuntimeError", raises(RuntimeError("cuda oops")), {}, r"raised RuntimeError"),
    ("ImportError at call time", raises(ImportError("lazy")), {}, r"raised ImportError"),
    ("unavailable signal", raises(Unavailable("no gpu")), {}, r"fails closed.*no gpu"),
    ("lockstep unavailable class", raises(LinearLogpProviderUnavailable("off")), {}, r"fails closed"),
]


@pytest.mark.parametrize("mode", ["strict", "audit"])
@pytest.mark.parametrize("name,provider,kw,pattern", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_strict_rejects_malformed_results(mode, name, provider, kw, pattern):
    with pytest.raises(ProviderError, match=pattern):
        compute_linear_logp(request(**kw), mode, provider, native_request_logp)


@pytest.mark.parametrize("name,provider,kw,pattern", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_auto_falls_back_only_for_unavailability(name, provider, kw, pattern):
    record = RouteRecord()
    req = request(**kw)
    only_strict = name in ("missing backend_id", "missing contract_id", "detached grad", "entropy unasked")
    if "unavailable" in name:
        out = compute_linear_logp(req, "auto", provider, native_request_logp, record=record)
        assert out.backend_id == "torch.naive" and sum(record.fallbacks.values()) == 1
    elif only_strict:  # auto accepts these (ids/autograd are strict-mode requirements)
        compute_linear_logp(req, "auto", provider, native_request_logp, record=record)
        assert not record.fallbacks
    else:
        with pytest.raises(ProviderError, match=pattern):
            compute_linear_logp(req, "auto", provider, native_request_logp, record=record)
        assert not record.fallbacks


def test_auto_falls_back_on_import_failure_strict_does_not():
    with pytest.raises(ModuleNotFoundError):
        load_provider("no_such_pkg.mod:fn")
    err = ImportError("No module named 'no_such_pkg'")
    record = RouteRecord()
    out = compute_linear_logp(request(), "auto", None, native_request_logp, import_error=err, record=record)
    assert out.backend_id == "torch.naive" and "import failed" in next(iter(record.fallbacks))
    for mode in ("strict", "audit"):
        with pytest.raises(ProviderError, match="unavailable"):
            compute_linear_logp(request(), mode, None, native_request_logp, import_error=err)


def test_off_never_calls_the_provider():
    def forbidden(req):
        raise AssertionError("off mode called the provider")
    record = RouteRecord()
    out = compute_linear_logp(request(), "off", forbidden, native_request_logp, record=record)
    assert out.backend_id == "torch.naive" and record.calls == {"native": 1}


def test_good_provider_in_every_mode_and_audit_evidence():
    for mode in ("auto", "strict", "audit"):
        record = RouteRecord()
        req = request(with_entropy=True, grad=True)
        out = compute_linear_logp(req, mode, good, native_request_logp, record=record)
        assert out.logp.grad_fn is not None and out.entropy is not None
        assert out.backend_id == "lockstep.kernels/torch" and out.contract_id.startswith("lockstep.linear_logp.v2")
        assert record.calls == {"provider": 1}
        assert bool(record.evidence) == (mode == "audit")
    ref = native_request_logp(request())
    assert torch.allclose(compute_linear_logp(request(), "strict", good, native_request_logp).logp, ref.logp, atol=1e-5)


def test_unknown_mode_and_bad_spec():
    with pytest.raises(ValueError, match="valid: off, auto, strict, audit"):
        compute_linear_logp(request(), "paranoid", good, native_request_logp)
    with pytest.raises(ValueError, match="package.module:callable"):
        load_provider("lockstep.kernels.provider")
    assert load_provider("lockstep.kernels.provider:linear_logp_provider") is linear_logp_provider


@pytest.mark.parametrize("build,pattern", [
    (lambda: TokenLayout(world_size=2, rank=2), "rank 2 not in"),
    (lambda: TokenLayout(layout="ring"), "layout 'ring'"),
    (lambda: VocabPartition(0, 10, 12, 10), "real_size 12"),
    (lambda: VocabPartition(8, 10, 10, 16), "outside"),
    (lambda: LinearProjection(torch.randn(4)), "weight must be"),
    (lambda: LinearProjection(torch.randn(4, 2), torch.randn(3)), "bias"),
    (lambda: LinearLogpContext(torch.randn(3, 5), LinearProjection(torch.randn(4, 6)), VocabPartition.whole(4)), "H=5"),
    (lambda: LinearLogpContext(torch.randn(3, 6).double(), LinearProjection(torch.randn(4, 6)), VocabPartition.whole(4)), "float64"),
    (lambda: LinearLogpContext(torch.randn(3, 6), LinearProjection(torch.randn(4, 6)), VocabPartition.whole(5)), "local_size 5"),
    (lambda: LinearLogpRequest(request().context, torch.zeros(4, dtype=torch.long)), r"target_ids must be \[T=5\]"),
    (lambda: LinearLogpRequest(request().context, torch.zeros(5)), "must be integer"),
    (lambda: LinearLogpRequest(request().context, torch.full((5,), 23)), r"outside \[0, 22\)"),
    (lambda: LinearLogpRequest(request().context, torch.zeros(5, dtype=torch.long), temperature=0.0), "> 0"),
    (lambda: LinearLogpRequest(request().context, torch.zeros(5, dtype=torch.long), support_ids=torch.zeros(5)), r"\[T, k\]"),
])
def test_abi_types_validate_on_construction(build, pattern):
    with pytest.raises(ValueError, match=pattern):
        build()


def test_skipping_value_checks_drops_only_the_host_synchronising_checks():
    """Inside K.skipping_value_checks (the vLLM sampler's replay of its own sampled ids) the value
    checks that read device values are skipped; shape checks still run; outside, both fire."""
    import lockstep.kernels as K

    nan = mutate(logp=lambda t: t.clone().index_fill(0, torch.tensor([2]), float("nan")))
    h, w = torch.randn(3, 8), torch.randn(24, 8)
    with pytest.raises(ProviderError, match="non-finite"):
        compute_linear_logp(request(), "strict", nan, native_request_logp)
    with pytest.raises(ValueError, match="target ids must lie"):
        K.linear_logp(h, w, torch.tensor([0, 30, 1]), real_vocab_size=24)
    with K.skipping_value_checks():
        assert not K.value_checks_enabled()
        assert torch.isnan(compute_linear_logp(request(), "strict", nan, native_request_logp).logp[2])
        K.linear_logp(h, w, torch.tensor([0, 23, 1]), real_vocab_size=24)
        with pytest.raises(ProviderError, match="shape"):
            compute_linear_logp(request(), "strict", mutate(logp=lambda t: t[:-1]), native_request_logp)
    assert K.value_checks_enabled()
