"""Engine side of ``kv_register``: describe per-layer KV tensors as shared buffers plus strided views.

:func:`kv_register_request` turns an engine's per-layer ``[B, H, N, C]`` KV tensors
(any dtype; C, the innermost axis, contiguous) into a
:class:`~kvtier.protocol.messages.KVRegister`: each distinct storage is exported once
(CUDA IPC, :func:`kvtier.service.cuda_ipc.export_handle`), and each layer becomes
``(buffer index, byte offset, stride_B, stride_H, stride_N)`` in bytes within it.
The exporting process must keep the tensors alive while the server uses them.

``shm_name`` selects the CPU stand-in (tests only): the tensors must all be views of
one ``torch.frombuffer`` over an ``mmap`` of ``/dev/shm/<shm_name>`` at offset 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from kvtier.protocol.messages import KVRegister, ShmBuffer

if TYPE_CHECKING:  # pragma: no cover
    import torch


def kv_register_request(layers: Sequence["torch.Tensor"], shm_name: str | None = None) -> KVRegister:
    """The ``kv_register`` request sharing ``layers`` (layer order) with the server.

    Raises:
        ValueError: no layers; a tensor that is not 4D, has a non-contiguous last axis,
            or differs in shape/dtype/device from the first; with ``shm_name``, tensors
            over more than one storage.
        RuntimeError: without ``shm_name``, tensors not on a CUDA device (see ``export_handle``).
    """
    import torch

    if not layers:
        raise ValueError("no KV layers to register")
    first = layers[0]
    views: list[Any] = []
    for t in layers:
        if t.dim() != 4 or t.stride(3) != 1:
            raise ValueError(f"a KV layer must be 4D [B, H, N, C] with C contiguous, got shape {tuple(t.shape)}")
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError("KV layers differ in shape, dtype or device")
        views.append(t if t.dtype == torch.uint8 else t.view(torch.uint8))
    ptrs: list[int] = []
    buffers: list[Any] = []
    entries: list[tuple[int, int, int, int, int]] = []
    for v in views:
        storage = v.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in ptrs:
            ptrs.append(ptr)
            if shm_name is not None:
                buffers.append(ShmBuffer(shm_name, storage.nbytes()))
            else:
                from kvtier.service.cuda_ipc import export_handle

                buffers.append(export_handle(v))  # the whole storage under v (its byte offset is v's)
        entries.append((ptrs.index(ptr), v.storage_offset(), v.stride(0), v.stride(1), v.stride(2)))
    if shm_name is not None and len(buffers) != 1:
        raise ValueError("the shm stand-in needs every layer in one storage (one file)")
    b, h, n, c = views[0].shape
    return KVRegister("shm" if shm_name is not None else "cuda", buffers, (b, h, n, c), entries)
