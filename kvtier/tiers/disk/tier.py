"""Local disk tier: one chunk record (:mod:`kvtier.serde.record`) per file, a :class:`LowerTier`.

Layout: ``<path>/<2 hex>/<key hex>.kvc`` (directories 0700, files 0600), plus
``<path>/.lock``. Writes are synchronous (``put_many``); write-behind is the
storage manager's job. Within one batch up to ``io_threads`` chunk files are read
or written at once (:mod:`.parallel`); renames stay in batch order.

Invariants:
- Files are written to a ``.tmp`` name in the same directory and renamed into
  place, so a reader never sees a partly written chunk under its final name;
  leftovers of a killed writer are deleted when the tier opens. After SIGKILL
  (no power loss) every renamed file is complete: the page cache outlives the
  process. ``fsync=True`` extends that to power loss.
- A file is served only if its record checks out (header checksum, magic,
  version, key, namespace, zero header padding, file size, body checksum);
  anything else is a miss, logged, and the file is deleted. Never KV.
- The index (:class:`~kvtier.tiers.disk.index.ChunkIndex`) is rebuilt from the
  record headers at open: a new process on the same directory serves every
  complete chunk (restart reuse), knows each chunk's parent and so evicts
  leaf-first (prefix closure, stated in the index module) also after a
  restart; records of the previous format, of another namespace and orphans are
  dropped with one log line.
- One process owns a directory at a time (``flock`` on ``.lock``); a second
  owner gets :class:`DiskTierLocked` naming the holder's pid.
- Bytes on disk (headers and padding included) never exceed ``capacity_bytes``:
  a write first evicts leaves in policy order, skipping pinned (leased) keys and
  keys being read; an over-full directory (smaller capacity than last run) is
  trimmed at open.
- A write failing with ENOSPC/EDQUOT/EROFS/EACCES/EPERM makes the tier stop
  accepting writes (logged once); reads go on. Other write errors fail that
  write only. A read error is a miss; a chunk that fails
  ``MAX_READ_ERRORS`` reads in a row is forgotten (with its descendants).

All file-system calls go through a :class:`FileOps` object, the
fault-injection seam used by the tests (ENOSPC, EROFS, EIO).

The class is assembled from one module per concern: fields, introspection and
shared helpers (:mod:`.core`), the write path (:mod:`.writes`), the read path
(:mod:`.reads`); this module adds opening, queries, removal and closing.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from kvtier.tiers.base import LowerTier, TierCounters, check_key
from kvtier.tiers.disk.fileops import DIR_MODE, FileOps
from kvtier.tiers.disk.index import ChunkIndex
from kvtier.tiers.disk.parallel import DEFAULT_IO_THREADS, IOPool
from kvtier.tiers.disk.reads import MAX_READ_ERRORS, DiskReads
from kvtier.tiers.disk.record_io import RecordIO
from kvtier.tiers.disk.scan import scan, take_ownership
from kvtier.tiers.disk.writes import DiskWrites
from kvtier.tiers.policies import EvictionPolicy, LRUPolicy

log = logging.getLogger("kvtier.tiers.disk")

__all__ = ["MAX_READ_ERRORS", "DiskTier"]


class DiskTier(DiskReads, DiskWrites, LowerTier):
    """Bounded directory of chunk records on a local disk.

    Args:
        path: directory (created 0700 if missing).
        capacity_bytes: bound on file bytes on disk (headers and padding included).
        namespace: 32-byte namespace digest; records of another namespace are misses.
        policy: eviction order (default LRU; initial order by file mtime; chain-aware).
        is_pinned: keys that must not be evicted (leases).
        fsync: fsync each file before the rename (survives power loss, slower).
        direct_io: read and write payloads with O_DIRECT (bypassing the page cache)
            through page-aligned buffers; files are padded to ``ALIGN`` bytes. Falls
            back to buffered I/O, with one log line, where the file system refuses
            O_DIRECT (EINVAL, e.g. tmpfs).
        fs: file-system calls (the fault-injection seam); default :class:`FileOps`.
        io_threads: chunk reads/writes of one batch in flight at once (threads that
            release the GIL around ``preadv``/``pwritev``); 1 = one at a time, inline.
        verify_reads: verify each payload's xxh3-64 on every read (default). False skips
            that hash only (LMCache's trade-off, for operators who accept it: a record
            whose payload bytes rotted on disk is served); the header checksum, key,
            namespace and sizes are still checked, and writes still store the checksum,
            so a tier reopened with verification on checks every record.

    Raises:
        DiskTierLocked: another live process owns ``path``.
        OSError: ``path`` cannot be created or listed.
        ValueError: ``namespace`` is not 32 bytes, ``capacity_bytes`` is negative or
            ``io_threads`` < 1.

    Counters (monotonic): ``written_chunks``, ``evicted_chunks``, ``evicted_bytes``,
    ``dropped_writes`` (no room), ``failed_writes`` (I/O errors), ``corrupt_reads``
    (validation failures and vanished files), ``read_errors`` (I/O errors on read),
    plus :class:`TierCounters` in ``counters``. ``writable`` turns False after a
    disk-full/read-only error.
    """

    name = "disk"
    kind = "disk"
    local = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        namespace: bytes,
        policy: EvictionPolicy | None = None,
        is_pinned: Callable[[bytes], bool] = lambda key: False,
        fsync: bool = False,
        direct_io: bool = False,
        fs: FileOps | None = None,
        io_threads: int = DEFAULT_IO_THREADS,
        verify_reads: bool = True,
    ):
        if len(namespace) != 32:
            raise ValueError(f"namespace digests are 32 bytes, got {len(namespace)}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self._pool = IOPool(io_threads)
        self.path = Path(path)
        self._root = str(self.path) + os.sep  # record paths are built as strings on the I/O path
        self.namespace = bytes(namespace)
        self._io = RecordIO(fs or FileOps(), self.namespace, fsync, verify_reads)
        self.direct_io = False
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._index = ChunkIndex(int(capacity_bytes), policy or LRUPolicy(), is_pinned, self._unlink_record)
        self._read_failures: dict[bytes, int] = {}
        self._writable = True
        self._closed = False
        self.dropped_writes = 0
        self.failed_writes = 0
        self.corrupt_reads = 0
        self.read_errors = 0
        self.written_chunks = 0
        self.path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        self._lock_fd, read_only = take_ownership(self.path, self.fs)
        if read_only is not None:
            self._stop_writes(read_only)
        t0 = time.perf_counter()
        self._load()
        self.index_load_s = time.perf_counter() - t0
        if direct_io:
            self.direct_io = self._io.probe_direct_io(self.path)

    def _load(self) -> None:
        res = scan(self.path, self.namespace, self.fs, remove=True)
        if res.old_format or res.unusable or res.orphans:
            log.warning(
                "kvtier disk tier %s: dropped %d files of the previous format, %d unusable records "
                "(corrupt, truncated or another namespace) and %d orphans (parent not on disk) at open",
                self.path, res.old_format, res.unusable, res.orphans,
            )
        with self._lock:
            self._index.load(res.found)
            if self._index.used_bytes > self._index.capacity_bytes:
                n = self._index.evicted_chunks
                self._index.make_room(0)
                log.info(
                    "kvtier disk tier %s: evicted %d chunks at open to fit capacity %d B",
                    self.path, self._index.evicted_chunks - n, self._index.capacity_bytes,
                )
            self._index.check_invariants()

    # -- LowerTier: queries ------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        for k in keys:
            check_key(k)
        if self._closed:
            self.counters.add(skipped_calls=1)
            return [False] * len(keys)
        entries = self._index.entries
        out = [k in entries for k in keys]
        self.counters.add(contains_keys=len(keys), contains_hits=sum(out))
        return out

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """Mark a prompt's hit chunks as used, tail first (so the head is the most recent)."""
        if self._closed:
            return
        with self._lock:
            for key in reversed(keys):
                if key in self._index:
                    self._index.policy.touch(key)

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Remove ``keys`` (not those being read) and their resident descendants; returns how many
        of ``keys`` existed and were removed."""
        for k in keys:
            check_key(k)
        if self._closed:
            return 0
        n = removed = 0
        with self._lock:
            for key in keys:
                if key in self._index and not self._index.reading.get(key):
                    removed += self._index.remove(key)
                    n += 1
        self.counters.add(deletes=removed)
        return n

    def clear(self) -> int:
        """Remove every chunk not being read (the directory holds only this namespace); returns how many."""
        if self._closed:
            return 0
        with self._lock:
            busy = {k for k, n in self._index.reading.items() if n}
            for k in list(busy):  # keep the chains of chunks being read whole
                p = self.parent_of(k)
                while p is not None and p in self._index and p not in busy:
                    busy.add(p)
                    p = self.parent_of(p)
            removed = 0
            hook, self._index.on_change = self._index.on_change, None  # one change, not one per chunk
            try:
                gone = [k for k in self._index.entries if k not in busy]
                for key in gone:
                    removed += self._index.remove(key)  # no descendant of a non-busy chunk is busy
            finally:
                self._index.on_change = hook
            if hook is not None:
                if not self._index.entries:
                    hook("c", (), ())
                elif gone:
                    hook("r", gone, ())
        self.counters.add(deletes=removed)
        return removed

    def close(self) -> None:
        """Release the directory; idempotent. Later calls are misses / no-ops."""
        if self._closed:
            return
        self._closed = True
        self._pool.close()
        if self._lock_fd is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None
