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
- Prefix-closed: a chunk that is the recorded parent of a resident chunk is
  never dropped (the chain-aware policy never offers it for eviction; ``delete``
  refuses it; ``clear`` keeps the ancestors of chunks it must keep), so the tier
  never holds a chunk whose parent it dropped, whatever its capacity.
- Acyclic: the recorded parents form a forest (:mod:`kvtier.index.chains`).
  ``commit`` records a parent only if it is neither the chunk itself nor one of
  its resident descendants; otherwise the chunk is published as a chain head
  (the link is dropped: it could only come from a malformed or hostile caller,
  and a cycle's chunks would never become leaves, so never evicted). ``clear``
  and ``delete_tree`` still remove a cycle's chunks if one ever formed.

:meth:`CpuTier.check_invariants` checks all of these (tests call it from their
state machines); cheap asserts guard each transition.
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import Callable, Iterable, Sequence

import numpy as np

from kvtier.index.chains import descendants
from kvtier.memory.pool import ChunkPool, PoolExhausted
from kvtier.tiers.base import ChangeHook
from kvtier.tiers.policies import EvictionPolicy, LRUPolicy

log = logging.getLogger(__name__)

WRITING = 0
READY = 1


class WriteSkip(enum.IntEnum):
    """Why ``open_write_many`` gave no buffer for a key.

    - ``PRESENT``: a tier already holds the chunk (nothing to store).
    - ``IN_FLIGHT``: another writer (this or another engine) holds an uncommitted
      reservation of it; the chain stays reachable once that writer commits, so a
      caller storing a prompt goes on with the rest of its chain.
    - ``NO_ROOM``: no CPU slot could be freed (or the store failed): the caller
      stops storing that chain (later chunks would be unreachable without it).
    """

    PRESENT = 1
    IN_FLIGHT = 2
    NO_ROOM = 3


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
        self._on_change: ChangeHook | None = None

    def set_change_hook(self, hook: ChangeHook | None) -> None:
        """Report every commit (``"s"``), drop (``"r"``: eviction, delete) and clear (``"c"``
        when nothing is left, else ``"r"`` of what went) to ``hook``, under the tier's lock
        (see :mod:`kvtier.storage.tier_events`); None stops it. Without a hook the hot
        path pays one ``is None`` check."""
        with self._lock:
            self._on_change = hook

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

    def resident(self) -> list[tuple[bytes, bytes | None]]:
        """``(key, parent)`` of every committed chunk (a copy taken under the lock; O(entries))."""
        with self._lock:
            parent_of = self.policy.parent_of
            return [(k, parent_of(k)) for k, slot in self._entries.items() if self._state[slot] == READY]

    def referenced_chunks(self) -> int:
        """Entries with readers or writers (should be 0 when idle)."""
        with self._lock:
            return sum(1 for slot in self._entries.values() if self._refs[slot])

    # -- write path --------------------------------------------------------
    def reserve(self, key: bytes, parent: bytes | None = None) -> np.ndarray | None:
        """Reserve a slot for ``key`` and return it (uint8 ``[chunk_bytes]``) for the caller to fill.

        Returns ``None`` if the key is already present (or being written) or no
        slot can be freed (everything pinned or referenced). The caller must
        follow with :meth:`commit` or :meth:`abort`. :meth:`try_reserve` says which.
        """
        got = self.try_reserve(key, parent)
        return None if isinstance(got, WriteSkip) else got

    def try_reserve(self, key: bytes, parent: bytes | None = None) -> np.ndarray | WriteSkip:
        """Like :meth:`reserve`, but a refusal says why.

        ``parent`` (the key the chunk will be committed with) is never evicted to
        make room for it: the new chunk would be orphaned at birth.

        Returns:
            The slot view (uint8 ``[chunk_bytes]``) to fill, or
            ``WriteSkip.PRESENT`` (committed here), ``WriteSkip.IN_FLIGHT`` (another
            writer holds an uncommitted reservation) or ``WriteSkip.NO_ROOM``
            (every slot is referenced, pinned or the parent of a resident chunk).
        """
        with self._lock:
            slot = self._entries.get(key)
            if slot is not None:
                return WriteSkip.PRESENT if self._state[slot] == READY else WriteSkip.IN_FLIGHT
            slot = self._alloc_locked(parent)
            if slot is None:
                return WriteSkip.NO_ROOM
            self._entries[key] = slot
            self._state[slot] = WRITING
            self._refs[slot] = 1
            return self.pool.view(slot)

    def commit(self, key: bytes, parent: bytes | None = None) -> bytes | None:
        """Publish a reserved chunk; it becomes visible to readers. Returns the parent recorded.

        ``parent`` is the key of the previous chunk of the same prompt (None for
        the first): chain-aware policies evict a chain's tail before its head. A
        parent that is ``key`` itself or one of its resident descendants (which
        would close a parent cycle) is not recorded: the chunk is published as a
        chain head (see the module doc), and None is returned: callers pass the
        returned parent on (write-behind), so every tier gets the same forest.

        Raises:
            RuntimeError: ``key`` is not reserved (nothing changes).
        """
        with self._lock:
            slot = self._entries.get(key)
            if slot is None or self._state[slot] != WRITING:
                raise RuntimeError("commit of a chunk that is not being written")
            assert self._refs[slot] >= 1, "a WRITING entry holds its writer's reference"
            if self.policy.closes_cycle(key, parent):
                parent = None  # malformed caller input: the link would make a parent cycle
            self.policy.insert(key, parent)  # first: if it raises, the chunk stays unpublished
            self._state[slot] = READY
            self._refs[slot] -= 1
            if self._on_change is not None:
                self._on_change("s", (key,), (parent,))
            return parent

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
            slot = self._entries.get(key)
            if slot is None or self._refs[slot] <= 0:
                raise RuntimeError("release without acquire")
            self._refs[slot] -= 1

    # -- removal -----------------------------------------------------------
    def delete(self, key: bytes) -> bool:
        """Remove an unreferenced chunk; returns False if absent, in use, or the parent
        of a resident chunk (removing it would orphan that chunk)."""
        with self._lock:
            slot = self._entries.get(key)
            if slot is None or self._refs[slot] or self._state[slot] != READY:
                return False
            if self.policy.num_children(key):
                return False
            self._drop_locked(key, slot)
            return True

    def clear(self) -> int:
        """Remove every chunk that is not in use; returns how many were removed.

        Chunks being read or written stay, and so do their ancestors (the tier
        stays prefix-closed). O(entries x chain depth).
        """
        with self._lock:
            keep = self._in_use_and_ancestors_locked(self._entries)
            dropped = self._drop_leaf_first_locked([k for k in self._entries if k not in keep])
            if self._on_change is not None:
                if len(self.policy) == 0:  # nothing committed is left (reservations are not resident)
                    self._on_change("c", (), ())
                elif dropped:
                    self._on_change("r", dropped, ())
            return len(dropped)

    def delete_tree(self, keys: Sequence[bytes]) -> list[bytes]:
        """Remove ``keys`` and their resident descendants, deepest first; returns the keys removed.

        A chunk in use (read, written, or queued for a lower tier) stays, and so do its
        ancestors (the tier stays prefix-closed). Keys not resident are ignored. O(entries).
        """
        with self._lock:
            kids: dict[bytes, list[bytes]] = {}
            for k in self._entries:
                p = self.policy.parent_of(k)
                if p is not None:
                    kids.setdefault(p, []).append(k)
            order = descendants([k for k in keys if k in self._entries], lambda k: kids.get(k, ()))
            keep = self._in_use_and_ancestors_locked(order)
            removed = self._drop_leaf_first_locked([k for k in order if k not in keep])
            if removed and self._on_change is not None:
                self._on_change("r", removed, ())
            return removed

    def _in_use_and_ancestors_locked(self, keys: Iterable[bytes]) -> set[bytes]:
        """Those of ``keys`` being read or written (or not committed), with their resident ancestors."""
        refs, state = self._refs, self._state
        keep = {k for k in keys if refs[self._entries[k]] or state[self._entries[k]] != READY}
        for k in list(keep):
            parent = self.policy.parent_of(k)
            while parent is not None and parent in self._entries and parent not in keep:  # ends: keep grows
                keep.add(parent)
                parent = self.policy.parent_of(parent)
        return keep

    def _drop_leaf_first_locked(self, victims: list[bytes]) -> list[bytes]:
        """Drop ``victims`` (committed, unreferenced; no resident child of one stays), each after its
        resident children; returns them in the order dropped (unreported: the caller reports).

        When no victim is a leaf any more, those left lie on parent cycles (``commit`` refuses the
        links that close one, so only a bug elsewhere could make one): they go too, so no cycle can
        outlive a clear.
        """
        dropped: list[bytes] = []
        while victims:
            rest = []
            for k in victims:
                if self.policy.num_children(k):
                    rest.append(k)
                else:
                    self._drop_locked(k, self._entries[k], report=False)
                    dropped.append(k)
            if len(rest) == len(victims):
                log.error("kvtier CPU tier: %d chunks on parent cycles; removing them anyway", len(rest))
                for k in rest:
                    self._drop_locked(k, self._entries[k], report=False, on_cycle=True)
                dropped.extend(rest)
                break
            victims = rest
        return dropped

    def _drop_locked(self, key: bytes, slot: int, report: bool = True, on_cycle: bool = False) -> None:
        assert self._refs[slot] == 0, "dropping a chunk in use"
        assert on_cycle or self.policy.num_children(key) == 0, "dropping the parent of a resident chunk"
        del self._entries[key]
        self.policy.remove(key)
        self.pool.free(slot)
        if report and self._on_change is not None:
            self._on_change("r", (key,), ())

    def check_invariants(self) -> None:
        """Assert the module's invariants (O(entries); for tests and debugging).

        Raises:
            AssertionError: an invariant is broken.
        """
        with self._lock:
            slots = list(self._entries.values())
            assert len(set(slots)) == len(slots), "two entries share a slot"
            assert len(slots) <= self.pool.num_slots
            assert self.used_bytes <= self.capacity_bytes
            for key, slot in self._entries.items():
                assert 0 <= slot < self.pool.num_slots
                assert self._refs[slot] >= 0, "negative reference count"
                if self._state[slot] == WRITING:
                    assert self._refs[slot] >= 1, "a WRITING entry without its writer reference"
                    assert key not in self.policy, "an unpublished entry is in the eviction order"
                else:
                    assert self._state[slot] == READY
                    assert key in self.policy, "a published entry is missing from the eviction order"
            assert self.pool.num_free + len(slots) == self.pool.num_slots, "a slot leaked or is double-owned"
            ready = sum(1 for s in slots if self._state[s] == READY)
            assert len(self.policy) == ready, "eviction order and entries disagree"
            self.policy.check_invariants()

    def give_back(self, timeout_s: float = 0.05) -> bool:
        """Free one slot of a budget-sharing pool for another pool (see :mod:`kvtier.memory.budget`).

        Uses a spare slot if the pool has one, else evicts one unreferenced,
        unpinned leaf chunk. Waits at most ``timeout_s`` seconds for the tier's
        lock (two tiers asking each other cannot deadlock). Returns False if
        nothing could be freed.
        """
        if not self._lock.acquire(timeout=timeout_s):
            return False
        try:
            if self.pool.release_spare():
                return True
            if not self._evict_one_locked(None):
                return False
            return self.pool.release_spare()
        finally:
            self._lock.release()

    def _evict_one_locked(self, keep: bytes | None) -> bool:
        for key in self.policy.candidates():
            if key != keep and self._refs[self._entries[key]] == 0 and not self._is_pinned(key):
                self._drop_locked(key, self._entries[key])  # asserts: a leaf, unreferenced
                self.evicted_chunks += 1
                self.evicted_bytes += self.chunk_bytes
                return True
        return False

    def _alloc_locked(self, keep: bytes | None = None) -> int | None:
        try:
            return self.pool.alloc()
        except PoolExhausted:
            pass
        if not self._evict_one_locked(keep):
            return None
        return self.pool.alloc()
