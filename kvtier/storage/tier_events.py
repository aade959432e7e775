"""Tier change notifications: which chunks became resident in, or left, which tier.

A :class:`TierChange` says that chunks were stored (``"s"``), removed (``"r"``)
or that a tier was cleared of this namespace (``"c"``). The storage manager
(:meth:`kvtier.storage.manager.StorageManager.subscribe`) calls every listener
with every change of its tiers, exactly once and in order per key:

- ``cpu``: a commit (engine store or promotion) is ``"s"``; an eviction, delete
  or the part of a clear that could not remove everything is ``"r"``; a clear
  that left nothing resident is ``"c"``. Emitted under the CPU tier's lock.
- ``disk``: a write that made a chunk resident is ``"s"``; capacity eviction,
  delete, a corrupt record forgotten are ``"r"``; a clear that emptied it is
  ``"c"``. Emitted by the disk tier itself under its lock.
- other lower tiers (``remote``: Redis, shared filesystem, plug-ins; ``peer``):
  a successful write-behind or operation write is ``"s"``, a delete through the
  manager is ``"r"``, a clear is ``"c"``, emitted after the tier's call returns by
  the wrapper the manager calls the tier through
  (:class:`~kvtier.storage.reporting_tier.ReportingTier`). Removals the store makes by itself (Redis ``maxmemory``
  eviction, TTL expiry, a restart without persistence, another machine deleting
  files of a shared filesystem) are reported ``"r"`` when a lookup's answer from
  the store shows them (:mod:`kvtier.storage.stale_remote`), not when they
  happen: a consumer must treat a remote tier's state as a hint (a lookup there
  is confirmed by the store) and resync with a snapshot.
  A rewrite of a chunk the remote store already held is reported ``"s"`` again
  (harmless to a set). Two lower tiers of one kind share one label.

Replaying the changes of one tier onto a set (``s``: add, ``r``: discard, ``c``:
empty) gives the tier's resident keys (local tiers exactly; remote tiers up to
the store's own removals).

Listeners are called on whatever thread made the change (the engine's, a
write-behind worker, an operation's), possibly while a tier lock is held: a
listener must only enqueue (e.g. ``queue.SimpleQueue.put``), never block, call
back into the manager or its tiers, or take locks of its own that other code
holds while calling the manager. An exception a listener raises is logged and
swallowed; it never reaches the tier.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from kvtier.tiers.base import ChangeHook

log = logging.getLogger(__name__)

__all__ = ["ChangeHook", "TierChange", "TierEvents", "TierListener"]


@dataclass(frozen=True, slots=True)
class TierChange:
    """One change of one tier.

    Attributes:
        op: ``"s"`` stored (became resident), ``"r"`` removed, ``"c"`` tier cleared
            (every chunk of this namespace left it; ``keys`` empty).
        tier: a :data:`kvtier.storage.types.TIER_KINDS` label (``cpu``, ``disk``, ``remote``, ``peer``).
        keys: chunk keys (32-byte digests).
        parents: for ``"s"``, each key's parent (None for a prompt's first chunk), same
            length as ``keys``; empty for ``"r"`` and ``"c"``.
    """

    op: Literal["s", "r", "c"]
    tier: str
    keys: tuple[bytes, ...] = ()
    parents: tuple[bytes | None, ...] = ()


#: A subscriber: called with every change (see the module doc: only enqueue).
TierListener = Callable[[TierChange], None]



class TierEvents:
    """The listeners of one storage manager and the fan-out of changes to them.

    ``active`` is False while nobody listens: tiers are then given no hook, so the
    hot path pays one ``is None`` check. Thread-safe: the listener tuple is
    replaced, never mutated, so emitting takes no lock.
    """

    def __init__(self) -> None:
        self._listeners: tuple[TierListener, ...] = ()
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return bool(self._listeners)

    def subscribe(self, listener: TierListener) -> bool:
        """Add ``listener``; returns True if it is the first one (hooks must be installed).

        Raises:
            TypeError: ``listener`` is not callable.
        """
        if not callable(listener):
            raise TypeError(f"a tier listener must be callable, got {type(listener).__name__}")
        with self._lock:
            first = not self._listeners
            self._listeners = (*self._listeners, listener)
            return first

    def unsubscribe(self, listener: TierListener) -> bool:
        """Remove ``listener`` (unknown ones are ignored); returns True if none is left."""
        with self._lock:
            ls = list(self._listeners)
            if listener in ls:
                ls.remove(listener)
            self._listeners = tuple(ls)
            return not ls

    def emit(self, change: TierChange) -> None:
        """Call every listener with ``change``; a listener's exception is logged, never raised."""
        for listener in self._listeners:
            try:
                listener(change)
            except Exception:
                log.exception("kvtier: a tier listener failed on %s %s", change.op, change.tier)

    def hook(self, tier: str) -> ChangeHook:
        """A :data:`ChangeHook` emitting changes of ``tier`` (a TIER_KINDS label)."""

        def on_change(op: str, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
            if op != "c" and not keys:
                return
            self.emit(TierChange(op, tier, tuple(keys), tuple(parents) if op == "s" else ()))  # type: ignore[arg-type]

        return on_change
