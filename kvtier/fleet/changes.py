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
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable

from kvtier.protocol.fleet import MAX_CHANGES, MAX_KEYS_PER_PART, Change, join_parents
from kvtier.storage.tier_events import TierChange


class ChangeQueue:
    """Pending tier changes of every namespace of one instance (thread-safe).

    Args:
        max_keys: most keys waiting at once (>= 1); beyond, everything pending is
            dropped and :attr:`overflowed` set.

    Raises:
        ValueError: ``max_keys`` < 1.
    """

    def __init__(self, max_keys: int = 1 << 20):
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self._items: deque[tuple[bytes, TierChange]] = deque()
        self._keys = 0  # keys in _items
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
                self.dropped_keys += self._keys + n
                self._items.clear()
                self._keys = 0
                self.overflowed = True
                return
            self._items.append((namespace, change))
            self._keys += n

    def __len__(self) -> int:
        """Keys waiting (a clear counts 1)."""
        return self._keys

    def fold(self) -> None:
        """Discard everything pending and the overflow flag: a snapshot read after this covers it."""
        with self._lock:
            self.folded_keys += self._keys
            self._items.clear()
            self._keys = 0
            self.overflowed = False

    def drain(self, max_keys: int = 8 * MAX_KEYS_PER_PART) -> list[Change]:
        """Take up to about ``max_keys`` keys of changes, in order, coalesced into :class:`Change` entries.

        Consecutive changes with the same ``(op, namespace, tier)`` share an entry;
        an entry holds at most :data:`MAX_KEYS_PER_PART` keys. Returns [] when
        nothing waits.
        """
        taken: list[tuple[bytes, TierChange]] = []
        with self._lock:
            n = 0
            # Bounded so that one Changes message stays within MAX_CHANGES entries and the socket's
            # message size: at most MAX_CHANGES // 2 items, and a huge item is split.
            while self._items and n < max_keys and len(taken) < MAX_CHANGES // 2:
                ns, ch = self._items.popleft()
                room = max(1, max_keys - n)
                if len(ch.keys) > room:
                    rest = TierChange(ch.op, ch.tier, ch.keys[room:], ch.parents[room:] if ch.parents else ch.parents)
                    ch = TierChange(ch.op, ch.tier, ch.keys[:room], ch.parents[:room] if ch.parents else ch.parents)
                    self._items.appendleft((ns, rest))
                k = max(1, len(ch.keys))
                self._keys -= k
                n += k
                taken.append((ns, ch))
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
