"""Tier-change reporting as a wrapper: a lower tier that reports what is stored, removed or cleared through it.

Only some lower tiers can say what they hold: the disk tier reports every change itself,
evictions included, under its lock (``set_change_hook`` returns True); Redis, a shared
filesystem, peers and most plug-ins cannot. The storage manager calls each of its lower
tiers through one :class:`ReportingTier` (write-behind, promotion, lookups, operations), so
every tier reports its changes (:mod:`kvtier.storage.tier_events`) the same way:

- :meth:`ReportingTier.set_change_hook` offers the hook to the inner tier first. A tier that
  takes it reports its own changes and the wrapper passes its calls through unreported.
- Otherwise, while a hook is set, each call reports after the inner call returns:
  ``put_many`` (and ``put_many_with_codec``) ``"s"`` for the chunks stored, with their
  parents; ``delete_many`` ``"r"`` for the keys asked; ``clear`` ``"c"``. A call that fails
  reports nothing: a failing tier is a miss (nothing stored, nothing removed).
- A non-local tier (``local`` False) remembers the keys reported stored
  (:class:`~kvtier.storage.stale_remote.StaleRemoteTracker`); when its store *answers* such a
  key absent (``contains_many_known``; ``contains_many`` asks that way while a hook is set),
  the key is reported ``"r"`` once and counted in :attr:`ReportingTier.stale_forgotten`. A
  store that fails to answer is not taken for absent.

Without a hook every call is forwarded (one attribute check). The wrapper keeps the
:class:`~kvtier.tiers.base.LowerTier` contract of its inner tier; it takes the inner tier's
``name``, ``kind`` and ``local``, and catches the inner tier's failures (other than
``TypeError``/``ValueError``, which are programming errors and raised) as misses.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Iterator, Sequence

from kvtier.serde.base import Buffer, Codec
from kvtier.storage.stale_remote import DEFAULT_CAPACITY, StaleRemoteTracker
from kvtier.tiers.base import ChangeHook, ChunkWrite, LowerTier

log = logging.getLogger(__name__)

__all__ = ["ReportingTier"]


class ReportingTier(LowerTier):
    """``inner`` with its changes reported to a :data:`~kvtier.tiers.base.ChangeHook` (see the module doc).

    Args:
        inner: the lower tier (the wrapper does not own it more than the caller does:
            :meth:`close` closes it).
        capacity: keys remembered as reported stored, for a non-local tier (>= 1).

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, inner: LowerTier, capacity: int = DEFAULT_CAPACITY) -> None:
        self.inner = inner
        self.name = inner.name
        self.kind = inner.kind
        self.local = inner.local
        self._stale = None if inner.local else StaleRemoteTracker(capacity)
        self._hook: ChangeHook | None = None
        self._own = False  # the inner tier reports its own changes to the hook
        self._lock = threading.Lock()
        #: Keys reported stored that the store later answered absent (reported removed).
        self.stale_forgotten = 0

    # -- reporting ---------------------------------------------------------------------------
    def set_change_hook(self, hook: ChangeHook | None) -> bool:
        """Report this tier's changes to ``hook`` (None: stop, and forget the tracked keys).

        Returns True: every change made through the wrapper is reported (by the inner
        tier itself where it can, else here). Never raises: an inner tier whose
        ``set_change_hook`` raises is reported here.
        """
        self._hook = None
        inner_hook = hook
        if hook is not None and self._stale is not None:
            inner_hook = self._tracking(hook, self._stale)
        try:
            own = bool(self.inner.set_change_hook(inner_hook))
        except Exception:  # defensive: a plug-in's hook failure means the wrapper reports
            log.exception("kvtier: %s refused a change hook", self.name)
            own = False
        if hook is None and self._stale is not None:
            self._stale.cleared()
        self._own = own and hook is not None
        self._hook = hook
        return True

    @property
    def reporting(self) -> bool:
        """True while a hook is set (someone listens)."""
        return self._hook is not None

    @property
    def tracked(self) -> int:
        """Keys remembered as reported stored (0 for a local tier)."""
        return 0 if self._stale is None else len(self._stale)

    @staticmethod
    def _tracking(hook: ChangeHook, stale: StaleRemoteTracker) -> ChangeHook:
        def on_change(op: str, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
            stale.track(op, keys)
            hook(op, keys, parents)

        return on_change

    def _report(self, op: str, keys: Sequence[bytes], parents: Sequence[bytes | None] = ()) -> None:
        """Report a change made through the wrapper (not when the inner tier reports its own)."""
        hook = self._hook
        if hook is None or self._own:
            return
        if self._stale is not None:
            self._stale.track(op, keys)
        self._emit(hook, op, keys, parents)

    def _emit(self, hook: ChangeHook, op: str, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        try:
            hook(op, keys, parents)
        except Exception:  # defensive: a hook's failure never reaches the tier's caller
            log.exception("kvtier: reporting a change of %s failed", self.name)

    def _forget_absent(self, keys: Sequence[bytes], found: list[bool], answered: list[bool]) -> None:
        hook, stale = self._hook, self._stale
        if hook is None or stale is None:
            return
        absent = [k for k, f, a in zip(keys, found, answered) if a and not f]
        gone = stale.missing(absent) if absent else []
        if gone:
            with self._lock:
                self.stale_forgotten += len(gone)
            log.info("kvtier: %s no longer holds %d chunk(s) reported stored; reporting them removed",
                     self.name, len(gone))
            self._emit(hook, "r", gone, ())

    def _failed(self, what: str) -> None:
        log.exception("kvtier: %s %s failed", what, self.name)

    # -- the LowerTier interface -------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """The inner tier's answer; while reporting, a non-local tier is asked with
        :meth:`contains_many_known` (answered absences are reported). Failure: all False."""
        if self._hook is not None and self._stale is not None:
            return self.contains_many_known(keys)[0]
        try:
            return [bool(x) for x in self.inner.contains_many(keys)]
        except (TypeError, ValueError):
            raise
        except Exception:  # defensive: a failing tier is a miss
            self._failed("contains_many of")
            return [False] * len(keys)

    def contains_many_known(self, keys: Sequence[bytes]) -> tuple[list[bool], list[bool]]:
        """The inner tier's ``(found, answered)``; keys reported stored that the store answered
        absent are reported removed. Failure: nothing found, nothing answered."""
        none = [False] * len(keys)
        try:
            found, answered = self.inner.contains_many_known(keys)
        except (TypeError, ValueError):
            raise
        except Exception:  # defensive: a failure says nothing about absence
            self._failed("contains_many of")
            return none, list(none)
        if len(found) != len(keys) or len(answered) != len(keys):  # a broken plug-in
            log.error("kvtier: %s answered %d of %d keys", self.name, len(found), len(keys))
            return none, list(none)
        found, answered = [bool(x) for x in found], [bool(x) for x in answered]
        self._forget_absent(keys, found, answered)
        return found, answered

    def put_many(self, items: Sequence[ChunkWrite]) -> list[bool]:
        """The inner ``put_many``; the chunks stored are reported ``"s"``. Failure: all False.

        Raises:
            TypeError/ValueError: bad keys or payloads (the inner tier's check, before any write).
        """
        if not items:
            return []
        try:
            ok = [bool(x) for x in self.inner.put_many(items)]
        except (TypeError, ValueError):
            raise
        except Exception:  # defensive: a failing tier is a miss
            self._failed("writing to")
            return [False] * len(items)
        self._report_stored(items, ok)
        return ok

    def put_many_with_codec(self, items: Sequence[ChunkWrite], codec: Codec) -> list[bool]:
        """The inner ``put_many_with_codec``; the chunks stored are reported ``"s"``.

        Raises:
            NotImplementedError: the inner tier's format has no codec field.
        """
        ok = [bool(x) for x in self.inner.put_many_with_codec(items, codec)]
        self._report_stored(items, ok)
        return ok

    def _report_stored(self, items: Sequence[ChunkWrite], ok: Sequence[bool]) -> None:
        if self._hook is None:
            return
        done = [w for w, good in zip(items, ok) if good]
        if done:
            self._report("s", [w.key for w in done], [w.parent for w in done])

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        """The inner ``get_many_into``. Failure: all False (misses)."""
        try:
            return [bool(x) for x in self.inner.get_many_into(items)]
        except (TypeError, ValueError):
            raise
        except Exception:  # defensive: a failing tier is a miss
            self._failed("reading from")
            return [False] * len(items)

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """The inner ``delete_many``; ``keys`` are reported ``"r"``. Failure: 0, nothing reported."""
        if not keys:
            return 0
        try:
            n = int(self.inner.delete_many(keys))
        except (TypeError, ValueError):
            raise
        except Exception:  # defensive
            self._failed("deleting from")
            return 0
        self._report("r", list(keys))
        return n

    def clear(self) -> int:
        """The inner ``clear``, reported ``"c"``. Failure: 0, nothing reported."""
        try:
            n = int(self.inner.clear())
        except Exception:  # defensive: report nothing removed rather than raise
            self._failed("clearing")
            return 0
        self._report("c", ())
        return n

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """The inner ``touch_many`` (a failure is logged)."""
        try:
            self.inner.touch_many(keys)
        except Exception:  # defensive: a failing tier is a miss, never a crash
            self._failed("touching")

    @property
    def touch_needed(self) -> bool:
        """Whether touches do anything in the inner tier (it overrides ``touch_many`` and does not
        say otherwise, e.g. Redis without TTL): write-behind queues touches only then."""
        inner = self.inner
        return type(inner).touch_many is not LowerTier.touch_many and bool(getattr(inner, "touch_needed", True))

    @property
    def writable(self) -> bool:
        return self.inner.writable

    @property
    def location(self) -> str:
        return self.inner.location

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def scan_keys(self) -> Iterator[tuple[bytes, bytes | None]]:
        return self.inner.scan_keys()

    def stored_sizes(self, keys: Sequence[bytes]) -> list[int]:
        return self.inner.stored_sizes(keys)

    def close(self) -> None:
        """Close the inner tier (idempotent, as the inner tier's ``close``)."""
        self.inner.close()

    def __repr__(self) -> str:
        return f"ReportingTier({self.inner!r})"
