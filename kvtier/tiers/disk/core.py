"""The disk tier's shared state: fields, introspection and the locked helpers reads and writes share.

:class:`DiskCore` holds no I/O path of its own; :class:`~kvtier.tiers.disk.tier.DiskTier`
sets every field below in its ``__init__`` and adds the write path
(:mod:`.writes`) and the read path (:mod:`.reads`) on top. ``_lock`` guards the
index, the read-failure counts, ``_writable``, ``direct_io`` and the counters
named in :class:`DiskTier`.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Iterator, Sequence

from kvtier.serde.record import record_relpath
from kvtier.tiers.base import ChangeHook, TierCounters
from kvtier.tiers.disk.fileops import FileOps
from kvtier.tiers.disk.index import ChunkIndex
from kvtier.tiers.disk.parallel import IOPool
from kvtier.tiers.disk.record_io import RecordIO
from kvtier.tiers.policies import EvictionPolicy

log = logging.getLogger("kvtier.tiers.disk")


class DiskCore:
    """Fields and shared helpers of a disk tier (see :class:`~kvtier.tiers.disk.tier.DiskTier`)."""

    path: Path
    namespace: bytes
    direct_io: bool
    counters: TierCounters
    dropped_writes: int
    failed_writes: int
    corrupt_reads: int
    read_errors: int
    written_chunks: int
    _pool: IOPool
    _root: str
    _io: RecordIO
    _lock: threading.Lock
    _index: ChunkIndex
    _read_failures: dict[bytes, int]
    _writable: bool
    _closed: bool
    _lock_fd: int | None

    @property
    def location(self) -> str:
        """The tier's directory."""
        return str(self.path)

    def _disable_direct_io(self, exc: OSError) -> None:
        with self._lock:
            was, self.direct_io = self.direct_io, False
        if was:
            log.warning("kvtier disk tier %s: O_DIRECT refused (%s); using buffered I/O", self.path, exc)

    # -- state -----------------------------------------------------------------------
    @property
    def writable(self) -> bool:
        return self._writable and not self._closed

    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes

    def set_capacity(self, capacity_bytes: int) -> bool:
        """Change the byte bound; a smaller one evicts leaves (policy order) down to it.

        Returns False while chunks that cannot be evicted now (pinned, being read or
        written) keep the tier above the new bound; writes then wait for room, and
        a later call (or eviction by writes) finishes the job.

        Raises:
            ValueError: ``capacity_bytes`` is negative.
        """
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        with self._lock:
            self._index.capacity_bytes = int(capacity_bytes)
            fits = self._index.make_room(0)
            self._index.check_invariants()
            return fits

    @property
    def used_bytes(self) -> int:
        """File bytes on disk plus bytes reserved by writes in flight."""
        return self._index.used_bytes

    @property
    def evicted_chunks(self) -> int:
        return self._index.evicted_chunks

    @property
    def evicted_bytes(self) -> int:
        return self._index.evicted_bytes

    @property
    def fsync(self) -> bool:
        return self._io.fsync

    @property
    def fs(self) -> FileOps:
        """The file-system seam every call goes through (tests may swap it)."""
        return self._io.fs

    @fs.setter
    def fs(self, fs: FileOps) -> None:
        self._io.fs = fs

    @property
    def policy(self) -> EvictionPolicy:
        return self._index.policy

    def __len__(self) -> int:
        return len(self._index)

    def parent_of(self, key: bytes) -> bytes | None:
        """The parent key recorded for resident ``key`` (None: a first chunk, or not resident)."""
        e = self._index.entries.get(key)
        return None if e is None else e.parent

    def file_of(self, key: bytes) -> Path:
        """Path of ``key``'s record file (whether or not it exists)."""
        return self.path / record_relpath(key)

    def set_change_hook(self, hook: ChangeHook | None) -> bool:
        """Report every chunk that becomes resident (``"s"``) or leaves (``"r"``: capacity
        eviction, delete, a corrupt record) and clears (``"c"`` when the tier is left empty)
        to ``hook``, under the tier's lock. Chunks indexed at open are not reported."""
        with self._lock:
            self._index.on_change = hook
        return True

    def scan_keys(self) -> Iterator[tuple[bytes, bytes | None]]:
        """``(key, parent)`` of every resident chunk (a copy of the index taken under the lock)."""
        with self._lock:
            items = [(k, e.parent) for k, e in self._index.entries.items()]
        return iter(items)

    def stored_sizes(self, keys: Sequence[bytes]) -> list[int]:
        """File bytes of each key's record (0 where absent), from the index."""
        entries = self._index.entries
        out = []
        for k in keys:
            e = entries.get(k)
            out.append(0 if e is None else e.size)
        return out

    def check_invariants(self) -> None:
        """Assert the index invariants (byte accounting, prefix closure); for tests and debugging."""
        with self._lock:
            self._index.check_invariants()
            check = getattr(self._index.policy, "check_invariants", None)
            if check is not None:
                check()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self.counters.snapshot()
        with self._lock:
            out.update(
                chunks=len(self._index), used_bytes=self._index.used_bytes,
                capacity_bytes=self._index.capacity_bytes, evicted_chunks=self._index.evicted_chunks,
                evicted_bytes=self._index.evicted_bytes,
            )
        out.update(
            written_chunks=self.written_chunks, dropped_writes=self.dropped_writes,
            failed_writes=self.failed_writes, corrupt_reads=self.corrupt_reads, read_errors=self.read_errors,
            writable=self.writable, direct_io=self.direct_io, io_threads=self._pool.threads,
            verify_reads=self._io.verify,
        )
        return out

    # -- helpers shared by reads, writes and removal ------------------------------------
    def _stop_writes(self, exc: OSError) -> None:
        with self._lock:
            was, self._writable = self._writable, False
        if was:
            log.error("kvtier disk tier %s stops accepting writes (%s); reads continue", self.path, exc)

    def _forget_locked(self, key: bytes) -> None:
        """Drop ``key`` and its resident descendants (they could not be hit without it)."""
        self._read_failures.pop(key, None)
        self._index.remove(key)

    def _unlink_record(self, key: bytes) -> None:
        self._read_failures.pop(key, None)
        try:
            self.fs.unlink(str(self.file_of(key)))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("kvtier disk tier: cannot remove %s: %s", key.hex()[:16], exc)
