"""Page-locking the cache service's shared segments for GPU DMA while CUDA engines use them.

When a connection's ``kv_register`` (kind ``cuda``) is accepted, the namespace's
shared segment is registered as pinned host memory (``cudaHostRegister``, flag
``cudaHostRegisterPortable``), so the server's ``non_blocking`` copies between the
engine's GPU blocks and the slots are DMA instead of staged through a driver
buffer. The pin is reference counted per namespace and undone
(``cudaHostUnregister``) when the last such registration ends (before the
namespace can be released as idle) and at server shutdown. Without CUDA nothing
is pinned (:class:`SegmentPins` with ``cudart=None`` is a no-op).

Two consequences of pinning a segment, which stay in force while it is pinned:

- every page of the segment becomes resident (a sparse segment spans the whole
  ``cpu_capacity``), so each pinned namespace holds that much host memory;
- the pool must not give free slots' pages back (``MADV_REMOVE`` would leave the
  GPU's DMA mapping on the old pages): the segment's ``keep_pages`` flag is set
  until it is unpinned (:meth:`kvtier.memory.shared_segment.SharedSegment.release`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)

#: ``cudaHostRegisterPortable``: pinned for every CUDA context of the process.
HOST_REGISTER_PORTABLE = 1


@dataclass
class _Pin:
    segment: Any
    address: int
    users: int


def default_cudart() -> Any | None:
    """``torch.cuda.cudart()`` when CUDA is usable, else None (pinning is then a no-op)."""
    from kvtier.service.cuda_ipc import cuda_available

    if not cuda_available():
        return None
    import torch

    return torch.cuda.cudart()


class SegmentPins:
    """Reference-counted ``cudaHostRegister`` of namespace segments (thread-safe).

    Args:
        cudart: called at the first :meth:`acquire` (so a server that never sees a CUDA
            registration never imports torch for this); returns an object with
            ``cudaHostRegister(ptr, nbytes, flags)`` and ``cudaHostUnregister(ptr)``
            returning a CUDA error code (0 = success), i.e. ``torch.cuda.cudart()``,
            or None: never pin.
    """

    def __init__(self, cudart: Callable[[], Any | None] = default_cudart):
        self._factory: Callable[[], Any | None] | None = cudart
        self.cudart: Any | None = None
        self._pins: dict[bytes, _Pin] = {}
        self._lock = threading.Lock()

    def acquire(self, digest: bytes, segment: Any) -> bool:
        """Pin ``segment`` (a :class:`~kvtier.memory.shared_segment.SharedSegment`) for namespace ``digest``.

        Returns True if it is pinned now (first user: registered; later users: counted).
        A failing ``cudaHostRegister`` is logged and returns False (copies still work,
        staged by the driver).
        """
        with self._lock:
            if self._factory is not None:
                factory, self._factory = self._factory, None
                self.cudart = factory()
            if self.cudart is None:
                return False
            pin = self._pins.get(digest)
            if pin is not None:
                pin.users += 1
                return True
            address, nbytes = int(segment.array.ctypes.data), int(segment.size)
            err = int(self.cudart.cudaHostRegister(address, nbytes, HOST_REGISTER_PORTABLE))
            if err != 0:
                log.warning("kvtier server: cudaHostRegister of %d B failed (error %d); slots stay pageable", nbytes, err)
                return False
            segment.keep_pages = True  # see the module docstring
            self._pins[digest] = _Pin(segment, address, 1)
            return True

    def release(self, digest: bytes) -> None:
        """One user of ``digest``'s pin is gone; unpin after the last."""
        with self._lock:
            pin = self._pins.get(digest)
            if pin is None:
                return
            pin.users -= 1
            if pin.users <= 0:
                del self._pins[digest]
                self._unpin(pin)

    def pinned(self) -> list[bytes]:
        """Digests of the namespaces whose segment is pinned now."""
        with self._lock:
            return list(self._pins)

    def close(self) -> None:
        """Unpin every segment (server shutdown, before the segments are unmapped)."""
        with self._lock:
            pins, self._pins = list(self._pins.values()), {}
        for pin in pins:
            self._unpin(pin)

    def _unpin(self, pin: _Pin) -> None:
        cudart = self.cudart
        assert cudart is not None, "a segment is pinned only once cudart is loaded"
        try:
            err = int(cudart.cudaHostUnregister(pin.address))
            if err != 0:
                log.warning("kvtier server: cudaHostUnregister failed (error %d)", err)
        finally:
            pin.segment.keep_pages = False
