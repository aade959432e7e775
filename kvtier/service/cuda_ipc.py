"""The CUDA IPC path of the cache service: handle export/import, used by ``kv_register`` (kind ``cuda``).

Implemented:

- :func:`export_handle` (engine side) and :func:`import_handle` (server side): one
  CUDA allocation shared with torch's ``UntypedStorage._share_cuda_`` /
  ``_new_shared_cuda`` (``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle``).
- Copies addressed by engine block id (:mod:`kvtier.service.kv_ops`): an engine sends
  ``kv_register`` (:func:`kvtier.service.kv_export.kv_register_request`: one export per
  allocation plus each layer's strided ``[B, H, N, C]`` view); the server opens the
  handles once per connection (:mod:`kvtier.service.kv_buffers`), then ``store_blocks`` /
  ``load_blocks`` gather/scatter between the engine's blocks and its slots with
  ``index_select`` / ``index_copy_`` on a dedicated CUDA stream and reply when the copy's
  event has completed (:class:`kvtier.service.block_copy.CopyRunner`). The engine never
  touches the host copy. Releasing (``kv_release``) or disconnecting unmaps everything.
- The namespace's shared segment is page-locked (``cudaHostRegister``) while a CUDA
  registration uses it, unregistered after the last one and at shutdown
  (:mod:`kvtier.service.pinning`).
- The bare ``cuda_register`` op (one handle, no geometry) is still parsed and its handle
  checked, then answered ``unsupported``: it cannot name blocks.

Never run on a GPU so far: everything CUDA-specific above (the IPC open in the server
process, the copy stream and event, ``cudaHostRegister`` of the segment). CI runs the
same server code on CPU: ``kv_register`` kind ``shm`` (tests only) shares a CPU file in
``/dev/shm`` instead of an IPC handle, so only the "open the buffer" step differs; pinning
is tested with a fake ``cudart``. The CUDA variants are the ``cuda``-marked tests in
``tests/test_cuda_ipc.py`` and ``tests/test_service_block_copy.py`` (``scripts/gpu-check.sh``).

Only :func:`cuda_available` is called on the request path; every CUDA-specific
branch is taken only when it returns True. Without CUDA the server answers a ``cuda``
registration with ``cuda_unavailable``; a handle it cannot open gets ``bad_message``;
clients then keep the shared-memory slot copies, which work everywhere.
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
