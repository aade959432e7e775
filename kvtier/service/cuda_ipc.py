"""The CUDA IPC path of the cache service: handle export/import implemented, copies by block id not yet.

Implemented (never run on a GPU so far; tests marked ``cuda``): :func:`export_handle`
(engine side), :func:`import_handle` (server side), :func:`register_host_memory`,
and the full ``cuda_register`` message. Not implemented: steps 2-3's copies by
engine block id; the server opens and checks the handle, then answers
``unsupported`` so clients keep using the shared-memory path.

On machines with CUDA, copying KV from GPU memory into a client's mapping of
the shared segment and then having the server read it costs two trips over
PCIe-side host memory per chunk. The design for such machines:

1. At start, each engine exports its paged KV cache allocation with CUDA IPC
   (``cudaIpcGetMemHandle`` via ``torch.UntypedStorage._share_cuda_``) and sends
   the handle in a ``cuda_register`` request (:class:`kvtier.protocol.CudaRegister`:
   handle bytes, size in bytes, dtype name, device index).
2. The server opens the handle once (``cudaIpcOpenMemHandle``), giving it a
   device pointer to the engine's KV cache, and registers its shared segment as
   pinned host memory (``cudaHostRegister``) so DMA can reach it.
3. Stores and loads then name engine block ids instead of slot copies: the
   server issues ``cudaMemcpyAsync`` between the engine's blocks and the pinned
   slot on its own stream and replies when the copy's event completes, so the
   engine never touches the host copy itself.

Only :func:`cuda_available` is called on the request path; every CUDA-specific
branch is taken only when it returns True. The server answers ``cuda_register``
with ``cuda_unavailable`` (no CUDA), ``bad_message`` (a handle it cannot open),
or ``unsupported`` (opened and checked, copies not implemented); clients fall
back to the shared-memory copies, which work everywhere.
"""

from __future__ import annotations

import functools
from typing import Any

from kvtier.protocol.messages import CudaRegister


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    """True only if torch is importable and reports a usable CUDA device (cached)."""
    try:
        import torch
    except Exception:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def export_handle(tensor: Any) -> CudaRegister:
    """A ``cuda_register`` request sharing a CUDA tensor's whole storage (CUDA IPC).

    Uses torch's ``UntypedStorage._share_cuda_()`` (what ``torch.multiprocessing``
    sends for a CUDA tensor): the allocation's ``cudaIpcMemHandle_t``, the storage's
    byte offset and size, torch's shared reference counter and the producer's IPC event.

    Raises:
        RuntimeError: CUDA is not available, or ``tensor`` is not on a CUDA device.
    """
    if not cuda_available():
        raise RuntimeError("CUDA IPC needs a CUDA device; use the shared-memory path")
    if tensor.device.type != "cuda":
        raise RuntimeError(f"CUDA IPC shares CUDA tensors, got one on {tensor.device}")
    storage = tensor.untyped_storage()
    device, handle, size, offset, ref_handle, ref_offset, event_handle, sync = storage._share_cuda_()
    return CudaRegister(
        bytes(handle), int(size), str(tensor.dtype).removeprefix("torch."), int(device), offset=int(offset),
        ref_counter_handle=bytes(ref_handle), ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle or b""), event_sync_required=bool(sync),
    )


def ipc_args(r: CudaRegister) -> tuple[Any, ...]:
    """The arguments of torch's ``UntypedStorage._new_shared_cuda`` for a ``cuda_register`` request.

    Raises:
        ValueError: the request lacks the reference counter (a protocol-v1 client's
            handle-only request cannot be opened through torch).
    """
    if not r.ref_counter_handle:
        raise ValueError("cuda_register without ref_counter_handle: re-export with kvtier.service.cuda_ipc.export_handle")
    return (r.device, r.handle, r.size, r.offset, r.ref_counter_handle, r.ref_counter_offset,
            r.event_handle or None, r.event_sync_required)


def import_handle(r: CudaRegister) -> Any:
    """Open a peer's shared CUDA storage: ``uint8 [r.size]`` tensor on ``cuda:r.device`` (no copy).

    Must run in another process than the exporter (CUDA refuses to open a handle in
    the process that made it). The mapping lives as long as the returned tensor.

    Raises:
        RuntimeError: no CUDA, or the driver refuses the handle.
        ValueError: see :func:`ipc_args`.
    """
    if not cuda_available():
        raise RuntimeError("CUDA IPC needs a CUDA device; use the shared-memory path")
    import torch

    args = ipc_args(r)
    with torch.cuda.device(r.device):
        storage = torch.UntypedStorage._new_shared_cuda(*args)
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{r.device}").set_(storage)


def register_host_memory(address: int, nbytes: int) -> None:
    """Page-lock an existing host range (the shared segment) for DMA: ``cudaHostRegister``.

    Raises:
        RuntimeError: no CUDA, or CUDA returned an error.
    """
    if not cuda_available():
        raise RuntimeError("cudaHostRegister needs a CUDA device")
    import torch

    err = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} B at {address:#x} failed: error {int(err)}")
