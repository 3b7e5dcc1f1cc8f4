"""Linear-logp provider ABI (types), mode rules and route record."""
from lockstep.framework.provider.route import (MODES, ProviderError, RouteRecord, compute_linear_logp,
                                               load_provider)
from lockstep.framework.provider.types import (LinearLogpContext, LinearLogpProviderUnavailable,
                                               LinearLogpRequest, LinearLogpResult, LinearProjection,
                                               TokenLayout, VocabPartition, is_unavailable_signal)

__all__ = ["MODES", "ProviderError", "RouteRecord", "compute_linear_logp", "load_provider", "TokenLayout",
           "VocabPartition", "LinearProjection", "LinearLogpContext", "LinearLogpRequest", "LinearLogpResult",
           "LinearLogpProviderUnavailable", "is_unavailable_signal"]
