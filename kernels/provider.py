"""lockstep.kernels as a linear-logp provider (the "R" route of the logp module).

Reads a request by attribute only and returns a plain result object, so it depends on nothing in
lockstep.framework: any provider package can be written the same way.
"""
from __future__ import annotations

from types import SimpleNamespace

from lockstep.kernels._backend import get_backend
from lockstep.kernels.logp import NUM_VOCAB_CHUNKS, linear_logp

CONTRACT_ID = f"lockstep.linear_logp.v2:chunks={NUM_VOCAB_CHUNKS}:tree-merge:fp32-temperature"


def linear_logp_provider(request):
    ctx = request.context
    out = linear_logp(ctx.hidden, ctx.projection.weight, request.target_ids, bias=ctx.projection.bias,
                      temperature=request.temperature, real_vocab_size=ctx.vocab.real_size,
                      with_entropy=request.with_entropy, support_ids=request.support_ids,
                      vocab_start=ctx.vocab.local_start, full_vocab_size=ctx.vocab.padded_size,
                      group=getattr(request, "tp_group", None), logits=getattr(ctx, "logits", None))
    return SimpleNamespace(logp=out.logp, entropy=out.entropy, backend_id=f"lockstep.kernels/{get_backend()}",
                           contract_id=CONTRACT_ID, provenance={"vocab_chunks": NUM_VOCAB_CHUNKS})
