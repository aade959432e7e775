"""Forgetting stale existence in remote tiers: removals a store made by itself.

A remote store (Redis with ``maxmemory`` eviction or TTLs, a Redis restarted empty,
a shared filesystem another machine cleans) removes chunks without telling kvtier,
so the tier changes kvtier reported (``"s"``, see :mod:`kvtier.storage.tier_events`)
go stale: the controller's index and every KV-event consumer (a router) keep
believing this instance holds them and keep sending it requests for prefixes it no
longer has (lessons-from-the-field: "a remote store restarted empty while the client
still believed its keys existed ... forget the stale existence").

The store's own answers are the evidence. A :class:`StaleRemoteTracker` remembers, for
one non-local lower tier, the keys most recently reported stored (bounded, oldest
forgotten first: ``capacity`` keys of 32 bytes, ~100 bytes each with the dict's
overhead). When the store answers such a key absent (``contains_many_known``), the
tracker returns it once, so the tier's
:class:`~kvtier.storage.reporting_tier.ReportingTier` reports it removed (``"r"``) and
drops it. Keys never reported stored produce no event, so a cold prompt's misses cost
nothing downstream.

Thread-safe (one lock; O(1) per key). Only used while someone listens to tier changes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

#: Keys remembered per tier by default.
DEFAULT_CAPACITY = 65_536


class StaleRemoteTracker:
    """Keys reported stored in one non-local lower tier, to detect the store's own removals.

    Args:
        capacity: keys remembered (>= 1); the oldest report is forgotten first.

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._stored: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def track(self, op: str, keys: Sequence[bytes]) -> None:
        """Follow one reported change: ``"s"`` remembers ``keys``, ``"r"`` forgets them, ``"c"`` forgets all."""
        if op == "s":
            self.stored(keys)
        elif op == "r":
            self.removed(keys)
        elif op == "c":
            self.cleared()

    def stored(self, keys: Sequence[bytes]) -> None:
        """Remember that ``keys`` were reported stored."""
        with self._lock:
            seen = self._stored
            for k in keys:
                seen[k] = None
                seen.move_to_end(k)
            while len(seen) > self.capacity:
                seen.popitem(last=False)

    def removed(self, keys: Sequence[bytes]) -> None:
        """Forget ``keys`` (they were reported removed)."""
        with self._lock:
            for k in keys:
                self._stored.pop(k, None)

    def cleared(self) -> None:
        """Forget every key (the tier was cleared, or nobody listens any more)."""
        with self._lock:
            self._stored.clear()

    def missing(self, keys: Sequence[bytes]) -> list[bytes]:
        """Of ``keys`` the store said it does not hold, those reported stored before.

        They are forgotten here: the caller reports them removed, once.
        """
        with self._lock:
            seen = self._stored
            return [k for k in keys if seen.pop(k, 0) is None]

    def __len__(self) -> int:
        with self._lock:
            return len(self._stored)
