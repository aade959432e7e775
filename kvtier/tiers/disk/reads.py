"""The disk tier's read path: records read on the I/O threads straight into the caller's buffers, verified."""

from __future__ import annotations

import errno
import logging
from typing import Sequence

from kvtier.serde.base import Buffer
from kvtier.serde.record import KeepRecord, RecordError, record_relpath
from kvtier.tiers.base import destination_views
from kvtier.tiers.disk.core import DiskCore

log = logging.getLogger("kvtier.tiers.disk")

#: Consecutive failed reads (I/O errors, not corruption) after which a chunk is forgotten.
MAX_READ_ERRORS = 3

_HIT, _MISS, _CORRUPT = 0, 1, 2  # outcome of one chunk read


class DiskReads(DiskCore):
    """``get_many_into`` of :class:`~kvtier.tiers.disk.tier.DiskTier` (a checksum verified on every read)."""

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        """Read each ``(key, out)``, up to ``io_threads`` at once, straight into ``out`` (no extra copy).

        Every payload is checksummed as it is read. A record that fails validation is
        a miss for that chunk only, logged and deleted; one whose payload length
        differs from ``len(out)`` is a miss but kept. Every read has finished when
        this returns (no write into any ``out`` afterwards).

        Raises:
            TypeError/ValueError: a bad key, or ``out`` read-only or not contiguous.
        """
        views = destination_views(items)
        out = [False] * len(items)
        if self._closed:
            self.counters.add(skipped_calls=1, gets=len(items), get_misses=len(items))
            return out
        jobs = [(key, views[i]) for i, (key, _) in enumerate(items)]
        nbytes = corrupt = 0
        for i, status in enumerate(self._pool.ordered(self._get, jobs)):
            if status == _HIT:
                out[i] = True
                nbytes += len(views[i])
            elif status == _CORRUPT:
                corrupt += 1
        hits = sum(out)
        self.counters.add(
            gets=len(items), get_hits=hits, get_corrupt=corrupt,
            get_misses=max(0, len(items) - hits - corrupt), bytes_read=nbytes,
        )
        return out

    def _get(self, job: tuple[bytes, memoryview]) -> int:
        """I/O thread: read one chunk; ``_HIT``, ``_MISS`` or ``_CORRUPT``."""
        key, dst = job
        reading = self._index.reading
        with self._lock:
            if key not in self._index:
                return _MISS
            reading[key] = reading.get(key, 0) + 1
        try:
            status = self._read(key, dst)
        finally:
            with self._lock:
                n = reading[key] - 1
                if n:
                    reading[key] = n
                else:
                    del reading[key]
        if status == _HIT:
            with self._lock:
                if key in self._index:
                    self._index.policy.touch(key)
        return status

    def _read(self, key: bytes, dst: memoryview) -> int:
        path = self._root + record_relpath(key)
        try:
            try:
                self._io.read(path, key, dst, self.direct_io)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct_io:
                    raise
                self._disable_direct_io(exc)
                self._io.read(path, key, dst, False)
        except KeepRecord as exc:
            log.warning("kvtier disk tier: chunk %s is a miss: %s", key.hex()[:16], exc)
            return _MISS
        except (RecordError, FileNotFoundError) as exc:
            reason = "file missing" if isinstance(exc, FileNotFoundError) else str(exc)
            log.warning("kvtier disk tier: chunk %s is a miss: %s; removing it", key.hex()[:16], reason)
            with self._lock:
                self.corrupt_reads += 1
                self._forget_locked(key)
            return _CORRUPT
        except OSError as exc:
            with self._lock:
                self.read_errors += 1
                fails = self._read_failures.get(key, 0) + 1
                self._read_failures[key] = fails
                if fails >= MAX_READ_ERRORS:
                    self._forget_locked(key)
            self.counters.add(errors=1)
            log.warning(
                "kvtier disk tier: read of chunk %s failed (%s); a miss%s",
                key.hex()[:16], exc, "; forgetting it" if fails >= MAX_READ_ERRORS else "",
            )
            return _MISS
        if self._read_failures:
            with self._lock:
                self._read_failures.pop(key, None)
        return _HIT
