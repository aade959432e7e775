"""The read path: serve chunks from the fastest tier, promoting lower-tier hits into CPU.

ONE promotion path for every lower tier: reserve a CPU slot, read the chunk
straight into it (``get_many_into``, one batched call per tier), commit it, then
queue it by write-behind for the faster lower tiers that lack it (a remote hit
also goes to disk). Chunks a tier misses are asked of the next tier; a chunk no
tier returns aborts its slot (no stale existence). When no CPU slot can be freed
(every slot referenced, leased, or the parent of a resident chunk), or another
thread holds the key's reservation, the chunk is read into a private buffer and
served unpromoted (an allocation, only on that rare path).

Prefetch runs the same path on a background thread for a prompt's chunks that
some lower tier holds.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import numpy as np

from kvtier.storage.batch_worker import BatchWorker
from kvtier.storage.handles import CpuReadHandle, acquire_handle
from kvtier.storage.lookup import contains_many_safe, held_prefix
from kvtier.storage.types import WriteSkip
from kvtier.storage.write_behind import WriteBehind
from kvtier.tiers.base import LowerTier
from kvtier.tiers.cpu import CpuTier

log = logging.getLogger(__name__)

ReadItem = tuple[bytes, "bytes | None"]


class Promoter:
    """Reads for one storage manager: CPU hits, and promotion from the lower tiers.

    Args:
        cpu: the CPU tier.
        lower: the lower tiers, fastest first.
        write_behind: where promoted chunks are queued for faster lower tiers.
        chunk_bytes: payload bytes of one chunk.
        prefetch_queue: prompts that may wait for prefetch; more are dropped (counted).

    Counters (monotonic, per lower tier in ``lower`` order): ``promoted[i]``
    chunks promoted from tier ``i``, ``failures[i]`` chunks asked of tier ``i``
    that it did not return (absent, corrupt, timeout).
    """

    def __init__(
        self,
        cpu: CpuTier,
        lower: Sequence[LowerTier],
        write_behind: WriteBehind,
        chunk_bytes: int,
        prefetch_queue: int = 64,
    ):
        self.cpu = cpu
        self.lower = list(lower)
        self.write_behind = write_behind
        self.chunk_bytes = chunk_bytes
        self.promoted = [0] * len(self.lower)
        self.failures = [0] * len(self.lower)
        self.unpromoted = 0
        self.prefetch_queued = 0
        self.prefetch_promoted = 0
        self.prefetch_dropped = 0
        self._prefetch_queue = prefetch_queue
        self._prefetcher: BatchWorker[list[ReadItem]] | None = None
        self._lock = threading.Lock()
        self._closed = False

    # -- reads -----------------------------------------------------------------------
    def open_read_many(self, items: Sequence[ReadItem]) -> list[CpuReadHandle | None]:
        """A handle per ``(key, parent)`` (None on a miss), in order; see the module doc.

        Time: CPU hits are dictionary look-ups; otherwise at most one batched
        ``get_many_into`` per lower tier (each bounded by that tier's timeout).
        """
        out: list[CpuReadHandle | None] = [None] * len(items)
        # i -> (destination, reserved CPU slot?)
        dsts: dict[int, tuple[np.ndarray, bool]] = {}
        for i, (key, parent) in enumerate(items):
            handle = acquire_handle(self.cpu, key)
            if handle is not None:
                out[i] = handle
            elif self.lower:
                slot = self.cpu.try_reserve(key, parent)
                if isinstance(slot, np.ndarray):
                    dsts[i] = (slot, True)
                elif slot is WriteSkip.PRESENT and (handle := acquire_handle(self.cpu, key)) is not None:
                    out[i] = handle  # committed by another thread since
                else:  # IN_FLIGHT (another thread's reservation), NO_ROOM, or evicted meanwhile
                    dsts[i] = (np.empty(self.chunk_bytes, dtype=np.uint8), False)
        if not dsts:
            return out
        source: dict[int, int] = {}
        remaining = list(dsts)
        for t, tier in enumerate(self.lower):
            if not remaining:
                break
            ask = remaining
            if tier.local:  # a local index says which exist: read only those
                ask = [i for i, ok in zip(ask, contains_many_safe(tier, [items[i][0] for i in ask])) if ok]
            if not ask:
                continue
            got = self._get_many(tier, [(items[i][0], dsts[i][0]) for i in ask])
            hit = [i for i, ok in zip(ask, got) if ok]
            for i in hit:
                source[i] = t
            with self._lock:
                self.failures[t] += len(ask) - len(hit)
            if hit:
                done = set(hit)
                remaining = [i for i in remaining if i not in done]
        for i, (dst, reserved) in dsts.items():
            key, parent = items[i]
            t = source.get(i, -1)
            if t < 0:
                if reserved:
                    self.cpu.abort(key)
                continue
            kind = self.lower[t].kind
            if not reserved:
                out[i] = CpuReadHandle(None, key, dst, kind)
                with self._lock:
                    self.unpromoted += 1
                continue
            parent = self.cpu.commit(key, parent)  # the parent kept (none that closes a cycle)
            with self._lock:
                self.promoted[t] += 1
            self.write_behind.submit(key, parent, upto=t)
            out[i] = acquire_handle(self.cpu, key, kind)
        return out

    @staticmethod
    def _get_many(tier: LowerTier, pairs: list[tuple[bytes, np.ndarray]]) -> list[bool]:
        try:
            got = tier.get_many_into(pairs)
        except Exception:  # defensive: a failing tier is a miss
            log.exception("kvtier: %s read failed", tier.name)
            return [False] * len(pairs)
        if len(got) != len(pairs):  # pragma: no cover - a broken plug-in
            return [False] * len(pairs)
        return [bool(x) for x in got]

    # -- prefetch --------------------------------------------------------------------
    def prefetch(self, job: list[ReadItem]) -> bool:
        """Queue promotion of ``job`` (a prompt's ``(key, parent)`` pairs not in CPU, in
        order); False (counted) if the queue is full or closed. Never blocks on I/O."""
        with self._lock:
            if self._closed:
                return False
            if self._prefetcher is None:
                self._prefetcher = BatchWorker("kvtier-prefetch", self._prefetch_batch, self._prefetch_queue, 1)
            prefetcher = self._prefetcher
        ok = prefetcher.submit(job)
        with self._lock:
            if ok:
                self.prefetch_queued += len(job)
            else:
                self.prefetch_dropped += len(job)
        return ok

    def _prefetch_batch(self, jobs: list[list[ReadItem]]) -> None:
        """Prefetch thread: promote the leading run of each job that some lower tier holds."""
        for job in jobs:
            todo = [item for item in job if not self.cpu.contains(item[0])]
            run = len(held_prefix([k for k, _ in todo], self.lower))
            promoted = 0
            for handle in self.open_read_many(todo[:run]):
                if handle is not None:
                    promoted += handle.source != "cpu"
                    handle.close()
            with self._lock:
                self.prefetch_promoted += promoted

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for queued prefetches; False on timeout."""
        with self._lock:
            prefetcher = self._prefetcher
        return prefetcher.flush(timeout_s) if prefetcher is not None else True

    def close(self) -> None:
        """Drop queued prefetches and stop the thread (idempotent)."""
        with self._lock:
            self._closed = True
            prefetcher, self._prefetcher = self._prefetcher, None
        if prefetcher is not None:
            prefetcher.close(drain=False)
