"""Forgetting stale existence in remote tiers: removals a store made by itself.

A remote store (Redis with ``maxmemory`` eviction or TTLs, a Redis restarted empty,
a shared filesystem another machine cleans) removes chunks without telling kvtier,
so the tier changes kvtier reported (``"s"``, see :mod:`kvtier.storage.tier_events`)
go stale: the controller's index and every KV-event consumer (a router) keep
believing this instance holds them and keep sending it requests for prefixes it no
longer has (lessons-from-the-field: "a remote store restarted empty while the client
still believed its keys existed ... forget the stale existence").

The store's own answers are the evidence. :class:`StaleRemoteTracker` remembers, per
non-local lower tier, the keys most recently reported stored (bounded, oldest
forgotten first: ``capacity`` keys of 32 bytes, ~100 bytes each with the dict's
overhead). When a lookup's ``contains_many`` or a read says such a key is not there,
the tracker returns it once so the manager reports it removed (``"r"``) and drops it.
Keys never reported stored produce no event, so a cold prompt's misses cost nothing
downstream.

Thread-safe (one lock; O(1) per key). Only used while someone listens to tier changes.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvtier.storage.stats import Counters
from kvtier.storage.tier_events import TierChange, TierEvents
from kvtier.tiers.base import ChangeHook, LowerTier

log = logging.getLogger(__name__)

#: Keys remembered per tier by default.
DEFAULT_CAPACITY = 65_536


class StaleRemoteTracker:
    """Keys reported stored in each non-local lower tier, to detect the store's own removals.

    Args:
        tiers: number of lower tiers (indices as in the manager's ``lower`` list).
        capacity: keys remembered per tier (>= 1); the oldest report is forgotten first.

    Raises:
        ValueError: ``tiers`` < 0 or ``capacity`` < 1.
    """

    def __init__(self, tiers: int, capacity: int = DEFAULT_CAPACITY) -> None:
        if tiers < 0 or capacity < 1:
            raise ValueError(f"tiers must be >= 0 and capacity >= 1, got {tiers}, {capacity}")
        self.capacity = capacity
        self._stored: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(tiers)]
        self._lock = threading.Lock()

    def stored(self, tier: int, keys: Sequence[bytes]) -> None:
        """Remember that ``keys`` were reported stored in lower tier ``tier``."""
        with self._lock:
            seen = self._stored[tier]
            for k in keys:
                seen[k] = None
                seen.move_to_end(k)
            while len(seen) > self.capacity:
                seen.popitem(last=False)

    def removed(self, tier: int, keys: Sequence[bytes]) -> None:
        """Forget ``keys`` of ``tier`` (they were reported removed, or the tier cleared)."""
        with self._lock:
            seen = self._stored[tier]
            for k in keys:
                seen.pop(k, None)

    def cleared(self, tier: int) -> None:
        """Forget every key of ``tier``."""
        with self._lock:
            self._stored[tier].clear()

    def missing(self, tier: int, keys: Sequence[bytes]) -> list[bytes]:
        """Of ``keys`` the store said it does not hold, those reported stored before.

        They are forgotten here: the caller reports them removed, once.
        """
        with self._lock:
            seen = self._stored[tier]
            return [k for k in keys if seen.pop(k, 0) is None]

    def __len__(self) -> int:
        with self._lock:
            return sum(len(s) for s in self._stored)


class StaleRemoteReporter:
    """A storage manager's use of :class:`StaleRemoteTracker`: wraps the change hooks of its
    non-local lower tiers so every reported change updates the tracker, and turns an
    answered absence (:func:`kvtier.storage.lookup.held_prefix`'s ``on_absent``) of a key
    reported stored into a ``"r"`` change (counted as ``remote_stale_forgotten``).

    Args:
        lower: the manager's lower tiers (indices as in the manager).
        events: the manager's tier-change fan-out.
        counters: the manager's counters.
        capacity: keys remembered per tier.
    """

    def __init__(self, lower: Sequence[LowerTier], events: TierEvents, counters: Counters,
                 capacity: int = DEFAULT_CAPACITY) -> None:
        self._lower = list(lower)
        self._events = events
        self._counters = counters
        self.tracker = StaleRemoteTracker(len(self._lower), capacity)

    def _remote(self, i: int) -> bool:
        return not self._lower[i].local

    def hook(self, i: int) -> ChangeHook:
        """The change hook for lower tier ``i``: emits; for a non-local tier also tracks."""
        emit = self._events.hook(self._lower[i].kind)
        if not self._remote(i):
            return emit

        def on_change(op: str, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
            self.track(i, op, keys)
            emit(op, keys, parents)

        return on_change

    def track(self, i: int, op: str, keys: Sequence[bytes]) -> None:
        """Record a change of lower tier ``i`` reported by other means (the manager's own calls)."""
        if not self._remote(i):
            return
        if op == "s":
            self.tracker.stored(i, keys)
        elif op == "r":
            self.tracker.removed(i, keys)
        elif op == "c":
            self.tracker.cleared(i)

    def on_absent(self, tier: LowerTier, keys: list[bytes]) -> None:
        """``tier`` answered ``keys`` absent: report those reported stored before as removed."""
        try:
            i = next(j for j, t in enumerate(self._lower) if t is tier)
        except StopIteration:  # pragma: no cover - not one of ours
            return
        gone = self.tracker.missing(i, keys)
        if gone:
            self._counters.add(remote_stale_forgotten=len(gone))
            log.info("kvtier: %s no longer holds %d chunk(s) reported stored; reporting them removed",
                     tier.name, len(gone))
            self._events.emit(TierChange("r", tier.kind, tuple(gone)))

    def reset(self) -> None:
        """Forget everything (nobody listens any more)."""
        for i in range(len(self._lower)):
            self.tracker.cleared(i)
