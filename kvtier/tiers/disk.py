"""Local disk tier: one self-describing file per chunk, written behind the CPU tier.

File format (little-endian), ``HEADER_BYTES`` of header then the payload::

    magic      8s   b"KVTIER\\x00\\x01"
    version    H    FORMAT_VERSION
    header_len H    HEADER_BYTES
    codec      16s  payload codec name, NUL padded ("raw")
    payload    Q    payload length in bytes
    checksum   8s   xxh3-64 of the payload
    key        32s  chunk key
    namespace  32s  KeyNamespace digest (layout, model, chunk size, rank)
    created    d    unix time (seconds) of the write
    hdr_sum    8s   xxh3-64 of every header byte before it
    (zero padding to HEADER_BYTES; 4096 keeps the payload page-aligned)

Invariants:
- Files are written to a ``.tmp`` name in the same directory and renamed into
  place, so a reader never sees a partly written chunk under its final name;
  leftovers from a killed writer are deleted when the tier opens.
- A file whose header, key, namespace, codec or checksum does not match is a
  miss (logged and deleted), never KV.
- The index (key -> payload bytes) is rebuilt from file names at open: a new
  process on the same directory serves every complete chunk (restart reuse).
- One process owns a directory at a time (``flock`` on ``.lock``); a second
  owner gets :class:`DiskTierLocked` naming the holder.
- Bytes on disk never exceed ``capacity_bytes``: a write first evicts in policy
  order, skipping pinned (leased) keys.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import queue
import struct
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import xxhash

from kvtier.tiers.policies import EvictionPolicy, LRUPolicy

log = logging.getLogger(__name__)

MAGIC = b"KVTIER\x00\x01"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
_HDR = struct.Struct("<8sHH16sQ8s32s32sd")
_HDR_SUM = struct.Struct("<8s")
SUFFIX = ".kv"


class DiskTierLocked(RuntimeError):
    """Another process owns the disk tier directory."""


def _checksum(data: memoryview | np.ndarray) -> bytes:
    return xxhash.xxh3_64_digest(data)


def encode_header(key: bytes, namespace: bytes, payload: memoryview | np.ndarray, codec: str = "raw") -> bytes:
    body = _HDR.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        codec.encode().ljust(16, b"\x00"),
        len(memoryview(payload).cast("B")),
        _checksum(payload),
        key,
        namespace,
        time.time(),
    )
    body += _checksum(body)
    return body.ljust(HEADER_BYTES, b"\x00")


class DiskTier:
    """Bounded directory of chunk files with write-behind.

    Args:
        path: directory (created if missing).
        capacity_bytes: bound on payload + header bytes on disk.
        namespace: digest of the key namespace; files of another namespace are misses.
        policy: eviction order (default LRU; initial order by file mtime).
        is_pinned: keys that must not be evicted (leases).
        write_queue: max chunks waiting for write-behind; more are dropped and counted.
        fsync: fsync each file before the rename (survives power loss, slower).

    Raises:
        DiskTierLocked: another live process owns ``path``.
        OSError: ``path`` cannot be created or opened.
    """

    name = "disk"

    def __init__(
        self,
        path: str | os.PathLike,
        capacity_bytes: int,
        namespace: bytes,
        policy: EvictionPolicy | None = None,
        is_pinned: Callable[[bytes], bool] = lambda key: False,
        write_queue: int = 256,
        fsync: bool = False,
    ):
        self.path = Path(path)
        self.capacity_bytes = int(capacity_bytes)
        self.namespace = namespace
        self.policy = policy or LRUPolicy()
        self._is_pinned = is_pinned
        self.fsync = fsync
        self._lock = threading.Lock()
        self._index: dict[bytes, int] = {}  # key -> file bytes
        self._inflight: set[bytes] = set()
        self._leased_reads: dict[bytes, int] = {}
        self.used_bytes = 0
        self.writable = True
        self.evicted_chunks = 0
        self.evicted_bytes = 0
        self.dropped_writes = 0
        self.failed_writes = 0
        self.corrupt_reads = 0
        self.written_chunks = 0
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._take_ownership()
        t0 = time.perf_counter()
        self._scan()
        self.index_load_s = time.perf_counter() - t0
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, write_queue))
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="kvtier-disk-writer", daemon=True)
        self._writer.start()

    # -- ownership and index -------------------------------------------------
    def _take_ownership(self) -> int:
        lock_path = self.path / ".lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise DiskTierLocked(
                f"disk tier directory {self.path} is owned by another process (pid {holder}); "
                "point this process at another directory or stop the other one"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _file(self, key: bytes) -> Path:
        h = key.hex()
        return self.path / h[:2] / (h + SUFFIX)

    def _scan(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        for sub in os.scandir(self.path):
            if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                continue
            for ent in os.scandir(sub.path):
                name = ent.name
                if name.endswith(".tmp"):
                    # A write killed before its rename: never complete, remove it.
                    try:
                        os.unlink(ent.path)
                    except OSError:
                        pass
                    continue
                if not name.endswith(SUFFIX) or len(name) != 64 + len(SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(name[:64])
                    st = ent.stat(follow_symlinks=False)
                except (ValueError, OSError):
                    continue
                if st.st_size <= HEADER_BYTES:
                    os.unlink(ent.path)
                    continue
                found.append((st.st_mtime, key, st.st_size))
        found.sort()
        for _, key, size in found:
            self._index[key] = size
            self.policy.insert(key)
            self.used_bytes += size

    # -- queries -------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def touch(self, key: bytes) -> None:
        with self._lock:
            if key in self._index:
                self.policy.touch(key)

    @property
    def pending_writes(self) -> int:
        return self._queue.qsize() + len(self._inflight)

    # -- write path ------------------------------------------------------------
    def put_async(self, key: bytes, payload: np.ndarray, on_done: Callable[[], None]) -> bool:
        """Queue ``payload`` to be written under ``key``.

        The caller keeps ``payload`` valid until ``on_done`` runs (it runs exactly
        once, also when the write is skipped or fails). Returns False (and calls
        ``on_done`` at once) if the queue is full, the tier is read-only or the
        key is already on disk.
        """
        if not self.writable or self._closed or key in self._index:
            on_done()
            return False
        try:
            self._queue.put_nowait((key, payload, on_done))
        except queue.Full:
            self.dropped_writes += 1
            on_done()
            return False
        return True

    def put(self, key: bytes, payload: np.ndarray) -> bool:
        """Write ``payload`` synchronously. Returns True if the chunk is on disk afterwards."""
        if key in self._index:
            return True
        if not self.writable:
            return False
        return self._write(key, payload)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            key, payload, on_done = item
            try:
                with self._lock:
                    self._inflight.add(key)
                if self.writable and key not in self._index:
                    self._write(key, payload)
            except Exception:  # the writer thread must never die
                log.exception("kvtier disk tier: write of chunk %s failed", key.hex()[:16])
            finally:
                with self._lock:
                    self._inflight.discard(key)
                try:
                    on_done()
                finally:
                    self._queue.task_done()

    def _write(self, key: bytes, payload: np.ndarray) -> bool:
        data = memoryview(payload).cast("B")
        size = HEADER_BYTES + len(data)
        if size > self.capacity_bytes:
            return False
        with self._lock:
            if not self._make_room_locked(size):
                self.dropped_writes += 1
                return False
            self.used_bytes += size  # reserve before the slow part
        final = self._file(key)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            final.parent.mkdir(exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                header = encode_header(key, self.namespace, data)
                _write_all(fd, header)
                _write_all(fd, data)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except OSError as exc:
            with self._lock:
                self.used_bytes -= size
            self.failed_writes += 1
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if exc.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EPERM):
                if self.writable:
                    log.error(
                        "kvtier disk tier %s stops accepting writes (%s); reads continue",
                        self.path,
                        exc,
                    )
                self.writable = False
            else:
                log.warning("kvtier disk tier: write failed: %s", exc)
            return False
        with self._lock:
            self._index[key] = size
            self.policy.insert(key)
            self.written_chunks += 1
        return True

    def _make_room_locked(self, size: int) -> bool:
        while self.used_bytes + size > self.capacity_bytes:
            victim = None
            for key in self.policy.candidates():
                if not self._is_pinned(key) and not self._leased_reads.get(key):
                    victim = key
                    break
            if victim is None:
                return False
            self.evicted_bytes += self._remove_locked(victim)
            self.evicted_chunks += 1
        return True

    def _remove_locked(self, key: bytes) -> int:
        """Forget ``key`` and delete its file; returns the bytes freed."""
        size = self._index.pop(key, 0)
        self.policy.remove(key)
        self.used_bytes -= size
        try:
            os.unlink(self._file(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("kvtier disk tier: cannot remove %s: %s", key.hex()[:16], exc)
        return size

    # -- read path -------------------------------------------------------------
    def get_into(self, key: bytes, out: np.ndarray) -> bool:
        """Read the chunk ``key`` into ``out`` (a writable uint8 buffer of the payload size).

        Returns False on a miss, or on a file that fails validation (which is then
        deleted and logged). Never raises for I/O or format errors.
        """
        with self._lock:
            if key not in self._index:
                return False
            self._leased_reads[key] = self._leased_reads.get(key, 0) + 1
        try:
            ok = self._read(key, out)
        finally:
            with self._lock:
                n = self._leased_reads[key] - 1
                if n:
                    self._leased_reads[key] = n
                else:
                    del self._leased_reads[key]
        if ok:
            self.touch(key)
        return ok

    def _read(self, key: bytes, out: np.ndarray) -> bool:
        path = self._file(key)
        dst = memoryview(out).cast("B")
        try:
            with open(path, "rb", buffering=0) as f:
                header = f.read(HEADER_BYTES)
                reason = self._check_header(header, key, len(dst))
                if reason is None:
                    n = f.readinto(dst)
                    if n != len(dst) or f.read(1):
                        reason = "payload length mismatch"
                    elif _checksum(dst) != _HDR.unpack_from(header)[5]:
                        reason = "payload checksum mismatch"
        except FileNotFoundError:
            reason = "file missing"
        except OSError as exc:
            log.warning("kvtier disk tier: read of %s failed: %s", key.hex()[:16], exc)
            return False
        if reason is None:
            return True
        self.corrupt_reads += 1
        log.warning("kvtier disk tier: chunk %s is a miss: %s; removing it", key.hex()[:16], reason)
        with self._lock:
            self._remove_locked(key)
        return False

    def _check_header(self, header: bytes, key: bytes, payload_len: int) -> str | None:
        if len(header) < _HDR.size + _HDR_SUM.size:
            return "truncated header"
        fields = _HDR.unpack_from(header)
        if fields[0] != MAGIC:
            return "bad magic"
        if _checksum(header[: _HDR.size]) != header[_HDR.size : _HDR.size + 8]:
            return "header checksum mismatch"
        if fields[1] != FORMAT_VERSION or fields[2] != HEADER_BYTES:
            return f"unsupported format version {fields[1]}"
        codec = fields[3].rstrip(b"\x00")
        if codec != b"raw":
            return f"unknown codec {codec!r}"
        if fields[4] != payload_len:
            return f"payload size {fields[4]} != expected {payload_len}"
        if fields[6] != key:
            return "key mismatch"
        if fields[7] != self.namespace:
            return "namespace (model/layout) mismatch"
        return None

    # -- removal and lifecycle -----------------------------------------------------
    def delete(self, key: bytes) -> bool:
        with self._lock:
            if key not in self._index or self._leased_reads.get(key):
                return False
            self._remove_locked(key)
            return True

    def clear(self) -> int:
        """Remove every chunk not being read; returns how many were removed."""
        with self._lock:
            victims = [k for k in self._index if not self._leased_reads.get(k)]
            for k in victims:
                self._remove_locked(k)
            return len(victims)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued writes are on disk; False if ``timeout_s`` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued writes (up to ``timeout_s``), stop the writer, release the directory."""
        if self._closed:
            return
        self.flush(timeout_s)
        self._closed = True
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._writer.join(timeout=timeout_s)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            os.close(self._lock_fd)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
