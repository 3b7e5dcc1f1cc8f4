"""Fused LM-head projection + log-softmax + gather: `linear_logp`.

Numerics (identical on every side and for every vocab sharding):
- the full (unsharded) vocab of V columns is cut into NUM_VOCAB_CHUNKS virtual chunks of
  `chunk_width(V)` columns; a tensor-parallel shard of any size dividing NUM_VOCAB_CHUNKS holds
  whole chunks (the canonical partition: shards are subtrees of the finest partition);
- each chunk yields a softmax state (max, sum exp, sum exp*z) computed by the backend;
- chunk states merge in one balanced tree over the global chunk index. A sharded call gathers the
  states of every rank in rank order first, so it merges exactly the same leaves in the same tree
  and equals the single-device result bit for bit;
- temperature divides the fp32 logits at exactly one point; columns at or beyond
  `real_vocab_size` (padding) are -inf;
- with `support_ids` [T, k] (-1 = unused slot) the softmax runs over those ids only (top-p replay),
  taken as a set: rows are sorted before reducing, so the listing order never matters.
The [T, V] logits are never materialised at once: the torch reference builds groups of whole
chunks of at most 64 MiB, the Triton backend one tile at a time.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from lockstep.kernels._backend import KernelOp, value_checks_enabled
from lockstep.kernels._invariant import tiled_mm, tree_sum

# 64: a decode batch of 128 rows (two 64-row blocks) gives 128 programs for 132 SMs (32 left half
# of them idle), and Qwen3's 151,936 columns make chunks of 2,374 = 18.5 tiles of 128, the same
# 2.4% of partly masked tile work as 32 chunks of 37.1 tiles.
NUM_VOCAB_CHUNKS = 64
_NEG_INF = float("-inf")


class LinearLogpOutput(NamedTuple):
    logp: torch.Tensor  # [T] fp32
    lse: torch.Tensor  # [T] fp32
    entropy: torch.Tensor | None  # [T] fp32 when requested


class ChunkStates(NamedTuple):
    """Softmax states of the chunks held locally: m, s, w [T, n_local] (w None without entropy) and
    the target's logit [T] (exactly 0 where the target lies in another shard)."""
    m: torch.Tensor
    s: torch.Tensor
    w: torch.Tensor | None
    target_z: torch.Tensor


def chunk_width(full_vocab_size: int) -> int:
    return -(-full_vocab_size // NUM_VOCAB_CHUNKS)


def _safe(m: torch.Tensor) -> torch.Tensor:
    """A max of -inf (all entries masked) becomes 0 so that exp(-inf - 0) = 0 instead of NaN."""
    return torch.where(m == _NEG_INF, 0.0, m)


def _scale(z: torch.Tensor, temperature) -> torch.Tensor:
    """z / temperature, always as a division by a per-row fp32 tensor: a Python-float divisor takes
    another kernel on CUDA (a multiplication by its reciprocal), which rounds differently, so a caller
    passing 0.7 and one passing a tensor of 0.7s would part by an ulp."""
    if temperature is None:
        return z
    t = torch.as_tensor(temperature, dtype=torch.float32, device=z.device)
    t = t.expand(z.shape[0]) if t.dim() == 0 else t
    return z / t.reshape(-1, *([1] * (z.dim() - 1)))


def _state(z: torch.Tensor, with_entropy: bool):
    """z [T, C] fp32 (masked entries -inf) -> (max, sum exp(z - max), sum exp(z - max) * z)."""
    m = z.detach().amax(-1)
    p = torch.exp(z - _safe(m).unsqueeze(-1))
    s = tree_sum(p)
    w = tree_sum(p * torch.where(torch.isinf(z), torch.zeros_like(z), z)) if with_entropy else None
    return m, s, w


def _products(hidden, weight, lo, hi, width):
    """The reference's products of vocab columns [lo, hi) (whole chunks from lo): one fixed-shape
    GEMM per row tile and chunk, in hidden's dtype."""
    return torch.cat([tiled_mm(hidden, weight[c:min(c + width, hi)].t()) for c in range(lo, hi, width)], -1)


def torch_head_logits(hidden, weight, *, width) -> torch.Tensor:
    """[T, V_local] fp32: the products the chunk states are built from (before bias, temperature
    and the padding mask), chunk by chunk as torch_chunk_states makes them."""
    return _products(hidden, weight, 0, weight.shape[0], width).float()


_GROUP_ELEMENTS = 1 << 24  # fp32 logits the reference holds at once (64 MiB), in whole chunks


def torch_chunk_states(hidden, weight, targets, *, vocab_start, width, real_vocab_size, bias, temperature,
                       with_entropy, logits=None) -> ChunkStates:
    """The torch reference: one fixed-shape GEMM per chunk (or its products from `logits`, as
    torch_head_logits gave them: exact in hidden's dtype), a tree sum across its columns. What
    follows the products is elementwise (and max, exact in any order) per chunk row, so it runs on
    a group of whole chunks at once, as [T, chunks, width] (a short last chunk padded with -inf:
    exact zeros in the sums), with the bits of one chunk at a time."""
    v = weight.shape[0]
    if logits is not None and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        logits = None  # the same products, multiplied again so that autograd sees them
    local = targets - vocab_start
    target_z = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    states = []
    step = width * max(1, _GROUP_ELEMENTS // max(1, hidden.shape[0] * width))  # columns per group
    for g0 in range(0, v, step):
        g1 = min(g0 + step, v)
        if logits is None:
            z = _products(hidden, weight, g0, g1, width)
        else:
            z = logits[:, g0:g1].to(hidden.dtype)
        if bias is not None:
            z = z + bias[g0:g1]
        z = _scale(z.float(), temperature)
        cols = torch.arange(vocab_start + g0, vocab_start + g1, device=z.device)
        z = z.masked_fill(cols >= real_vocab_size, _NEG_INF)
        in_group = (local >= g0) & (local < g1)
        picked = z.gather(1, (local - g0).clamp(0, g1 - g0 - 1).unsqueeze(1)).squeeze(1)
        target_z = torch.where(in_group, picked, target_z)
        n = -(-(g1 - g0) // width)
        states.append(_state(F.pad(z, (0, n * width - (g1 - g0)), value=_NEG_INF).unflatten(-1, (n, width)),
                             with_entropy))
    m, s, w = (torch.cat(parts, -1) if parts[0] is not None else None for parts in zip(*states))
    return ChunkStates(m, s, w, target_z)


chunk_states = KernelOp("linear_logp_chunk_states", torch_chunk_states, "logp:chunk_states")
_head_logits = KernelOp("lm_head_logits", torch_head_logits, "logp:head_logits")


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, *, full_vocab_size: int | None = None) -> torch.Tensor:
    """[..., V_local] fp32 logits hidden [..., H] @ weight^T, computed exactly as linear_logp
    computes its logits (before bias, temperature and padding): an engine samples from them, then
    passes them back (as [T, V_local]) to linear_logp(..., logits=) to get the sampled tokens'
    logprobs without a second pass over the LM head, bit for bit what linear_logp(hidden, weight,
    ...) gives."""
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"lm_head_logits: hidden [..., H] and weight [V, H] expected, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    z = _head_logits(hidden.reshape(-1, hidden.shape[-1]), weight, width=chunk_width(full_vocab_size or weight.shape[0]))
    return z.reshape(*hidden.shape[:-1], weight.shape[0])


def merge_tree(m: torch.Tensor, s: torch.Tensor, w: torch.Tensor | None):
    """Merge [T, n] chunk states pairwise over a balanced tree padded with the identity."""
    n = m.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        m = F.pad(m, (0, width - n), value=_NEG_INF)
        s = F.pad(s, (0, width - n))
        w = F.pad(w, (0, width - n)) if w is not None else None
    while width > 1:
        width //= 2
        m1, m2 = m[..., :width], m[..., width:]
        mm = torch.maximum(m1, m2)
        ref = _safe(mm)
        a1 = torch.exp(m1 - ref)
        a2 = torch.exp(m2 - ref)
        s = s[..., :width] * a1 + s[..., width:] * a2
        if w is not None:
            w = w[..., :width] * a1 + w[..., width:] * a2
        m = mm
    return m[..., 0], s[..., 0], (w[..., 0] if w is not None else None)


def _finish(target_z, m, s, w) -> LinearLogpOutput:
    lse = m + torch.log(s)
    entropy = lse - w / s if w is not None else None
    return LinearLogpOutput(target_z - lse, lse, entropy)


def torch_merge_states(target_z: torch.Tensor, m: torch.Tensor, s: torch.Tensor,
                       w: torch.Tensor | None) -> LinearLogpOutput:
    """The reference of the step after the chunk states: [T, n] states (every chunk of the vocab,
    in global chunk order) merged over merge_tree's balanced tree, then logp, lse and entropy."""
    return _finish(target_z, *merge_tree(m, s, w))


merge_states = KernelOp("linear_logp_merge", torch_merge_states, "logp:merge_states")


class _GatherReplicated(torch.autograd.Function):
    """All ranks' tensors in rank order. Every rank then computes the same (replicated) result, so
    the backward keeps this rank's slice of the gradient instead of summing the copies (Megatron's
    gather-from-tensor-parallel-region semantics)."""

    @staticmethod
    def forward(ctx, t, group):
        import torch.distributed as dist

        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank], None


def _gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    return list(_GatherReplicated.apply(t, group).unbind(0))


def _validate(hidden, weight, targets, real_vocab_size, full_vocab, vocab_start, support_ids):
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_logp: hidden [T,H] and weight [V,H] expected, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"linear_logp: targets {tuple(targets.shape)} != [T]={hidden.shape[0]}")
    if not 0 < real_vocab_size <= full_vocab:
        raise ValueError(f"linear_logp: real_vocab_size {real_vocab_size} outside (0, {full_vocab}]")
    width = chunk_width(full_vocab)
    if vocab_start % width or (weight.shape[0] % width and vocab_start + weight.shape[0] != full_vocab):
        raise ValueError(f"linear_logp: the shard [{vocab_start}, {vocab_start + weight.shape[0]}) of a "
                         f"{full_vocab}-column vocab does not hold whole {width}-column chunks; shard the vocab "
                         f"into a number of parts dividing {NUM_VOCAB_CHUNKS}")
    if support_ids is not None and (support_ids.dim() != 2 or support_ids.shape[0] != hidden.shape[0]):
        raise ValueError(f"linear_logp: support_ids must be [T, k], got {tuple(support_ids.shape)}")
    if value_checks_enabled() and targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= real_vocab_size):
        raise ValueError(f"linear_logp: target ids must lie in [0, {real_vocab_size})")


def linear_logp(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                bias: torch.Tensor | None = None, temperature=None, real_vocab_size: int | None = None,
                with_entropy: bool = False, support_ids: torch.Tensor | None = None,
                vocab_start: int = 0, full_vocab_size: int | None = None, group=None,
                logits: torch.Tensor | None = None) -> LinearLogpOutput:
    """log softmax(hidden @ weight^T + bias)[targets].

    hidden [T, H]; weight [V_local, H] holding global vocab rows [vocab_start, vocab_start + V_local)
    of a vocab of full_vocab_size (default: unsharded); targets [T] global ids; temperature float |
    [T] | None; group: the process group the vocab is sharded over (rank order = shard order);
    logits: lm_head_logits(hidden, weight) when the caller has them (the same bits, one pass over
    the LM head fewer; gradients still flow to hidden and weight). Unused with support_ids.
    """
    full_vocab = full_vocab_size or weight.shape[0]
    real = real_vocab_size or full_vocab
    _validate(hidden, weight, targets, real, full_vocab, vocab_start, support_ids)
    if logits is not None and (logits.shape != (hidden.shape[0], weight.shape[0]) or logits.dtype != torch.float32):
        raise ValueError(f"linear_logp: logits must be lm_head_logits' [{hidden.shape[0]}, {weight.shape[0]}] fp32, "
                         f"got {tuple(logits.shape)} {logits.dtype}")
    return _linear_logp(hidden, weight, targets, bias, temperature, real, full_vocab, with_entropy, support_ids,
                        vocab_start, group, logits)


def _forward(hidden, weight, targets, bias, temperature, real, full_vocab, with_entropy, support_ids, vocab_start,
             group, logits=None) -> LinearLogpOutput:
    if support_ids is not None:
        return _support_logp(hidden, weight, targets, bias, temperature, with_entropy, support_ids,
                             vocab_start, group)
    st = chunk_states(hidden, weight, targets, vocab_start=vocab_start, width=chunk_width(full_vocab),
                      real_vocab_size=real, bias=bias, temperature=temperature, with_entropy=with_entropy,
                      logits=logits)
    m, s, w, target_z = st.m, st.s, st.w, st.target_z
    if group is not None:
        m, s = torch.cat(_gather(m, group), -1), torch.cat(_gather(s, group), -1)
        w = torch.cat(_gather(w, group), -1) if w is not None else None
        # exactly one rank holds each target; the others' target_z is an exact 0, which changes no bit
        target_z = torch.stack(_gather(target_z, group)).sum(0)
    return merge_states(target_z, m, s, w)


def canonical_support(support_ids: torch.Tensor) -> torch.Tensor:
    """A support is a set: sort each row's ids ascending (unused -1 slots last), so the reduction
    order never depends on the order in which an engine happened to list them."""
    big = torch.iinfo(support_ids.dtype).max
    ordered = torch.where(support_ids >= 0, support_ids, big).sort(-1).values
    return torch.where(ordered == big, -1, ordered)


def torch_support_logits(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """z [T, k] in hidden's dtype: row t of hidden against weight rows ids[t] (local rows, in range),
    each logit its own dot product: the products rounded to hidden's dtype, then tree-summed in it
    (_invariant.tree_sum), so neither k nor the other rows change a bit. Materialises [T, k, H]."""
    return tree_sum(hidden.unsqueeze(1) * weight[ids], -1)


# The Triton backend computes the same bits a row and slot at a time, never the [T, k, H] products
# (and recomputes this reference's graph for the gradient).
support_logits = KernelOp("linear_logp_support_logits", torch_support_logits, "logp:support_logits")


def _support_logp(hidden, weight, targets, bias, temperature, with_entropy, support_ids, vocab_start, group):
    support_ids = canonical_support(support_ids)
    valid = support_ids >= 0
    hit = (support_ids == targets.unsqueeze(1)) & valid
    if value_checks_enabled() and not bool(hit.any(1).all()):
        row = int((~hit.any(1)).nonzero()[0])
        raise ValueError(f"linear_logp: target {int(targets[row])} of row {row} is not in its support ids")
    local = support_ids - vocab_start
    owned = valid & (local >= 0) & (local < weight.shape[0])
    ids = torch.where(owned, local, 0)
    z = support_logits(hidden, weight, ids)
    if bias is not None:
        z = z + bias[ids]
    z = torch.where(owned, z, 0.0)
    if group is not None:  # one owner per id: the others add exact zeros
        z = torch.stack(_gather(z, group)).sum(0)
    z = _scale(z.float(), temperature).masked_fill(~valid, _NEG_INF)
    target_z = (z.masked_fill(~hit, 0.0)).sum(-1)  # exactly one hit per row: one value plus zeros
    m, s, w = _state(z, with_entropy)
    return _finish(target_z, m, s, w)


# Counts every linear_logp call (either route); the chunk route's kernels are `chunk_states`.
_linear_logp = KernelOp("linear_logp", _forward)
