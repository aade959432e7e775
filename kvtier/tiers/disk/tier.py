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
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from kvtier.serde.base import Buffer, Codec
from kvtier.serde.record import (
    HEADER_BYTES,
    KeepRecord,
    RecordError,
    align_up,
    encode_header,
    encode_payload_header,
    record_relpath,
)
from kvtier.tiers.base import (
    ChangeHook,
    ChunkWrite,
    LowerTier,
    TierCounters,
    as_chunk_write,
    check_key,
    writable_view,
)
from kvtier.tiers.disk.fileops import DIR_MODE, FileOps
from kvtier.tiers.disk.index import ChunkIndex
from kvtier.tiers.disk.parallel import DEFAULT_IO_THREADS, IOPool
from kvtier.tiers.disk.record_io import RecordIO, payload_view, unlink_quietly
from kvtier.tiers.disk.scan import STOP_WRITES, TMP_SUFFIX, scan, take_ownership
from kvtier.tiers.policies import EvictionPolicy, LRUPolicy

log = logging.getLogger("kvtier.tiers.disk")

#: Consecutive failed reads (I/O errors, not corruption) after which a chunk is forgotten.
MAX_READ_ERRORS = 3

_HIT, _MISS, _CORRUPT = 0, 1, 2  # outcome of one chunk read


@dataclass(frozen=True)
class _Write:
    """One planned record write: batch position, chunk, reserved file bytes, ``.tmp`` and final paths."""

    index: int
    key: bytes
    parent: bytes | None
    data: memoryview
    size: int
    direct: bool
    tmp: str
    final: str


class DiskTier(LowerTier):
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

    def __init__(
        self,
        path: str | os.PathLike,
        capacity_bytes: int,
        namespace: bytes,
        policy: EvictionPolicy | None = None,
        is_pinned: Callable[[bytes], bool] = lambda key: False,
        fsync: bool = False,
        direct_io: bool = False,
        fs: FileOps | None = None,
        io_threads: int = DEFAULT_IO_THREADS,
    ):
        if len(namespace) != 32:
            raise ValueError(f"namespace digests are 32 bytes, got {len(namespace)}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self._pool = IOPool(io_threads)
        self.path = Path(path)
        self._root = str(self.path) + os.sep  # record paths are built as strings on the I/O path
        self.namespace = bytes(namespace)
        self._io = RecordIO(fs or FileOps(), self.namespace, fsync)
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


    @property
    def location(self) -> str:
        """The tier's directory."""
        return str(self.path)
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

    def put_many_with_codec(self, items: Sequence[ChunkWrite], codec: Codec) -> list[bool]:
        """Rewrite chunks with ``codec``: the disk record format stores raw payloads only.

        Raises:
            NotImplementedError: ``codec`` is not ``raw`` (the disk tier reads raw records only).
        """
        if codec.name != "raw":
            raise NotImplementedError(
                f"the disk tier stores raw records only; codec {codec.name!r} is unsupported there"
            )
        return self.put_many(items)

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
        )
        return out

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

    # -- LowerTier: writes ---------------------------------------------------------------
    def put_many(self, items: Sequence[ChunkWrite]) -> list[bool]:
        """Write the chunks, up to ``io_threads`` files in flight; True where a chunk is on disk afterwards.

        Three steps: reserve room for every chunk in batch order (under the lock); write
        each record to its ``.tmp`` file on the I/O threads (checksum, ``pwritev``,
        optional fsync, close); then, in batch order on the caller's thread, rename each
        complete file into place and index it. So records are published parent before
        child, exactly as one-at-a-time writes did, and a kill at any point leaves only
        complete records under final names (plus ``.tmp`` leftovers, dropped at open).

        A key already on disk is rewritten (its recorded parent is kept). A chunk
        whose parent failed earlier in the same batch is not published (it could not
        be hit); one whose parent is simply absent is (out-of-order write-behind).
        A key given twice in one batch is written once.

        Raises:
            TypeError/ValueError: a bad key or parent, or a payload that is empty or
                not C-contiguous (before any write).
        """
        items = [as_chunk_write(it) for it in items]
        views = [payload_view(it.payload) for it in items]
        out = [False] * len(items)
        if self._closed or not self._writable:
            self.counters.add(puts=len(items), put_failed=len(items), skipped_calls=1)
            return out
        failed: set[bytes] = set()
        first: dict[bytes, int] = {}
        plans: list[_Write] = []
        for i, it in enumerate(items):
            if it.key in first:
                continue
            first[it.key] = i
            # a chunk whose parent failed in this batch could not be hit: skip it
            pending = it.parent is not None and it.parent in first
            w = None if it.parent in failed else self._reserve(i, it.key, views[i], it.parent, pending)
            if w is None:
                failed.add(it.key)
            else:
                plans.append(w)
        written = 0
        for w, (size, exc) in zip(plans, self._pool.ordered(self._write_file, plans)):
            n = self._publish(w, size, exc, w.parent in failed)
            if n:
                out[w.index] = True
                written += n
            else:
                failed.add(w.key)
        for i, it in enumerate(items):  # duplicates share the first write's outcome
            out[i] = out[first[it.key]]
        ok = sum(out)
        self.counters.add(puts=len(items), put_ok=ok, put_failed=len(items) - ok, bytes_written=written)
        return out

    def _reserve(
        self, index: int, key: bytes, data: memoryview, parent: bytes | None, parent_pending: bool
    ) -> "_Write | None":
        """Reserve room for one record (None: not written, no room or not writable).

        ``parent_pending``: the parent is planned earlier in this batch (published first)."""
        if not self._writable or self._closed:
            return None
        direct = self.direct_io
        size = HEADER_BYTES + (align_up(len(data)) if direct else len(data))
        with self._lock:
            if not self._index.reserve(key, size, parent, parent_pending):
                self.dropped_writes += 1
                return None
        final = self.file_of(key)
        tmp = str(final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"))
        return _Write(index, key, parent, data, size, direct, tmp, str(final))

    def _write_file(self, w: "_Write") -> tuple[int, OSError | None]:
        """I/O thread: write ``w``'s complete record to its ``.tmp`` file; (file bytes, None) or (0, error)."""
        try:
            if w.direct and self.direct_io:
                header = encode_payload_header(w.key, self.namespace, w.data, w.parent, stored_len=w.size - HEADER_BYTES)
                try:
                    return self._io.write_record(w.tmp, w.final, header, w.data, True), None
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    unlink_quietly(self.fs, w.tmp)
                    self._disable_direct_io(exc)
            n = len(w.data)

            def header(body_sum: bytes) -> bytes:
                return encode_header(key=w.key, namespace=self.namespace, parent=w.parent, payload_len=n,
                                     body_len=n, body_sum=body_sum)

            return self._io.write_record_hashed(w.tmp, w.final, header, w.data), None
        except OSError as exc:
            unlink_quietly(self.fs, w.tmp)
            return 0, exc

    def _publish(self, w: "_Write", size: int, exc: OSError | None, parent_failed: bool) -> int:
        """Caller's thread, batch order: rename ``w``'s file into place and index it; its file bytes (0: not)."""
        if parent_failed or not self._writable or self._closed:
            # It could not be hit, or writes stopped meanwhile (an earlier chunk of the batch hit
            # ENOSPC: one-at-a-time writes would not have tried this one, so neither is it counted).
            unlink_quietly(self.fs, w.tmp)
            with self._lock:
                self._index.unreserve(w.key)
            return 0
        if exc is None:
            try:
                self._io.publish(w.tmp, w.final)
            except OSError as e:
                unlink_quietly(self.fs, w.tmp)
                exc = e
        if exc is not None:
            with self._lock:
                self._index.unreserve(w.key)
                self.failed_writes += 1
            self.counters.add(errors=1)
            if exc.errno in STOP_WRITES:
                self._stop_writes(exc)
            else:
                log.warning("kvtier disk tier: write of chunk %s failed: %s", w.key.hex()[:16], exc)
            return 0
        with self._lock:
            self._index.commit(w.key, size, w.parent)
            self.written_chunks += 1
        return size

    def _stop_writes(self, exc: OSError) -> None:
        with self._lock:
            was, self._writable = self._writable, False
        if was:
            log.error("kvtier disk tier %s stops accepting writes (%s); reads continue", self.path, exc)

    # -- LowerTier: reads ----------------------------------------------------------------
    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        """Read each ``(key, out)``, up to ``io_threads`` at once, straight into ``out`` (no extra copy).

        Every payload is checksummed as it is read. A record that fails validation is
        a miss for that chunk only, logged and deleted; one whose payload length
        differs from ``len(out)`` is a miss but kept. Every read has finished when
        this returns (no write into any ``out`` afterwards).

        Raises:
            TypeError/ValueError: a bad key, or ``out`` read-only or not contiguous.
        """
        views = []
        for k, buf in items:
            check_key(k)
            views.append(writable_view(buf))
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

    # -- LowerTier: removal and lifecycle ----------------------------------------------------
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


