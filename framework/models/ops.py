"""The ops a model instance runs on, chosen per module and per side, and counted.

Three modules can each run the lockstep kernels (R) or stock torch ops (P):
  attention  input norm, q/k/v projections, q/k norms, RoPE, the attention core, o projection
             (and its tensor-parallel reduction)
  ffn        post-attention norm, gate/up projections, SwiGLU, down projection (and its reduction)
  logp       final norm, LM head: sampling logits and the token logprob
The logprob of module logp=R goes through the linear-logp provider under the determinism mode's
rules (framework/provider/route.py); P calls the naive path directly. `determinism.mode=off` is
P everywhere. `determinism.stock_ops.<side>` lists single slots (e.g. attention.attention, the
attention core) that run the stock op on that side inside an R module: finer arms for ablations
and `lockstep bisect`. Every slot is wrapped by a counter (`ModelOps.counter`; its `tap`, when set,
sees every op's output: bisect's activation hashes) and the logp route keeps a record
(`ModelOps.record`): the readbacks (framework/consistency/readback.py) report both.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lockstep.kernels as K
from lockstep.framework.provider.route import RouteRecord, compute_linear_logp, load_provider
from lockstep.framework.provider.types import (LinearLogpContext, LinearLogpRequest, LinearLogpResult,
                                               LinearProjection, VocabPartition)

LOCKSTEP_IMPL = "lockstep.kernels"
TORCH_IMPL = "torch"
CASES = ("R/R", "R/P", "P/R", "P/P")  # trainer/rollout
SIDES = ("trainer", "rollout")
MODULES = ("attention", "ffn", "logp")


# every op slot `determinism.stock_ops` may name (the paged core has no stock op: vLLM's stock
# attention is its own backend, chosen with determinism.attention=0)
STOCK_SLOTS = ("attention.linear", "attention.row_linear", "attention.rms_norm", "attention.rope_cos_sin",
               "attention.apply_rope", "attention.attention", "attention.varlen_attention", "ffn.linear", "ffn.row_linear", "ffn.rms_norm",
               "ffn.silu_mul", "logp.rms_norm", "logp.linear")


@dataclass(frozen=True)
class Selection:
    """Which modules of one side run the lockstep kernels, and single slots kept stock in them."""
    attention: bool
    ffn: bool
    logp: bool
    stock: frozenset = frozenset()

    @classmethod
    def for_side(cls, determinism: dict, side: str) -> "Selection":
        if side not in SIDES:
            raise ValueError(f"side {side!r} not in {SIDES}")
        if determinism["mode"] == "off":
            return cls(False, False, False)
        case = determinism["case"]
        if case not in CASES:
            raise ValueError(f"determinism.case={case!r}; valid: {', '.join(CASES)} (trainer/rollout)")
        uses_r = case.split("/")[SIDES.index(side)] == "R"
        stock = frozenset((determinism.get("stock_ops") or {}).get(side) or ())
        bad = sorted(stock - set(STOCK_SLOTS))
        if bad:
            raise ValueError(f"determinism.stock_ops.{side}: {bad} not op slots; valid: {', '.join(STOCK_SLOTS)}")
        return cls(*(uses_r and bool(determinism[m]) for m in MODULES), stock)

    def letters(self) -> dict[str, str]:
        return {m: "R" if getattr(self, m) else "P" for m in MODULES}

    @property
    def any(self) -> bool:
        return self.attention or self.ffn or self.logp


@dataclass(frozen=True)
class AttentionOps:
    linear: Callable  # column-parallel projections (q, k, v): (x, weight) -> x @ weight^T
    linear_rows: Callable  # the same slot on a fused q/k/v weight: (x, weight, sizes) -> one output per row block
    row_linear: Callable  # the o projection: (x, weight shard, tp group | None) -> the reduced output
    rms_norm: Callable
    rope_cos_sin: Callable  # (positions, head_dim, theta) -> cos, sin [..., head_dim] fp32
    apply_rope: Callable  # (x [..., T, H, D], cos, sin [..., T, D]) -> x rotated
    attention: Callable  # (q [B,Tq,H,D], k, v [B,S,Hkv,D], q_pos [B,Tq], scale) -> [B,Tq,H,D]
    # packed sequences: (q [N,H,D], k, v [N,Hkv,D], cu_seqlens [B+1], scale, max_seqlen) -> [N,H,D]
    varlen_attention: Callable
    paged_attention: Callable | None  # lockstep.kernels.paged_attention's signature (R only)


@dataclass(frozen=True)
class FFNOps:
    linear: Callable
    linear_rows: Callable  # on a fused gate/up weight (the linear slot's, as in AttentionOps)
    row_linear: Callable
    rms_norm: Callable
    silu_mul: Callable


@dataclass(frozen=True)
class LogpOps:
    rms_norm: Callable
    linear: Callable  # sampling logits (R: lockstep.kernels.lm_head_logits, fp32)
    linear_logp: Callable  # lockstep.kernels.linear_logp signature -> object with .logp, .entropy
    # the sampling logits are lockstep's and the logprob is the provider route: an engine may pass
    # the logits it sampled from back as linear_logp(..., logits=) (one LM-head pass per step)
    reuse_logits: bool = False


@dataclass(frozen=True)
class ModelOps:
    attention: AttentionOps
    ffn: FFNOps
    logp: LogpOps
    selection: Selection
    mode: str = "strict"
    counter: "OpCounter" = field(default_factory=lambda: OpCounter())
    record: RouteRecord = field(default_factory=RouteRecord)


# ---- the stock (P) implementations -------------------------------------------------------------
def torch_rms_norm(x, weight, eps):
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def torch_linear_rows(x, weight, sizes):
    """One cuBLAS GEMM over a fused weight, split (what vLLM's stock layers do)."""
    return F.linear(x, weight).split(list(sizes), -1)


def torch_silu_mul(gate, up):
    return F.silu(gate) * up


def torch_rope_cos_sin(positions, head_dim, theta):
    """transformers' Qwen3 rotary embedding (default rope type), written out."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
                                / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def torch_apply_rope(x, cos, sin):
    """transformers' apply_rotary_pos_emb (rotate_half) for one tensor laid out [..., T, H, D]."""
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def sdpa_attention(q, k, v, q_pos, scale=None):
    tq, s_len = q.shape[1], k.shape[1]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    causal_full = tq == s_len and bool((q_pos == torch.arange(tq, device=q.device)).all())
    if causal_full:  # training / whole-sequence prefill: the flash-style causal path
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:  # decode / prefill against a cache
        mask = torch.arange(s_len, device=q.device)[None, None, None, :] <= q_pos[:, None, :, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


class _AllReduce(torch.autograd.Function):
    """NCCL's (or gloo's) all-reduce of a row-parallel output; the gradient is replicated, so the
    backward passes it through (megatron's reduce-from-tensor-parallel-region)."""

    @staticmethod
    def forward(ctx, t, group):
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _tp_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def torch_row_linear(x, weight, group=None):
    out = F.linear(x, weight)
    return _AllReduce.apply(out, group) if _tp_size(group) > 1 else out




def naive_linear_logp(hidden, weight, targets, *, bias=None, temperature=None, real_vocab_size=None,
                      with_entropy=False, support_ids=None, vocab_start=0, full_vocab_size=None, group=None,
                      logits=None):
    """The usual path: materialise [T, V] logits, log_softmax, gather (a vocab shard first gathers
    the full logits over its group). `logits` (lockstep's sampling logits) is not used: it multiplies."""
    logits = F.linear(hidden, weight, bias).float()
    if group is not None:
        import torch.distributed.nn.functional as dist_fn

        logits = torch.cat(dist_fn.all_gather(logits.contiguous(), group=group), -1)
    if temperature is not None:
        t = temperature.float().unsqueeze(-1) if isinstance(temperature, torch.Tensor) else float(temperature)
        logits = logits / t
    if real_vocab_size is not None and real_vocab_size < logits.shape[-1]:
        logits[:, real_vocab_size:] = float("-inf")
    if support_ids is not None:
        valid = support_ids >= 0
        logits = logits.gather(1, support_ids.clamp(min=0)).masked_fill(~valid, float("-inf"))
        targets = ((support_ids == targets[:, None]) & valid).float().argmax(1)
    lse = torch.logsumexp(logits, -1)
    logp = logits.gather(1, targets[:, None])[:, 0] - lse
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, -1)
        entropy = lse - (probs * logits.nan_to_num(neginf=0.0)).sum(-1)
    return K.LinearLogpOutput(logp, lse, entropy)


def native_request_logp(request: LinearLogpRequest) -> LinearLogpResult:
    """The provider ABI's native route: the naive path on a request."""
    ctx = request.context
    out = naive_linear_logp(ctx.hidden, ctx.projection.weight, request.target_ids, bias=ctx.projection.bias,
                            temperature=request.temperature, real_vocab_size=ctx.vocab.real_size,
                            with_entropy=request.with_entropy, support_ids=request.support_ids,
                            vocab_start=ctx.vocab.local_start, full_vocab_size=ctx.vocab.padded_size,
                            group=request.tp_group)
    return LinearLogpResult(out.logp, out.entropy, "torch.naive", "none")


# ---- assembly ----------------------------------------------------------------------------------
class OpCounter:
    def __init__(self):
        self.calls: Counter = Counter()
        self.impl: dict[str, str] = {}
        self.tap: Callable[[str, object], None] | None = None  # (slot, output) after every call

    def wrap(self, key: str, impl: str, fn: Callable) -> Callable:
        self.impl[key] = impl
        self.calls[key] += 0

        def counted(*args, **kwargs):
            self.calls[key] += 1  # inside a torch.compile trace: once, when traced
            out = fn(*args, **kwargs)
            if self.tap is not None:
                self.tap(key, out)
            return out

        return counted

    def as_dict(self) -> dict:
        return {k: {"impl": self.impl[k], "calls": self.calls[k]} for k in sorted(self.impl)}


class ProviderLogp:
    """The R route of the logp module: a linear_logp-shaped callable that builds a provider
    request and applies the mode rules."""

    def __init__(self, mode: str, provider_spec: str, record: RouteRecord):
        self.mode, self.record = mode, record
        self.provider, self.import_error = None, None
        try:
            self.provider = load_provider(provider_spec)
        except ImportError as e:  # auto may fall back; strict/audit fail at the first call
            self.import_error = e

    def __call__(self, hidden, weight, targets, *, bias=None, temperature=None, real_vocab_size=None,
                 with_entropy=False, support_ids=None, vocab_start=0, full_vocab_size=None,
                 group=None, logits=None) -> LinearLogpResult:
        full = full_vocab_size or weight.shape[0]
        vocab = VocabPartition(vocab_start, weight.shape[0], real_vocab_size or full, full)
        request = LinearLogpRequest(LinearLogpContext(hidden, LinearProjection(weight, bias), vocab, logits), targets,
                                    temperature, with_entropy, support_ids, tp_group=group)
        return compute_linear_logp(request, self.mode, self.provider, native_request_logp,
                                   import_error=self.import_error, record=self.record)


DEFAULT_PROVIDER = "lockstep.kernels.provider:linear_logp_provider"


def sdpa_varlen_attention(q, k, v, cu_seqlens, scale=None, max_seqlen=None):
    """Packed causal attention with torch's SDPA, one sequence at a time (max_seqlen: unused; the
    bounds are read from cu_seqlens)."""
    out, bounds = [], cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        pos = torch.arange(b - a, device=q.device)[None]
        out.append(sdpa_attention(q[None, a:b], k[None, a:b], v[None, a:b], pos, scale)[0])
    return torch.cat(out) if out else q.new_empty(q.shape)


def build_ops(selection: Selection, *, mode: str = "strict", provider: str = DEFAULT_PROVIDER) -> ModelOps:
    counter, record = OpCounter(), RouteRecord()
    kernels_impl = f"{LOCKSTEP_IMPL}[{K.get_backend()}]"

    def pick(module: str, op: str, lockstep_fn: Callable | None, torch_fn: Callable | None,
             slot: str | None = None) -> Callable | None:
        """`slot`: the stock_ops slot that decides this op, when it is another op's (linear_rows: linear)."""
        use_r = getattr(selection, module) and f"{module}.{slot or op}" not in selection.stock
        fn = lockstep_fn if use_r else torch_fn
        return None if fn is None else counter.wrap(f"{module}.{op}", kernels_impl if use_r else TORCH_IMPL, fn)

    attention = AttentionOps(pick("attention", "linear", K.linear, F.linear),
                             pick("attention", "linear_rows", K.linear_rows, torch_linear_rows, slot="linear"),
                             pick("attention", "row_linear", K.row_parallel_linear, torch_row_linear),
                             pick("attention", "rms_norm", K.rms_norm, torch_rms_norm),
                             pick("attention", "rope_cos_sin", K.rope_cos_sin, torch_rope_cos_sin),
                             pick("attention", "apply_rope", K.apply_rope, torch_apply_rope),
                             pick("attention", "attention", K.causal_attention, sdpa_attention),
                             pick("attention", "varlen_attention", K.varlen_attention, sdpa_varlen_attention),
                             pick("attention", "paged_attention", K.paged_attention, None))
    ffn = FFNOps(pick("ffn", "linear", K.linear, F.linear),
                 pick("ffn", "linear_rows", K.linear_rows, torch_linear_rows, slot="linear"),
                 pick("ffn", "row_linear", K.row_parallel_linear, torch_row_linear),
                 pick("ffn", "rms_norm", K.rms_norm, torch_rms_norm),
                 pick("ffn", "silu_mul", K.silu_mul, torch_silu_mul))
    if selection.logp:
        logp_fn = counter.wrap("logp.linear_logp", f"provider:{provider}", ProviderLogp(mode, provider, record))
    else:
        logp_fn = counter.wrap("logp.linear_logp", TORCH_IMPL, naive_linear_logp)
    lockstep_logits = selection.logp and "logp.linear" not in selection.stock
    logp = LogpOps(pick("logp", "rms_norm", K.rms_norm, torch_rms_norm),
                   pick("logp", "linear", K.lm_head_logits, F.linear), logp_fn,
                   reuse_logits=lockstep_logits)
    return ModelOps(attention, ffn, logp, selection, mode, counter, record)


def ops_for_side(determinism: dict, side: str) -> ModelOps:
    """The ops one side of a run computes with, as its determinism config chooses them."""
    return build_ops(Selection.for_side(determinism, side), mode=determinism["mode"],
                     provider=determinism.get("provider", DEFAULT_PROVIDER))


ALL_R = Selection(True, True, True)
ALL_P = Selection(False, False, False)
