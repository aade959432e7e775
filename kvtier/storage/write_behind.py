"""Write-behind: committed CPU chunks reach the lower tiers on background threads.

One :class:`~kvtier.storage.batch_worker.BatchWorker` per lower tier (the one
worker type for every tier). Each queued item is a :class:`ChunkWrite` whose
payload is the chunk's committed CPU slot, held by one CPU read reference until
the tier's ``put_many`` returns (so the slot cannot be evicted or reused while it
is copied). A full queue drops the write (counted); the engine's step never waits
for a lower tier. Touches of remote tiers (TTL refreshes of a prompt's hit chain)
ride the same queue, so lookups never wait for them either.

The storage manager gives the write-behind its lower tiers behind their
:class:`~kvtier.storage.reporting_tier.ReportingTier`, so each successful write
is reported (``"s"``) by the tier's wrapper, not here.

Invariants:
- every CPU reference taken by :meth:`WriteBehind.submit` is released exactly once:
  after the write, when the queue refuses it, or when the worker discards it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from functools import partial
from typing import Sequence, Union

from kvtier.storage.batch_worker import BatchWorker
from kvtier.tiers.base import ChunkWrite, LowerTier
from kvtier.tiers.cpu import CpuTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TouchChain:
    """Keys of one prompt's hit chunks, in prompt order, to mark as used in a tier."""

    keys: tuple[bytes, ...]


_Item = Union[ChunkWrite, TouchChain]


@dataclass
class TierQueueCounters:
    """Write-behind counters of one lower tier (chunks)."""

    queued: int = 0
    dropped: int = 0


class WriteBehind:
    """Background writers of committed chunks into the lower tiers.

    Args:
        cpu: the CPU tier whose slots hold the chunks being written.
        tiers: the lower tiers, fastest first.
        queue_sizes: most chunks waiting per tier (same order as ``tiers``).
        max_batch: most chunks one ``put_many`` carries.
    """

    def __init__(self, cpu: CpuTier, tiers: Sequence[LowerTier], queue_sizes: Sequence[int], max_batch: int = 8):
        if len(queue_sizes) != len(tiers):
            raise ValueError("one queue size per lower tier")
        self.cpu = cpu
        self.tiers = list(tiers)
        self.counters = [TierQueueCounters() for _ in self.tiers]
        self._lock = threading.Lock()
        self._workers: list[BatchWorker[_Item]] = [
            BatchWorker(
                f"kvtier-{tier.name or tier.kind}-write",
                partial(self._write_batch, i),
                max(1, int(size)),
                max_batch,
                on_discard=self._discard,
            )
            for i, (tier, size) in enumerate(zip(self.tiers, queue_sizes))
        ]
        # Touch only tiers that do something with it: the class overrides touch_many
        # and the instance does not say otherwise (``touch_needed``, e.g. Redis without TTL).
        self._touches = [
            type(t).touch_many is not LowerTier.touch_many and bool(getattr(t, "touch_needed", True))
            for t in self.tiers
        ]

    def submit(self, key: bytes, parent: bytes | None, upto: int | None = None) -> None:
        """Queue committed chunk ``key`` for every writable lower tier before index ``upto``
        (all tiers when None: a new chunk; a promoted chunk goes only to the tiers
        faster than the one it came from)."""
        n = len(self.tiers) if upto is None else upto
        for i in range(n):
            tier = self.tiers[i]
            if not tier.writable:
                continue
            buf = self.cpu.acquire(key)
            if buf is None:  # evicted meanwhile: nothing to write
                return
            if self._workers[i].submit(ChunkWrite(key, parent, buf)):
                with self._lock:
                    self.counters[i].queued += 1
            else:
                self.cpu.release(key)
                with self._lock:
                    self.counters[i].dropped += 1

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark a prompt's hit chain as used in every lower tier: local tiers at once
        (an index update), the others on their write-behind thread (a dropped touch
        is harmless)."""
        if not keys:
            return
        for tier, worker, wants in zip(self.tiers, self._workers, self._touches):
            if not wants:
                continue
            if tier.local:
                try:
                    tier.touch_many(keys)
                except Exception:  # defensive: a failing tier is a miss, never a crash
                    log.exception("kvtier: touching %s failed", tier.name)
            else:
                worker.submit(TouchChain(tuple(keys)))

    def pending(self, i: int) -> int:
        """Items waiting or being written for tier ``i``."""
        return self._workers[i].pending

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write reached its tier; False on timeout."""
        ok = True
        for w in self._workers:
            ok = w.flush(timeout_s) and ok
        return ok

    def close(self, timeout_s: float = 60.0) -> bool:
        """Write what is queued, then stop the threads; False if one did not finish in time."""
        ok = True
        for tier, w in zip(self.tiers, self._workers):
            if not w.close(timeout_s):
                log.warning("kvtier: write-behind to %s did not finish within %.0f s", tier.name, timeout_s)
                ok = False
        return ok

    # -- worker side -----------------------------------------------------------------
    def _write_batch(self, i: int, batch: list[_Item]) -> None:
        tier = self.tiers[i]
        writes = [item for item in batch if isinstance(item, ChunkWrite)]
        try:
            if writes:
                tier.put_many(writes)  # failures are dropped and counted by the tier
            for item in batch:
                if isinstance(item, TouchChain):
                    tier.touch_many(item.keys)
        except Exception:  # defensive: a failing tier loses the writes, nothing else
            log.exception("kvtier: write-behind to %s failed", tier.name)
        finally:
            for w in writes:
                self.cpu.release(w.key)

    def _discard(self, item: _Item) -> None:
        if isinstance(item, ChunkWrite):
            self.cpu.release(item.key)
