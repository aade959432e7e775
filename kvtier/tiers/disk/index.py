"""The disk tier's in-memory index: which chunks are on disk, their sizes and parents.

Invariant (prefix closure, kept here and checked by :meth:`ChunkIndex.check_invariants`):
every resident chunk's parent is resident, or it is a prompt's first chunk
(parent None), or the chunk is in ``early`` (it was written while its parent
was absent: write-behind may store a prompt's chunks out of order). The index
never removes a chunk while a resident chunk names it as parent: eviction only
takes leaves (the chain-aware policy offers nothing else), and an explicit
removal (delete, a corrupt file, repeated read errors) takes the chunk's
resident descendants with it. A write never evicts the written chunk's parent
or its waiting children, and a chunk written before its parent evicts nothing
(it takes free room only). So chains are given up tail first and no chunk is
kept, or stored, at the price of its parent.

Acyclic (kept by ``_add``, checked by :meth:`ChunkIndex.check_invariants`): the
recorded parents form a forest (:mod:`kvtier.index.chains`). A chunk is indexed
with its parent only if that parent is neither the chunk itself nor one of its
resident descendants; otherwise it is indexed as a chain head (the link would
close a cycle, whose chunks eviction and ``remove`` could never order; only a
malformed or hostile writer names such a parent). :meth:`ChunkIndex.remove`
visits each descendant once, so even a cycle could not make it loop.

Byte accounting: ``used_bytes`` = file bytes of resident chunks + bytes reserved
by writes in flight, and never exceeds ``capacity_bytes`` except after a load
of an over-full directory, which :meth:`make_room` trims at once.

Not thread-safe: the disk tier calls every method under its own lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from kvtier.index.chains import closes_cycle, descendants, first_cycle
from kvtier.index.keys import chain_parent
from kvtier.tiers.base import ChangeHook
from kvtier.tiers.policies import EvictionPolicy


@dataclass(frozen=True)
class Entry:
    """A resident chunk: ``size`` file bytes on disk, ``parent`` as recorded: the previous chunk's key,
    or for a prompt's first chunk None or its lineage marker (:func:`kvtier.index.keys.chain_parent`
    maps both to "no parent" for prefix closure)."""

    size: int
    parent: bytes | None


class ChunkIndex:
    """Resident chunks, in-flight write reservations and readers of one disk tier directory.

    Args:
        capacity_bytes: bound on ``used_bytes``.
        policy: eviction order (chain-aware: never offers a key with resident children).
        is_pinned: keys that must not be evicted (leases held by the storage manager).
        unlink: deletes a chunk's file; called for every key the index removes.
    """

    def __init__(
        self,
        capacity_bytes: int,
        policy: EvictionPolicy,
        is_pinned: Callable[[bytes], bool],
        unlink: Callable[[bytes], None],
    ):
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self._is_pinned = is_pinned
        self._unlink = unlink
        self.entries: dict[bytes, Entry] = {}
        self.children: dict[bytes, set[bytes]] = {}  # parent key -> resident children
        self.early: set[bytes] = set()  # resident chunks written while their parent was absent
        self.reserved: dict[bytes, int] = {}  # key being written -> bytes reserved
        self._reserved_parent: dict[bytes, bytes] = {}  # key being written -> its parent (not evicted meanwhile)
        self._awaited: dict[bytes, int] = {}  # parent -> writes in flight naming it
        self.reading: dict[bytes, int] = {}  # key -> readers in flight
        self.used_bytes = 0
        self.evicted_chunks = 0
        self.evicted_bytes = 0
        #: Told of every chunk that becomes resident (``"s"``) or leaves (``"r"``); None: nobody listens.
        self.on_change: ChangeHook | None = None

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    # -- loading and writing ------------------------------------------------------
    def load(self, found: Iterable[tuple[bytes, int, bytes | None]]) -> None:
        """Index chunks found on disk at open, oldest first: ``(key, file bytes, parent)``.

        The caller has dropped orphans (chunks whose parent is not among ``found``).
        """
        for key, size, parent in found:
            self._add(key, size, parent)
        assert not self.early, "orphans must be dropped before the index is loaded"

    def reserve(self, key: bytes, size: int, parent: bytes | None, parent_pending: bool = False) -> bool:
        """Reserve ``size`` bytes for a write of ``key`` (child of ``parent``), evicting leaves as needed.

        Never evicts ``parent`` for it (a chunk is not stored at the price of its own
        prefix), nor ``key``'s resident children (written before it, they become
        reachable with it). A chunk whose parent is not resident (written out of
        order) evicts nothing: it could not be hit before its parent arrives, so it
        only takes free room. ``parent_pending``: the parent is reserved by the same
        batch, to be published before ``key`` (and ``key`` dropped if it fails), so it
        counts as resident here. False (nothing reserved) if ``key`` is being written
        already, if ``size`` exceeds the capacity, or if no room can be made.
        """
        if key in self.reserved or size > self.capacity_bytes:
            return False
        # A rewrite of a resident key needs room only for its growth: the old record goes at
        # commit. (Reserving the whole size would evict another chunk, even the parent of a
        # chunk written next, to rewrite one already on disk; used_bytes overshoots the
        # capacity by at most the old record until the commit.)
        old = self.entries.get(key)
        need = size - old.size if old is not None else size
        parent = chain_parent(parent)  # a lineage marker is no resident chunk
        if parent is not None and parent not in self.entries and not (parent_pending and parent in self.reserved):
            room = self.used_bytes + need <= self.capacity_bytes
        else:
            room = self.make_room(need, {key, parent, *self.children.get(key, ())})
        if not room:
            return False
        self.reserved[key] = size
        self.used_bytes += size
        if parent is not None:
            self._reserved_parent[key] = parent
            self._awaited[parent] = self._awaited.get(parent, 0) + 1
        return True

    def _drop_reservation(self, key: bytes) -> int:
        parent = self._reserved_parent.pop(key, None)
        if parent is not None:
            n = self._awaited[parent] - 1
            if n:
                self._awaited[parent] = n
            else:
                del self._awaited[parent]
        return self.reserved.pop(key)

    def unreserve(self, key: bytes) -> None:
        """Give back a reservation whose write failed."""
        self.used_bytes -= self._drop_reservation(key)

    def commit(self, key: bytes, size: int, parent: bytes | None) -> None:
        """The write of ``key`` (``size`` file bytes) is on disk under its final name.

        Replacing a resident key keeps its recorded parent (keys are chain hashes).
        """
        self.used_bytes -= self._drop_reservation(key)
        old = self.entries.get(key)
        if old is not None:
            self.used_bytes += size - old.size
            self.entries[key] = Entry(size, old.parent)
            self.policy.insert(key, chain_parent(old.parent))  # a use of a resident key
            return
        self._add(key, size, parent)

    def _add(self, key: bytes, size: int, parent: bytes | None) -> None:
        link = chain_parent(parent)
        if link is not None and (link == key or self.children.get(key)) and closes_cycle(
            key, link, self._link_of, len(self.entries)
        ):
            parent = link = None  # a parent cycle (see the module doc): indexed as a chain head
        if self.on_change is not None:
            self.on_change("s", (key,), (parent,))
        self.entries[key] = Entry(size, parent)
        self.used_bytes += size
        parent = link
        self.policy.insert(key, parent)
        if parent is not None:
            self.children.setdefault(parent, set()).add(key)
            if parent not in self.entries:
                self.early.add(key)
        self.early.difference_update(self.children.get(key, ()))  # its early children found their parent

    # -- removal --------------------------------------------------------------------
    def make_room(self, size: int, keep: set[bytes | None] | frozenset[bytes] = frozenset()) -> bool:
        """Evict leaves in policy order (never those in ``keep``) until ``size`` more bytes fit;
        False if they cannot."""
        while self.used_bytes + size > self.capacity_bytes:
            victim = None
            for key in self.policy.candidates():
                if (
                    key not in keep
                    and key not in self.reserved  # being rewritten right now
                    and key not in self._awaited  # the parent of a chunk being written
                    and not self.reading.get(key)
                    and not self._is_pinned(key)
                ):
                    victim = key
                    break
            if victim is None:
                return False
            assert not self.children.get(victim), "eviction must only take leaves"
            self.evicted_bytes += self._remove_one(victim)
            self.evicted_chunks += 1
        return True

    def remove(self, key: bytes) -> int:
        """Remove ``key`` and its resident descendants (deepest first); returns chunks removed."""
        if key not in self.entries:
            return 0
        entries = self.entries
        order = descendants([key], lambda k: [c for c in self.children.get(k, ()) if c in entries])
        for k in reversed(order):
            self._remove_one(k)
        return len(order)

    def _link_of(self, key: bytes) -> bytes | None:
        """``key``'s parent as a link (None: a first chunk, or not resident)."""
        e = self.entries.get(key)
        return None if e is None else chain_parent(e.parent)

    def _remove_one(self, key: bytes) -> int:
        entry = self.entries.pop(key)
        self.used_bytes -= entry.size
        self.policy.remove(key)
        self.early.discard(key)
        parent = chain_parent(entry.parent)
        if parent is not None:
            kids = self.children.get(parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self.children[parent]
        for child in self.children.get(key, ()):  # only reached for explicit removals of leaves' parents
            if child in self.entries:
                self.early.add(child)
        self._unlink(key)
        if self.on_change is not None:
            self.on_change("r", (key,), ())
        return entry.size

    # -- checks ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert byte accounting, the child map, prefix closure and acyclicity (see the module doc)."""
        assert self.used_bytes == sum(e.size for e in self.entries.values()) + sum(self.reserved.values())
        kids: dict[bytes, set[bytes]] = {}
        for key, entry in self.entries.items():
            parent = chain_parent(entry.parent)
            if parent is not None:
                kids.setdefault(parent, set()).add(key)
                if parent not in self.entries:
                    assert key in self.early, f"chunk {key.hex()[:16]} kept without its parent"
        assert kids == self.children, "child map out of date"
        assert first_cycle({k: chain_parent(e.parent) for k, e in self.entries.items()}) is None, "a parent cycle"
        assert self.early <= self.entries.keys()
        assert len(self.policy) == len(self.entries)
        for key, children in kids.items():
            if key in self.entries:
                assert self.policy.num_children(key) == len(children)
