"""Mode rules for computing linear logprobs through a provider, and the record of what ran.

  off     never calls a provider: the native (stock torch) path computes every logprob.
  auto    the provider, falling back to native only when it cannot be imported or raises an
          exception carrying the `linear_logp_provider_unavailable` signal. Any other provider
          exception, and any malformed result, fails the run: a bug is never papered over.
  strict  the provider, failing closed: an unavailable provider is an error, and results must
          carry non-empty backend_id/contract_id and stay attached to autograd when the input is.
  audit   strict, plus route evidence (backend, contract, shapes) recorded for every call.
"""
from __future__ import annotations

import importlib
from collections import Counter
from typing import Callable

import torch

from lockstep.framework.provider.types import LinearLogpRequest, LinearLogpResult, is_unavailable_signal
from lockstep.kernels import value_checks_enabled

MODES = ("off", "auto", "strict", "audit")
FAIL_CLOSED = ("strict", "audit")
EVIDENCE_KEEP = 8  # route-evidence entries kept verbatim per process (all are counted)


class ProviderError(RuntimeError):
    """A provider failed, was unavailable where that is not allowed, or returned a bad result."""


def load_provider(spec: str) -> Callable:
    """'package.module:callable' -> the callable. ImportError propagates (auto may fall back)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"provider {spec!r} must be named 'package.module:callable'")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportError(f"provider module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"provider {spec!r} is not callable")
    return obj


class RouteRecord:
    """What the logp route of one process did: the raw material of its readback."""

    def __init__(self):
        self.calls = Counter()  # "provider" / "native"
        self.fallbacks = Counter()  # reason -> count
        self.backends = Counter()  # backend_id -> count
        self.contracts = Counter()
        self.evidence: list[dict] = []
        self.evidence_count = 0

    def as_dict(self) -> dict:
        return {"calls": dict(self.calls), "fallbacks": dict(self.fallbacks), "backend_ids": dict(self.backends),
                "contract_ids": dict(self.contracts), "evidence_count": self.evidence_count,
                "evidence": self.evidence}


def _check_tensor(name, t, request: LinearLogpRequest) -> None:
    h = request.context.hidden
    if not isinstance(t, torch.Tensor):
        raise ProviderError(f"provider result .{name} is {type(t).__name__}, not a tensor")
    if tuple(t.shape) != (request.num_tokens,):
        raise ProviderError(f"provider result .{name} has shape {tuple(t.shape)}, expected [{request.num_tokens}]")
    if t.dtype != torch.float32:
        raise ProviderError(f"provider result .{name} has dtype {t.dtype}, expected torch.float32")
    if t.device != h.device:
        raise ProviderError(f"provider result .{name} is on {t.device}, the request on {h.device}")
    if t.numel() and value_checks_enabled() and not bool(torch.isfinite(t.detach()).all()):
        raise ProviderError(f"provider result .{name} has non-finite values")


def _validate(raw, request: LinearLogpRequest, mode: str) -> LinearLogpResult:
    missing = [a for a in ("logp", "entropy", "backend_id", "contract_id") if not hasattr(raw, a)]
    if missing:
        raise ProviderError(f"provider result lacks attribute(s) {missing}")
    _check_tensor("logp", raw.logp, request)
    entropy = raw.entropy
    if request.with_entropy and entropy is None:
        raise ProviderError("entropy was requested but the provider returned none")
    if not request.with_entropy and entropy is not None:
        if mode in FAIL_CLOSED:
            raise ProviderError("the provider returned entropy that was not requested")
        entropy = None
    if entropy is not None:
        _check_tensor("entropy", entropy, request)
    backend_id, contract_id = str(raw.backend_id or ""), str(raw.contract_id or "")
    if mode in FAIL_CLOSED:
        if not backend_id or not contract_id:
            raise ProviderError(f"{mode} mode needs a non-empty backend_id and contract_id, got "
                                f"{backend_id!r} / {contract_id!r}")
        w = request.context.projection.weight
        wants_grad = torch.is_grad_enabled() and (request.context.hidden.requires_grad or w.requires_grad)
        if wants_grad and raw.logp.grad_fn is None:
            raise ProviderError("the provider's logp is detached from autograd although its input requires grad")
    return LinearLogpResult(raw.logp, entropy, backend_id, contract_id, dict(getattr(raw, "provenance", {}) or {}))


def compute_linear_logp(request: LinearLogpRequest, mode: str, provider: Callable | None,
                        native: Callable[[LinearLogpRequest], LinearLogpResult], *,
                        import_error: BaseException | None = None,
                        record: RouteRecord | None = None) -> LinearLogpResult:
    if mode not in MODES:
        raise ValueError(f"unknown determinism mode {mode!r}; valid: {', '.join(MODES)}")
    record = record if record is not None else RouteRecord()

    def fallback(reason: str) -> LinearLogpResult:
        record.fallbacks[reason] += 1
        record.calls["native"] += 1
        return native(request)

    if mode == "off":
        record.calls["native"] += 1
        return native(request)
    if provider is None:
        why = f"{type(import_error).__name__}: {import_error}" if import_error else "no provider configured"
        if mode == "auto" and isinstance(import_error, ImportError):
            return fallback(f"import failed: {why}")
        raise ProviderError(f"{mode} mode needs a linear-logp provider, and it is unavailable ({why})")
    try:
        raw = provider(request)
    except Exception as e:  # noqa: BLE001 - classified below, never swallowed
        if is_unavailable_signal(e):
            if mode == "auto":
                return fallback(f"unavailable: {e}")
            raise ProviderError(f"{mode} mode fails closed: the provider signalled unavailable ({e})") from e
        raise ProviderError(f"the linear-logp provider raised {type(e).__name__}: {e}") from e
    result = _validate(raw, request, mode)
    record.calls["provider"] += 1
    record.backends[result.backend_id] += 1
    record.contracts[result.contract_id] += 1
    if mode == "audit":
        record.evidence_count += 1
        if len(record.evidence) < EVIDENCE_KEEP:
            record.evidence.append({"backend_id": result.backend_id, "contract_id": result.contract_id,
                                    "tokens": request.num_tokens, "hidden": list(request.context.hidden.shape),
                                    "vocab": [request.context.vocab.local_start, request.context.vocab.local_size],
                                    "support": request.support_ids is not None,
                                    "token_layout": vars(request.token_layout), "provenance": result.provenance})
    return result
