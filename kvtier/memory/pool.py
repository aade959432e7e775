"""A pre-allocated, pre-touched CPU memory pool cut into fixed-size chunk slots.

Every page is written once at construction, so copies into a slot run at memory
bandwidth (~10 GB/s on the 2-vCPU reference VM) instead of page-fault speed
(~2 GB/s into fresh allocations; see shared notes/baselines.md). After
construction the pool allocates nothing: ``alloc``/``free`` move slot indices on
a free list.
"""

from __future__ import annotations

import threading

import numpy as np


#: Alignment of the private buffer (bytes): a page, as O_DIRECT requires.
PAGE_BYTES = 4096


class PoolExhausted(Exception):
    """No free slot; the caller evicts and retries, or treats the store as skipped."""


class ChunkPool:
    """``num_slots`` slots of ``slot_bytes`` bytes each, in one contiguous buffer.

    Args:
        slot_bytes: bytes per slot (one chunk's payload), > 0.
        num_slots: number of slots, > 0.
        buffer: optional externally owned memory (e.g. a shared-memory segment
            the cache service maps into every engine); any writable object
            exposing the buffer protocol with at least ``slot_bytes * num_slots``
            bytes. The caller pre-touches it and keeps it alive. Default: a
            private pre-touched allocation.

    Raises:
        ValueError: non-positive sizes, or ``buffer`` too small or read-only.
        MemoryError: the buffer cannot be allocated.
    """

    def __init__(self, slot_bytes: int, num_slots: int, buffer: object | None = None):
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError(f"slot_bytes and num_slots must be positive, got {slot_bytes}, {num_slots}")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        if buffer is None:
            # Page-aligned (O_DIRECT reads/writes go straight into slots whose size is a
            # multiple of 4096) and pre-touched: fill() writes every page, whereas
            # np.empty/zeros would map them lazily.
            raw = np.empty(slot_bytes * num_slots + PAGE_BYTES, dtype=np.uint8)
            offset = (-raw.ctypes.data) % PAGE_BYTES
            self._buf = raw[offset : offset + slot_bytes * num_slots].reshape(num_slots, slot_bytes)
            self._buf.fill(1)
        else:
            flat = np.frombuffer(buffer, dtype=np.uint8)
            if flat.size < slot_bytes * num_slots:
                raise ValueError(f"buffer of {flat.size} B is smaller than {num_slots} x {slot_bytes} B")
            if not flat.flags.writeable:
                raise ValueError("buffer is read-only")
            self._buf = flat[: slot_bytes * num_slots].reshape(num_slots, slot_bytes)
        self._free = list(range(num_slots - 1, -1, -1))
        self._in_use = bytearray(num_slots)
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.slot_bytes * self.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        """Take a free slot index.

        Raises:
            PoolExhausted: every slot is in use.
        """
        with self._lock:
            if not self._free:
                raise PoolExhausted()
            slot = self._free.pop()
            self._in_use[slot] = 1
            return slot

    def free(self, slot: int) -> None:
        """Return ``slot`` to the free list. Freeing a free slot is a bug and raises ValueError."""
        with self._lock:
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"slot {slot} out of range")
            if not self._in_use[slot]:
                raise ValueError(f"slot {slot} freed twice")
            self._in_use[slot] = 0
            self._free.append(slot)

    def view(self, slot: int) -> np.ndarray:
        """The slot's bytes: a writable ``uint8`` array of shape ``[slot_bytes]`` (no copy)."""
        return self._buf[slot]

    def slot_of(self, view: np.ndarray) -> int:
        """The slot index of a view returned by :meth:`view`.

        Raises:
            ValueError: ``view`` does not start a slot of this pool.
        """
        base = self._buf.__array_interface__["data"][0]
        offset = view.__array_interface__["data"][0] - base
        slot, rest = divmod(offset, self.slot_bytes)
        if rest or not 0 <= slot < self.num_slots:
            raise ValueError("view is not a slot of this pool")
        return slot
