"""Triton implementations of the lockstep ops (same semantics as the torch reference, each
batch-invariant on its own terms). Imported only when the Triton backend is selected."""
import triton  # noqa: F401  (the backend is unavailable without it)
