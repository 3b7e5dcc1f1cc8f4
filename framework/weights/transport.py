"""How a bucket's flat buffer reaches an engine.

  cuda_ipc      the trainer's GPU buffer itself: the engine opens a CUDA IPC handle of it (actor and
                engine share the GPU; colocated runs). No copy on the way.
  object_store  the bytes, through Ray's object store (CPU runs; engines on other nodes): a host
                copy. Into a vLLM worker process the bytes travel as one `bytes` message.
A payload is a plain dict of str/int/bytes/bool (what vLLM's collective_rpc serialises), built by
`export` on the sender and opened by `open_payload` on the receiver.
"""
from __future__ import annotations

import torch

TRANSPORTS = ("auto", "cuda_ipc", "object_store")


def choose(transport: str, device: str, colocate: bool) -> str:
    if transport not in TRANSPORTS:
        raise ValueError(f"weights.transport={transport!r}; valid: {', '.join(TRANSPORTS)}")
    if transport == "auto":
        return "cuda_ipc" if device == "cuda" and colocate else "object_store"
    if transport == "cuda_ipc" and not (device == "cuda" and colocate):
        raise ValueError("weights.transport=cuda_ipc needs the actor and the engines on one GPU "
                         "(parallel.device=cuda, parallel.colocate=true)")
    return transport


def export(flat: torch.Tensor, transport: str) -> dict:
    """A payload for the flat uint8 buffer `flat` (which the sender keeps alive until the receivers
    have answered)."""
    if transport == "object_store":
        return {"kind": "bytes", "data": flat.cpu().numpy().tobytes()}
    if transport != "cuda_ipc" or flat.device.type != "cuda":
        raise ValueError(f"cannot export a buffer on {flat.device} over {transport}")
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(flat)
    # (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size, storage_offset,
    #  requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)
    (_, size, stride, offset, storage_cls, _, device, handle, storage_size, storage_offset, _, ref_handle, ref_offset,
     event_handle, event_sync) = args
    return {"kind": "cuda_ipc", "storage_cls": storage_cls.__name__, "size": list(size), "stride": list(stride), "offset": int(offset),
            "device": int(device), "handle": bytes(handle), "storage_size": int(storage_size),
            "storage_offset": int(storage_offset), "ref_handle": bytes(ref_handle), "ref_offset": int(ref_offset),
            "event_handle": bytes(event_handle) if event_handle else b"", "event_sync": bool(event_sync)}


def open_payload(payload: dict, device: torch.device | None = None) -> torch.Tensor:
    """The flat uint8 buffer a payload carries (a view of the sender's memory for cuda_ipc)."""
    if payload["kind"] == "bytes":
        flat = torch.frombuffer(bytearray(payload["data"]), dtype=torch.uint8)
        return flat if device is None else flat.to(device)
    if payload["kind"] == "cuda_ipc":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        p = payload
        storage_cls = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}[p["storage_cls"]]
        return rebuild_cuda_tensor(torch.Tensor, torch.Size(p["size"]), tuple(p["stride"]), p["offset"],
                                   storage_cls, torch.uint8, p["device"], p["handle"], p["storage_size"],
                                   p["storage_offset"], False, p["ref_handle"], p["ref_offset"],
                                   p["event_handle"] or None, p["event_sync"])
    raise ValueError(f"unknown weight payload kind {payload.get('kind')!r}")
