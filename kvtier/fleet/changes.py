"""Tier changes of an instance, queued for the fleet agent: bounded, coalesced, never blocking.

A storage manager calls its listeners (:mod:`kvtier.storage.tier_events`) on the
engine's threads, possibly under a tier lock: :meth:`ChangeQueue.listener` gives
a listener that only appends to a deque. The agent thread :meth:`ChangeQueue.drain`\\ s
it into :class:`~kvtier.protocol.fleet.Change` entries: consecutive changes of the
same ``(op, namespace, tier)`` are merged, an entry carries at most
:data:`~kvtier.protocol.fleet.MAX_KEYS_PER_PART` keys.

Bound: at most ``max_keys`` keys wait. A change beyond it empties the queue,
counts the dropped keys and sets :attr:`ChangeQueue.overflowed`: the agent must
then send a full snapshot (the lost changes are repaired by it, never replayed).

**Removals from a shared tier are never dropped.** A snapshot repairs only this instance's own
view of a tier that other instances share (a Redis, a shared filesystem): the controller applies a
removal to the other sharers' views only as a change (:mod:`kvtier.controller.index`). So removals
(``"r"``, ``"c"``) of the tiers named ``shared`` are set aside, in order, where the queue would
otherwise lose them - folded into a snapshot (:meth:`ChangeQueue.fold`), dropped by an overflow,
or in a batch whose send failed (:meth:`ChangeQueue.requeue`) - and the agent sends them as a
change right before its next snapshot (:meth:`ChangeQueue.take_kept`). They are bounded too: beyond
``max_keys // 8`` keys set aside, a tier's removals collapse into one ``"c"`` of it (the controller
then clears every view of it and asks the other sharers to list the store again).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Iterable, Sequence

from kvtier.protocol.fleet import MAX_CHANGES, MAX_KEYS_PER_PART, Change, join_parents, split_keys
from kvtier.storage.tier_events import TierChange

_REMOVALS = ("r", "c")


class ChangeQueue:
    """Pending tier changes of every namespace of one instance (thread-safe).

    Args:
        max_keys: most keys waiting at once (>= 1); beyond, everything pending is
            dropped (but the shared tiers' removals) and :attr:`overflowed` set.
        shared: labels of this instance's tiers that other instances share (their removals
            are never dropped; module doc).

    Raises:
        ValueError: ``max_keys`` < 1.
    """

    def __init__(self, max_keys: int = 1 << 20, shared: Iterable[str] = ()):
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self.shared = frozenset(shared)
        self.max_kept_keys = max(1, max_keys // 8)
        self._items: deque[tuple[bytes, TierChange]] = deque()
        self._keys = 0  # keys in _items
        self._kept: deque[tuple[bytes, TierChange]] = deque()  # shared tiers' removals set aside, in order
        self._kept_keys = 0
        self._lock = threading.Lock()
        self.overflowed = False
        self.dropped_keys = 0  # lost to overflow (repaired by a snapshot)
        self.folded_keys = 0  # discarded because a snapshot read after them covers them

    def listener(self, namespace: bytes) -> Callable[[TierChange], None]:
        """A tier listener tagging its changes with ``namespace`` (32-byte digest); only enqueues."""

        def on_change(change: TierChange) -> None:
            self.put(namespace, change)

        return on_change

    def put(self, namespace: bytes, change: TierChange) -> None:
        """Queue one change (O(1); never blocks beyond a short lock)."""
        n = max(1, len(change.keys))
        with self._lock:
            if self._keys + n > self.max_keys:
                self._set_aside(self._items)
                self.dropped_keys += self._keys + n
                self._items.clear()
                self._keys = 0
                self._set_aside([(namespace, change)])
                self.overflowed = True
                return
            self._items.append((namespace, change))
            self._keys += n

    def __len__(self) -> int:
        """Keys waiting, set-aside removals included (a clear counts 1)."""
        return self._keys + self._kept_keys

    def fold(self) -> None:
        """Discard everything pending and the overflow flag: a snapshot read after this covers it
        (but for the shared tiers' removals, which are set aside for :meth:`take_kept`)."""
        with self._lock:
            self._set_aside(self._items)
            self.folded_keys += self._keys
            self._items.clear()
            self._keys = 0
            self.overflowed = False

    def requeue(self, changes: Sequence[Change]) -> None:
        """Set aside the shared tiers' removals of a batch whose send failed (the rest is lost:
        the snapshot that follows covers it)."""
        with self._lock:
            self._set_aside([(c.namespace, TierChange(c.op, c.tier, tuple(split_keys(c.keys)), ()))
                             for c in changes])

    def take_kept(self, max_keys: int = 8 * MAX_KEYS_PER_PART) -> list[Change]:
        """Up to about ``max_keys`` keys of the set-aside removals, in order, as :class:`Change`
        entries (to send right before a snapshot; call until it returns [])."""
        with self._lock:
            taken, n = _take(self._kept, max_keys)
            self._kept_keys -= n
        return _coalesce(taken)

    def _set_aside(self, items: Iterable[tuple[bytes, TierChange]]) -> None:
        """Keep the shared tiers' removals of ``items`` (caller holds the lock); beyond
        :attr:`max_kept_keys`, each tier's set-aside removals become one clear of it."""
        for ns, ch in items:
            if ch.op in _REMOVALS and ch.tier in self.shared:
                self._kept.append((ns, ch))
                self._kept_keys += max(1, len(ch.keys))
        if self._kept_keys > self.max_kept_keys:
            tiers = list(dict.fromkeys((ns, ch.tier) for ns, ch in self._kept))
            self._kept = deque((ns, TierChange("c", tier, (), ())) for ns, tier in tiers)
            self._kept_keys = len(self._kept)

    def drain(self, max_keys: int = 8 * MAX_KEYS_PER_PART) -> list[Change]:
        """Take up to about ``max_keys`` keys of changes, in order, coalesced into :class:`Change` entries.

        Consecutive changes with the same ``(op, namespace, tier)`` share an entry;
        an entry holds at most :data:`MAX_KEYS_PER_PART` keys. Returns [] when
        nothing waits (set-aside removals are taken by :meth:`take_kept` only).
        """
        with self._lock:
            taken, n = _take(self._items, max_keys)
            self._keys -= n
        return _coalesce(taken)


def _take(items: deque[tuple[bytes, TierChange]], max_keys: int) -> tuple[list[tuple[bytes, TierChange]], int]:
    """Pop up to about ``max_keys`` keys of changes from the front of ``items`` (a huge change is
    split); returns them and the keys taken (a clear counts 1). Bounded so that one Changes message
    stays within MAX_CHANGES entries and the socket's message size: at most MAX_CHANGES // 2 items."""
    taken: list[tuple[bytes, TierChange]] = []
    n = 0
    while items and n < max_keys and len(taken) < MAX_CHANGES // 2:
        ns, ch = items.popleft()
        room = max(1, max_keys - n)
        if len(ch.keys) > room:
            rest = TierChange(ch.op, ch.tier, ch.keys[room:], ch.parents[room:] if ch.parents else ch.parents)
            ch = TierChange(ch.op, ch.tier, ch.keys[:room], ch.parents[:room] if ch.parents else ch.parents)
            items.appendleft((ns, rest))
        n += max(1, len(ch.keys))
        taken.append((ns, ch))
    return taken, n


def _coalesce(taken: Sequence[tuple[bytes, TierChange]]) -> list[Change]:
    """``taken`` as :class:`Change` entries: consecutive changes of one ``(op, namespace, tier)``
    share an entry of at most :data:`MAX_KEYS_PER_PART` keys; a clear is an entry of its own."""
    out: list[Change] = []
    cur: tuple[str, bytes, str] | None = None
    keys: list[bytes] = []
    parents: list[bytes | None] = []

    def flush() -> None:
        if cur is None:
            return
        op, ns, tier = cur
        out.append(Change(op, ns, tier, b"".join(keys), join_parents(parents) if op == "s" else b""))  # type: ignore[arg-type]

    for ns, ch in taken:
        head = (ch.op, ns, ch.tier)
        if ch.op == "c":
            flush()
            cur, keys, parents = None, [], []
            out.append(Change("c", ns, ch.tier))
            continue
        if head != cur or len(keys) >= MAX_KEYS_PER_PART:
            flush()
            cur, keys, parents = head, [], []
        ch_parents = ch.parents if ch.op == "s" and len(ch.parents) == len(ch.keys) else (None,) * len(ch.keys)
        for key, parent in zip(ch.keys, ch_parents):
            if len(keys) >= MAX_KEYS_PER_PART:
                flush()
                keys, parents = [], []
            keys.append(key)
            parents.append(parent)
    flush()
    return out
