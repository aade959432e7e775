"""A pre-allocated, pre-touched CPU memory pool cut into fixed-size chunk slots.

Every page is written once at construction, so copies into a slot run at memory
bandwidth (~10 GB/s on the 2-vCPU reference VM) instead of page-fault speed
(~2 GB/s into fresh allocations; see shared notes/baselines.md). After
construction the pool allocates nothing: ``alloc``/``free`` move slot indices on
a free list.

With a :class:`~kvtier.memory.budget.BudgetShare` (the cache service, whose
namespaces share one CPU budget) the buffer is sparse instead: a slot is charged
to the budget before its first use, a freed slot stays charged as a *spare*
(its pages stay backed, the next ``alloc`` reuses it), and
:meth:`ChunkPool.release_spare` uncharges a spare after releasing its pages.
Invariant: ``charged == (slots in use + spares) * slot_bytes``.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    from kvtier.memory.budget import BudgetShare
    from kvtier.memory.numa import NumaReport
    from kvtier.memory.numa_topology import Placement


#: Alignment of the private buffer (bytes): a page, as O_DIRECT requires.
PAGE_BYTES = 4096


class PoolExhausted(Exception):
    """No free slot; the caller evicts and retries, or treats the store as skipped."""


def pins_by_default() -> bool:
    """Whether host chunk memory is page-locked (CUDA pinned) unless told otherwise: when torch
    is loaded in this process and reports CUDA (never on CPU-only hosts)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


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
        budget: optional share of a byte budget shared with other pools: the
            pool charges a slot before its first use; ``alloc`` raises
            :class:`PoolExhausted` when the budget has no room and this pool
            holds its fair share or more (the caller evicts one of its own
            chunks), else asks the pools above their fair share for room.
        release_pages: with ``budget``: ``release_pages(slot)`` returns the
            slot's pages to the OS before the slot is uncharged.
        pin_memory: allocate the private buffer page-locked (CUDA pinned, via
            torch) so GPU copies are DMA; default: when torch is loaded in this
            process and ``torch.cuda.is_available()``. Ignored with ``buffer``.
        numa: NUMA placement of the private buffer (:mod:`kvtier.memory.numa`): its
            policy is set before the pre-touch and the pages checked after
            (:attr:`numa`). Ignored with ``buffer`` (the owner of that memory places it).

    Raises:
        ValueError: non-positive sizes, or ``buffer`` too small or read-only.
        MemoryError: the buffer cannot be allocated.
        RuntimeError: ``pin_memory=True`` without CUDA.
        NumaUnavailable: ``numa`` binds to a node the kernel refuses.
    """

    def __init__(
        self,
        slot_bytes: int,
        num_slots: int,
        buffer: np.ndarray | bytes | bytearray | memoryview | None = None,
        budget: "BudgetShare | None" = None,
        release_pages: Callable[[int], None] | None = None,
        pin_memory: bool | None = None,
        numa: "Placement | None" = None,
    ):
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError(f"slot_bytes and num_slots must be positive, got {slot_bytes}, {num_slots}")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._pinned: object | None = None  # the torch tensor owning pinned memory
        #: Where the pages are (None: no placement asked, or memory owned by someone else).
        self.numa: NumaReport | None = None
        if buffer is None:
            # Page-aligned (O_DIRECT reads/writes go straight into slots whose size is a
            # multiple of 4096) and pre-touched: fill() writes every page, whereas
            # np.empty/zeros would map them lazily. A NUMA policy is set before the
            # pre-touch (page-locked memory is touched as it is allocated: the policy is
            # this thread's during the allocation instead).
            raw = self._alloc_raw(slot_bytes * num_slots + PAGE_BYTES, pin_memory, numa)
            offset = (-raw.ctypes.data) % PAGE_BYTES
            self._buf = raw[offset : offset + slot_bytes * num_slots].reshape(num_slots, slot_bytes)
            if numa is None:
                self._buf.fill(1)
            else:
                from kvtier.memory.numa import place

                self.numa = place(self._buf.ctypes.data, self._buf.nbytes, numa, lambda: self._buf.fill(1))
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
        self._budget = budget
        self._release_pages = release_pages
        self._spare: list[int] = []  # free slots still charged to the budget (pages backed)

    def _alloc_raw(self, nbytes: int, pin_memory: bool | None, numa: "Placement | None" = None) -> np.ndarray:
        """``nbytes`` of host memory, page-locked (CUDA pinned) when asked or, by default,
        when torch is loaded in this process and reports CUDA (no-op on CPU-only hosts)."""
        if pin_memory is None:
            pin_memory = pins_by_default()
        if not pin_memory:
            return np.empty(nbytes, dtype=np.uint8)
        import torch as _torch

        if not _torch.cuda.is_available():
            raise RuntimeError("pin_memory=True needs a CUDA device (torch.cuda.is_available() is False)")
        from kvtier.memory.numa import thread_policy

        with thread_policy(numa):  # cudaHostAlloc touches the pages as it allocates them
            self._pinned = _torch.empty(nbytes, dtype=_torch.uint8, pin_memory=True)
        return self._pinned.numpy()

    def numa_stats(self) -> dict[str, int | float]:
        """``cpu_numa_*`` metrics of :attr:`numa` (empty when no placement was asked)."""
        return {} if self.numa is None else self.numa.stats()

    @property
    def pinned(self) -> bool:
        """True if the slots are page-locked host memory (CUDA copies run as DMA)."""
        return self._pinned is not None

    @property
    def capacity_bytes(self) -> int:
        return self.slot_bytes * self.num_slots

    @property
    def num_free(self) -> int:
        """Slots not in use (with a budget, not all of them may be chargeable now)."""
        return len(self._free) + len(self._spare)

    @property
    def charged_bytes(self) -> int:
        """Bytes charged to the budget (0 without one)."""
        return 0 if self._budget is None else self._budget.charged

    def alloc(self) -> int:
        """Take a free slot index.

        Raises:
            PoolExhausted: every slot is in use, or (with a budget) the budget
                has no room and none could be reclaimed from other pools.
        """
        b, sb = self._budget, self.slot_bytes
        with self._lock:
            if b is None:
                if not self._free:
                    raise PoolExhausted()
                return self._take_locked(self._free)
            if self._spare:
                return self._take_locked(self._spare)
            if not self._free:
                raise PoolExhausted()
            if b.try_charge(sb):
                return self._take_locked(self._free)
            if b.above_fair(sb):
                raise PoolExhausted()  # at or above its fair share: the caller evicts one of its own
        # Below its fair share: ask the pools furthest above theirs (never under our lock).
        if not b.reclaim(sb):
            raise PoolExhausted()
        with self._lock:
            if not self._free:  # pragma: no cover - only the owner's (locked) caller allocates
                b.uncharge(sb)
                raise PoolExhausted()
            return self._take_locked(self._free)

    def _take_locked(self, free_list: list[int]) -> int:
        slot = free_list.pop()
        self._in_use[slot] = 1
        return slot

    def release_spare(self) -> bool:
        """Release one spare slot's pages and uncharge it (for another pool); False if there is none."""
        b = self._budget
        if b is None:
            return False
        with self._lock:
            if not self._spare:
                return False
            slot = self._spare.pop()
            if self._release_pages is not None:
                self._release_pages(slot)
            self._free.append(slot)
            b.uncharge(self.slot_bytes, given_back=True)
            return True

    def release_free_pages(self) -> int:
        """Release the pages of every free, uncharged slot (with a budget); returns how many slots.

        Such pages should be unbacked; a client writing outside its reservations
        backs them without a charge. O(free slots) ``release_pages`` calls.
        """
        if self._budget is None or self._release_pages is None:
            return 0
        with self._lock:
            for slot in self._free:
                self._release_pages(slot)
            return len(self._free)

    def check_budget(self) -> None:
        """Assert ``charged == (in use + spares) * slot_bytes`` (no-op without a budget)."""
        if self._budget is None:
            return
        with self._lock:
            in_use = self.num_slots - len(self._free) - len(self._spare)
            assert self._budget.charged == (in_use + len(self._spare)) * self.slot_bytes, "pool charge drifted"

    def free(self, slot: int) -> None:
        """Return ``slot`` to the free list. Freeing a free slot is a bug and raises ValueError."""
        with self._lock:
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"slot {slot} out of range")
            if not self._in_use[slot]:
                raise ValueError(f"slot {slot} freed twice")
            self._in_use[slot] = 0
            (self._free if self._budget is None else self._spare).append(slot)

    def view(self, slot: int) -> np.ndarray:
        """The slot's bytes: a writable ``uint8`` array of shape ``[slot_bytes]`` (no copy).

        Raises:
            IndexError: the pool's buffer was released (:meth:`release_buffer`).
        """
        out: np.ndarray = self._buf[slot]
        return out

    def release_buffer(self) -> None:
        """Drop this pool's reference to its buffer, for an owner about to free the memory under it.

        A pool over a shared segment keeps a numpy view of the segment's mapping; while any view lives,
        ``mmap.close()`` cannot unmap it and the mapping's duplicate of the memfd stays open. The pool
        usually sits in a reference cycle (tier, manager, threads), so without this its view, and with it
        the whole segment (the CPU tier's capacity, in bytes), lived until the next garbage collection
        after the manager closed. Views handed out earlier stay valid; :meth:`view` raises IndexError
        afterwards (an empty buffer). Idempotent.
        """
        self._buf = np.empty((0, self.slot_bytes), dtype=np.uint8)

    def slot_of(self, view: np.ndarray) -> int:
        """The slot index of a view returned by :meth:`view`.

        Raises:
            ValueError: ``view`` does not start a slot of this pool.
        """
        base = self._buf.__array_interface__["data"][0]
        offset = view.__array_interface__["data"][0] - base
        slot: int
        slot, rest = divmod(offset, self.slot_bytes)
        if rest or not 0 <= slot < self.num_slots:
            raise ValueError("view is not a slot of this pool")
        return slot
