"""The CUDA IPC path of the cache service: designed, guarded, not exercised here.

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
branch is taken only when it returns True. In protocol version 1 the server
answers ``cuda_register`` with ``cuda_unavailable`` (no CUDA) or
``unsupported``; clients fall back to the shared-memory copies, which work
everywhere.
"""

from __future__ import annotations

import functools


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


def export_handle(tensor: object) -> dict[str, object]:
    """Fields of a ``cuda_register`` request for a CUDA tensor's storage.

    Raises:
        RuntimeError: CUDA is not available (the only outcome on this machine).
    """
    if not cuda_available():
        raise RuntimeError("CUDA IPC needs a CUDA device; use the shared-memory path")
    storage = tensor.untyped_storage()  # type: ignore[attr-defined]
    device, handle, size, _offset, *_ = storage._share_cuda_()
    return {"handle": bytes(handle), "size": int(size), "dtype": str(tensor.dtype), "device": int(device)}  # type: ignore[attr-defined]
