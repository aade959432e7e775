"""CPU DRAM tier: chunk payloads in slots of a pre-touched :class:`ChunkPool`.

Invariants (kept under ``self._lock``):
- A key is in ``_entries`` (key -> slot) iff it owns exactly one pool slot.
- An entry's state and reference count live in the per-slot arrays ``_state``
  and ``_refs`` at its slot, not in a per-entry object: that saves ~56 bytes of
  index memory per chunk (``kvtier bench tiers``: <= 300 B/chunk at 1M chunks).
  A free slot's values are meaningless; ``reserve`` sets them.
- A ``WRITING`` entry is invisible to ``contains``/``acquire`` until ``commit``;
  ``abort`` frees it. Its writer holds one reference.
- ``refs`` counts readers and writers currently copying the slot. An entry with
  ``refs > 0``, or whose key is pinned (leased by a lookup), is never evicted:
  eviction skips it and tries the next candidate of the policy.
- Bytes in use never exceed the pool, which is the tier's byte bound.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from kvtier.memory.pool import ChunkPool, PoolExhausted
from kvtier.tiers.policies import EvictionPolicy, LRUPolicy

WRITING = 0
READY = 1


class CpuTier:
    """Bounded CPU tier of fixed-size chunks.

    Args:
        chunk_bytes: payload bytes per chunk (slot size).
        capacity_bytes: byte bound; the pool holds ``capacity_bytes // chunk_bytes`` slots.
        policy: eviction order (default LRU).
        is_pinned: returns True for keys that must not be evicted (leases).
        pool: optional pre-built pool of ``chunk_bytes`` slots (e.g. over a
            shared-memory segment); it then sets the byte bound and
            ``capacity_bytes`` is ignored.

    Raises:
        ValueError: capacity below one chunk, or ``pool`` slots of another size.
    """

    name = "cpu"

    def __init__(
        self,
        chunk_bytes: int,
        capacity_bytes: int,
        policy: EvictionPolicy | None = None,
        is_pinned: Callable[[bytes], bool] = lambda key: False,
        pool: ChunkPool | None = None,
    ):
        if pool is not None:
            if pool.slot_bytes != chunk_bytes:
                raise ValueError(f"pool slots hold {pool.slot_bytes} B, chunks are {chunk_bytes} B")
        else:
            num_slots = capacity_bytes // chunk_bytes
            if num_slots < 1:
                raise ValueError(
                    f"CPU tier capacity {capacity_bytes} B is below one chunk ({chunk_bytes} B)"
                )
            pool = ChunkPool(chunk_bytes, num_slots)
        self.chunk_bytes = chunk_bytes
        self.pool = pool
        self.policy = policy or LRUPolicy()
        self._is_pinned = is_pinned
        self._entries: dict[bytes, int] = {}  # key -> slot
        self._state = bytearray(self.pool.num_slots)  # per slot: WRITING or READY
        self._refs = [0] * self.pool.num_slots  # per slot: readers + writers copying it
        self._lock = threading.Lock()
        self.evicted_chunks = 0
        self.evicted_bytes = 0

    # -- queries -----------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        slot = self._entries.get(key)
        return slot is not None and self._state[slot] == READY

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return len(self._entries) * self.chunk_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.pool.capacity_bytes

    def touch(self, key: bytes) -> None:
        with self._lock:
            if key in self._entries:
                self.policy.touch(key)

    def referenced_chunks(self) -> int:
        """Entries with readers or writers (should be 0 when idle)."""
        with self._lock:
            return sum(1 for slot in self._entries.values() if self._refs[slot])

    # -- write path --------------------------------------------------------
    def reserve(self, key: bytes) -> np.ndarray | None:
        """Reserve a slot for ``key`` and return it for the caller to fill.

        Returns ``None`` if the key is already present (or being written) or no
        slot can be freed (everything pinned or referenced). The caller must
        follow with :meth:`commit` or :meth:`abort`.
        """
        with self._lock:
            if key in self._entries:
                return None
            slot = self._alloc_locked()
            if slot is None:
                return None
            self._entries[key] = slot
            self._state[slot] = WRITING
            self._refs[slot] = 1
            return self.pool.view(slot)

    def commit(self, key: bytes, parent: bytes | None = None) -> None:
        """Publish a reserved chunk; it becomes visible to readers.

        ``parent`` is the key of the previous chunk of the same prompt (None for
        the first): chain-aware policies evict a chain's tail before its head.
        """
        with self._lock:
            slot = self._entries[key]
            if self._state[slot] != WRITING:
                raise RuntimeError("commit of a chunk that is not being written")
            if parent == key:
                parent = None  # a chunk cannot be its own parent (malformed caller input)
            self.policy.insert(key, parent)  # first: if it raises, the chunk stays unpublished
            self._state[slot] = READY
            self._refs[slot] -= 1

    def abort(self, key: bytes) -> None:
        """Drop a reserved chunk (the copy failed)."""
        with self._lock:
            slot = self._entries.get(key)
            if slot is None or self._state[slot] != WRITING:
                return
            del self._entries[key]
            self._refs[slot] = 0
            self.pool.free(slot)

    # -- read path ---------------------------------------------------------
    def acquire(self, key: bytes) -> np.ndarray | None:
        """Take a read reference; returns the slot view or ``None`` on a miss."""
        with self._lock:
            slot = self._entries.get(key)
            if slot is None or self._state[slot] != READY:
                return None
            self._refs[slot] += 1
            self.policy.touch(key)
            return self.pool.view(slot)

    def release(self, key: bytes) -> None:
        """Drop a read reference taken by :meth:`acquire`."""
        with self._lock:
            slot = self._entries[key]
            if self._refs[slot] <= 0:
                raise RuntimeError("release without acquire")
            self._refs[slot] -= 1

    # -- removal -----------------------------------------------------------
    def delete(self, key: bytes) -> bool:
        """Remove an unreferenced chunk; returns False if absent or in use."""
        with self._lock:
            slot = self._entries.get(key)
            if slot is None or self._refs[slot] or self._state[slot] != READY:
                return False
            self._drop_locked(key, slot)
            return True

    def clear(self) -> int:
        """Remove every unreferenced chunk; returns how many were removed."""
        with self._lock:
            refs, state = self._refs, self._state
            victims = [k for k, slot in self._entries.items() if not refs[slot] and state[slot] == READY]
            for k in victims:
                self._drop_locked(k, self._entries[k])
            return len(victims)

    def _drop_locked(self, key: bytes, slot: int) -> None:
        del self._entries[key]
        self.policy.remove(key)
        self.pool.free(slot)

    def _alloc_locked(self) -> int | None:
        try:
            return self.pool.alloc()
        except PoolExhausted:
            pass
        victim = None
        for key in self.policy.candidates():
            if self._refs[self._entries[key]] == 0 and not self._is_pinned(key):
                victim = key
                break
        if victim is None:
            return None
        self._drop_locked(victim, self._entries[victim])
        self.evicted_chunks += 1
        self.evicted_bytes += self.chunk_bytes
        return self.pool.alloc()
