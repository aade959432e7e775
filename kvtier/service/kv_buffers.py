"""Opening an engine's KV allocations in the cache service, and viewing them as per-layer blocks.

The only step where a CUDA registration and its CPU stand-in differ:

- ``kind="cuda"``: each buffer is a CUDA IPC export (:func:`kvtier.service.cuda_ipc.import_handle`),
  giving a ``uint8 [size]`` tensor on the engine's GPU, mapped (no copy) into the server.
- ``kind="shm"`` (tests only, so CI runs the same server code path on CPU): each buffer is
  a file ``/dev/shm/kvtier-kvtest-*`` (a POSIX shared-memory name) that the test's "engine"
  created and maps too. Accepted only over the Unix socket, only for a regular file owned by
  the server's user, never through a symlink. Real vLLM CPU engines keep the slot copies.
  Unlike the service's own segments (sealed memfds, :mod:`kvtier.memory.shared_segment`),
  this path-based file cannot be sealed (a named tmpfs file carries no seals): the engine
  that made it could still truncate it under the server's mapping (a SIGBUS). What protects
  it is only that it is a test stand-in, opened for a client of the server's own user on the
  owner-only socket; making it a sealed memfd passed over ``SCM_RIGHTS`` would change the
  ``kv_register`` wire format, so it stays a named file.

After opening, both kinds go through :func:`layer_views` (bounds-checked ``as_strided``).
"""

from __future__ import annotations

import mmap
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvtier.protocol.messages import CudaRegister, ShmBuffer

SHM_DIR = "/dev/shm"
#: Names the ``shm`` stand-in may open (under :data:`SHM_DIR`).
SHM_NAME = re.compile(r"kvtier-kvtest-[A-Za-z0-9_.-]{1,64}")


class KVBufferError(ValueError):
    """A buffer cannot be opened or a layer view does not fit it (the message says which)."""


@dataclass
class OpenedBuffers:
    """The opened allocations: ``tensors[i]`` is buffer ``i`` as ``uint8 [size_i]``, all on one device."""

    tensors: list[Any]
    _maps: list[mmap.mmap] = field(default_factory=list)

    @property
    def device(self) -> Any:
        return self.tensors[0].device

    def close(self) -> None:
        """Drop the tensors (CUDA: torch unmaps the IPC memory with the last reference) and the mmaps."""
        self.tensors = []
        maps, self._maps = self._maps, []
        for mm in maps:
            try:
                mm.close()
            except BufferError:
                pass  # a view is still alive somewhere: the mapping goes with it


def open_buffers(kind: str, buffers: Sequence[CudaRegister | ShmBuffer]) -> OpenedBuffers:
    """Open every buffer of a ``kv_register`` request.

    Raises:
        KVBufferError: a handle or file that cannot be opened, sizes that disagree,
            CUDA buffers on several devices, or a bad stand-in name (``kind="cuda"``
            on a server without CUDA too: check :func:`~kvtier.service.cuda_ipc.cuda_available` first).
    """
    opened = OpenedBuffers([])
    try:
        for b in buffers:
            if kind == "cuda":
                assert isinstance(b, CudaRegister)
                opened.tensors.append(_open_cuda(b))
            else:
                assert isinstance(b, ShmBuffer)
                t, mm = _open_shm(b)
                opened.tensors.append(t)
                opened._maps.append(mm)
        if len({str(t.device) for t in opened.tensors}) != 1:
            raise KVBufferError("the buffers are on several devices; register one device per connection")
    except BaseException:
        opened.close()
        raise
    return opened


def _open_cuda(b: CudaRegister) -> Any:
    from kvtier.service.cuda_ipc import import_handle

    try:
        t = import_handle(b)
    except Exception as exc:
        raise KVBufferError(f"cannot open the CUDA IPC handle: {exc}") from None
    n = t.untyped_storage().nbytes()
    if n != b.size:
        raise KVBufferError(f"CUDA IPC handle maps {n} B, request says {b.size}")
    return t


def _open_shm(b: ShmBuffer) -> tuple[Any, mmap.mmap]:
    import torch

    if not SHM_NAME.fullmatch(b.name):
        raise KVBufferError(f"shm buffer name must match {SHM_NAME.pattern} (a test stand-in)")
    path = os.path.join(SHM_DIR, b.name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise KVBufferError(f"cannot open {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise KVBufferError(f"{path} is not a regular file of this server's user")
        if st.st_size < b.size:
            raise KVBufferError(f"{path} has {st.st_size} B, request says {b.size}")
        mm = mmap.mmap(fd, b.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8, count=b.size), mm


def layer_views(tensors: Sequence[Any], shape: Sequence[int], layers: Sequence[Sequence[int]]) -> list[Any]:
    """Per-layer ``uint8 [B, H, N, C]`` views (no copy) of the opened buffers.

    Args:
        tensors: the opened buffers, ``uint8 [size]`` each.
        shape: ``[B, H, N, C]`` (C in bytes).
        layers: per layer ``(buffer index, byte offset, stride_B, stride_H, stride_N)``.

    Raises:
        KVBufferError: a view that reaches past its buffer, or a zero block stride
            with more than one block (distinct block ids must be distinct memory).
    """
    import torch

    b, h, n, c = shape
    out = []
    for i, (buf, off, sb, sh, sn) in enumerate(layers):
        size = tensors[buf].numel()
        end = off + (b - 1) * sb + (h - 1) * sh + (n - 1) * sn + c
        if end > size:
            raise KVBufferError(f"layer {i}: the view ends at byte {end}, past its buffer's {size} B")
        if b > 1 and sb == 0:
            raise KVBufferError(f"layer {i}: block stride 0 (every block id would be the same memory)")
        out.append(torch.as_strided(tensors[buf], (b, h, n, c), (sb, sh, sn, 1), off))
    return out
