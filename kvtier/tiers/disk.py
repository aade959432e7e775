"""Local disk tier: one self-describing file per chunk, written behind the CPU tier.

File format (little-endian), ``HEADER_BYTES`` of header then the payload::

    magic      8s   b"KVTIER\\x00\\x01"
    version    H    FORMAT_VERSION
    header_len H    HEADER_BYTES
    codec      16s  payload codec name, NUL padded ("raw")
    payload    Q    true payload length in bytes
    checksum   8s   xxh3-64 of the payload (the true length, not the padding)
    key        32s  chunk key
    namespace  32s  KeyNamespace digest (layout, model, chunk size, rank)
    created    d    unix time (seconds) of the write
    stored     Q    payload bytes in the file: ``payload``, or ``payload`` rounded
                    up to ``ALIGN`` with zeros when written with direct I/O
    hdr_sum    8s   xxh3-64 of every header byte before it
    (zero padding to HEADER_BYTES; 4096 keeps the payload page-aligned)

Invariants:
- Files are written to a ``.tmp`` name in the same directory and renamed into
  place, so a reader never sees a partly written chunk under its final name;
  leftovers of a killed writer are deleted when the tier opens. After SIGKILL
  (no power loss) every renamed file is complete: the page cache outlives the
  process. ``fsync=True`` extends that to power loss.
- A file is served only if its header checksum, magic, version, codec, key,
  namespace, zero header padding, file size (``HEADER_BYTES + stored``) and
  payload checksum all match; anything else is a miss, logged, and the file is
  deleted. Never KV.
- The index (key -> file bytes) is rebuilt from the directory at open (eviction
  order by file mtime): a new process on the same directory serves every
  complete chunk (restart reuse).
- One process owns a directory at a time (``flock`` on ``.lock``; the kernel
  drops it when the owner dies, also on SIGKILL); a second owner gets
  :class:`DiskTierLocked` naming the holder's pid.
- Bytes on disk (headers and padding included) never exceed ``capacity_bytes``:
  a write first evicts in policy order, skipping pinned (leased) keys and keys
  being read; an over-full directory (smaller capacity than last run) is
  trimmed at open.
- A write failing with ENOSPC/EDQUOT/EROFS/EACCES/EPERM makes the tier stop
  accepting writes (logged once); reads go on. Other write errors fail that
  write only. A read error is a miss; a chunk that fails
  ``_MAX_READ_ERRORS`` reads in a row is forgotten.

All file-system calls go through a :class:`FileOps` object, the
fault-injection seam used by the tests (ENOSPC, EROFS, EIO).
"""

from __future__ import annotations

import errno
import fcntl
import io
import logging
import mmap
import os
import queue
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import xxhash

from kvtier.index.keys import KEY_BYTES
from kvtier.tiers.policies import EvictionPolicy, LRUPolicy

log = logging.getLogger(__name__)

MAGIC = b"KVTIER\x00\x01"
FORMAT_VERSION = 2
HEADER_BYTES = 4096
#: Alignment of buffers, lengths and file offsets for O_DIRECT (covers 512 B and 4 KiB devices).
ALIGN = 4096
_HDR = struct.Struct("<8sHH16sQ8s32s32sdQ")
_HDR_SUM = struct.Struct("<8s")
_HDR_END = _HDR.size + _HDR_SUM.size
_HDR_PAD = bytes(HEADER_BYTES - _HDR_END)
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
#: Errors after which no further write can succeed: the tier becomes read-only.
_STOP_WRITES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
#: Consecutive failed reads (I/O errors, not corruption) after which a chunk is forgotten.
_MAX_READ_ERRORS = 3
#: Bytes of the per-thread aligned staging buffer used by direct I/O.
_SCRATCH_BYTES = 1 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class DiskTierLocked(RuntimeError):
    """Another process owns the disk tier directory."""


def _checksum(data: memoryview | np.ndarray | bytes) -> bytes:
    return xxhash.xxh3_64_digest(data)


def _align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def encode_header(
    key: bytes,
    namespace: bytes,
    payload: memoryview | np.ndarray | bytes,
    codec: str = "raw",
    stored: int | None = None,
) -> bytes:
    """The ``HEADER_BYTES`` header of a chunk file.

    Args:
        key: 32-byte chunk key.
        namespace: 32-byte namespace digest.
        payload: the payload (C-contiguous; its byte length and checksum are recorded).
        codec: payload codec name (at most 16 ASCII bytes).
        stored: payload bytes in the file including alignment padding (default: no padding).
    """
    view = memoryview(payload).cast("B")
    n = len(view)
    body = _HDR.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        codec.encode().ljust(16, b"\x00"),
        n,
        _checksum(view),
        key,
        namespace,
        time.time(),
        n if stored is None else stored,
    )
    body += _checksum(body)
    return body.ljust(HEADER_BYTES, b"\x00")


class FileOps:
    """The file-system calls of the disk tier, one method per call.

    This is the fault-injection seam: tests pass a subclass whose methods raise
    ``OSError(errno.ENOSPC, ...)``, ``EROFS`` or ``EIO``. Each method behaves
    (and raises ``OSError``) like the ``os``/``io`` call it wraps.
    """

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags, mode)

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def mkdir(self, path: str) -> None:
        os.mkdir(path)

    def open_read(self, path: str, direct: bool) -> io.FileIO:
        """An unbuffered binary reader positioned at offset 0 (O_DIRECT if ``direct``)."""
        if not direct:
            return open(path, "rb", buffering=0)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | _O_DIRECT)
        try:
            return open(fd, "rb", buffering=0)
        except BaseException:
            os.close(fd)
            raise

    def readinto(self, f: io.FileIO, buf: memoryview) -> int:
        """Read into ``buf`` at the current position (one ``read`` syscall, no copy)."""
        return f.readinto(buf) or 0


class _Scratch(threading.local):
    """A page-aligned staging buffer per thread (direct I/O of unaligned user buffers)."""

    def view(self) -> memoryview:
        buf = getattr(self, "buf", None)
        if buf is None:
            self.mm = mmap.mmap(-1, _SCRATCH_BYTES)  # anonymous maps are page-aligned
            buf = self.buf = memoryview(self.mm)
        return buf


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _bytes_view(payload: np.ndarray | memoryview | bytes) -> memoryview:
    """A flat byte view of ``payload``; raises ValueError for empty or non-contiguous input."""
    try:
        view = memoryview(payload).cast("B")
    except TypeError as exc:
        raise ValueError(f"payload must be a C-contiguous buffer: {exc}") from None
    if not len(view):
        raise ValueError("payload is empty")
    return view


class DiskTier:
    """Bounded directory of chunk files with write-behind.

    Args:
        path: directory (created if missing).
        capacity_bytes: bound on file bytes on disk (headers and padding included).
        namespace: 32-byte digest of the key namespace; files of another namespace are misses.
        policy: eviction order (default LRU; initial order by file mtime).
        is_pinned: keys that must not be evicted (leases).
        write_queue: max chunks waiting for write-behind; more are dropped and counted.
        fsync: fsync each file before the rename (survives power loss, slower).
        direct_io: read and write payloads with O_DIRECT (bypassing the page cache)
            through page-aligned buffers; files are padded to ``ALIGN`` bytes. Falls
            back to buffered I/O, with one log line, where the file system refuses
            O_DIRECT (EINVAL, e.g. tmpfs).
        fs: file-system calls (the fault-injection seam); default :class:`FileOps`.

    Raises:
        DiskTierLocked: another live process owns ``path``.
        OSError: ``path`` cannot be created or listed.

    Counters (monotonic): ``written_chunks``, ``evicted_chunks``, ``evicted_bytes``,
    ``dropped_writes`` (queue full / no room), ``failed_writes`` (I/O errors),
    ``corrupt_reads`` (validation failures and vanished files), ``read_errors``
    (I/O errors on read). ``writable`` turns False after a disk-full/read-only error.
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
        direct_io: bool = False,
        fs: FileOps | None = None,
    ):
        self.path = Path(path)
        self.capacity_bytes = int(capacity_bytes)
        self.namespace = namespace
        self.policy = policy or LRUPolicy()
        self._is_pinned = is_pinned
        self.fsync = fsync
        self.fs = fs or FileOps()
        self.direct_io = False
        self._lock = threading.Lock()
        self._index: dict[bytes, int] = {}  # key -> file bytes
        self._writing: set[bytes] = set()  # keys whose file is being written
        self._leased_reads: dict[bytes, int] = {}
        self._read_failures: dict[bytes, int] = {}
        self._scratch = _Scratch()
        self.used_bytes = 0
        self.writable = True
        self.evicted_chunks = 0
        self.evicted_bytes = 0
        self.dropped_writes = 0
        self.failed_writes = 0
        self.corrupt_reads = 0
        self.read_errors = 0
        self.written_chunks = 0
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._take_ownership()
        t0 = time.perf_counter()
        self._scan()
        self.index_load_s = time.perf_counter() - t0
        if direct_io:
            self.direct_io = self._probe_direct_io()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, write_queue))
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="kvtier-disk-writer", daemon=True)
        self._writer.start()

    # -- ownership and index -------------------------------------------------
    def _take_ownership(self) -> int | None:
        lock_path = str(self.path / ".lock")
        writable = True
        try:
            fd = self.fs.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno not in _STOP_WRITES:
                raise
            # Read-only directory or full disk: serve what is there, write nothing.
            self._stop_writes(exc)
            writable = False
            try:
                fd = self.fs.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None  # no lock file and none can be made: nobody can write here either
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
        if writable:
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError as exc:
                log.warning("kvtier disk tier %s: cannot record owner pid: %s", self.path, exc)
        return fd

    def _file(self, key: bytes) -> Path:
        h = key.hex()
        return self.path / h[:2] / (h + SUFFIX)

    def _unlink_quietly(self, path: str) -> None:
        try:
            self.fs.unlink(path)
        except OSError:
            pass

    def _scan(self) -> None:
        """Rebuild the index from the directory; remove leftovers (``.tmp``, header-only files)."""
        found: list[tuple[int, bytes, int]] = []
        name_len = 2 * KEY_BYTES + len(SUFFIX)
        with os.scandir(self.path) as top:
            subdirs = []
            for ent in top:
                if ent.name.endswith(TMP_SUFFIX):
                    self._unlink_quietly(ent.path)  # e.g. a direct-I/O probe of a killed process
                elif len(ent.name) == 2 and ent.is_dir(follow_symlinks=False):
                    subdirs.append(ent.path)
        for sub in subdirs:
            with os.scandir(sub) as it:
                for ent in it:
                    name = ent.name
                    if name.endswith(TMP_SUFFIX):
                        # A write killed before its rename: never complete, remove it.
                        self._unlink_quietly(ent.path)
                        continue
                    if len(name) != name_len or not name.endswith(SUFFIX):
                        continue
                    try:
                        key = bytes.fromhex(name[: 2 * KEY_BYTES])
                        st = ent.stat(follow_symlinks=False)
                    except (ValueError, OSError):
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    if st.st_size <= HEADER_BYTES:
                        self._unlink_quietly(ent.path)
                        continue
                    found.append((st.st_mtime_ns, key, st.st_size))
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._index[key] = size
                self.policy.insert(key)
                self.used_bytes += size
            if self.used_bytes > self.capacity_bytes:
                n = self.evicted_chunks
                self._make_room_locked(0)
                log.info(
                    "kvtier disk tier %s: evicted %d chunks at open to fit capacity %d B",
                    self.path,
                    self.evicted_chunks - n,
                    self.capacity_bytes,
                )

    def _probe_direct_io(self) -> bool:
        """True if the directory's file system accepts O_DIRECT writes of aligned buffers."""
        if not _O_DIRECT:
            log.warning("kvtier disk tier: O_DIRECT is not available on this OS; using buffered I/O")
            return False
        probe = str(self.path / f".direct-probe.{os.getpid()}{TMP_SUFFIX}")
        try:
            fd = self.fs.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | _O_DIRECT)
            try:
                buf = self._scratch.view()[:ALIGN]
                self.fs.write(fd, buf)
            finally:
                self.fs.close(fd)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                log.warning(
                    "kvtier disk tier %s: the file system refuses O_DIRECT (%s); using buffered I/O",
                    self.path,
                    exc,
                )
                return False
            # Read-only or full: no writes will happen; reads still try O_DIRECT and fall back.
        finally:
            self._unlink_quietly(probe)
        return True

    def _disable_direct_io(self, exc: OSError) -> None:
        with self._lock:
            was, self.direct_io = self.direct_io, False
        if was:
            log.warning("kvtier disk tier %s: O_DIRECT refused (%s); using buffered I/O", self.path, exc)

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
        return self._queue.qsize() + len(self._writing)

    # -- write path ------------------------------------------------------------
    def put_async(
        self, key: bytes, payload: np.ndarray, on_done: Callable[[], None], parent: bytes | None = None
    ) -> bool:
        """Queue ``payload`` (uint8, C-contiguous, non-empty) to be written under ``key``.

        ``parent`` is the previous chunk's key of the same prompt (chain-aware eviction).

        The caller keeps ``payload`` valid until ``on_done`` runs (it runs exactly
        once, also when the write is skipped or fails). Returns False (and calls
        ``on_done`` at once) if the queue is full, the tier is read-only or closed,
        or the key is already on disk.

        Raises:
            ValueError: ``key`` is not 32 bytes or ``payload`` is empty or not contiguous
                (``on_done`` is not called: nothing was taken).
        """
        _check_key(key)
        _bytes_view(payload)
        if not self.writable or self._closed or key in self._index:
            on_done()
            return False
        try:
            self._queue.put_nowait((key, payload, on_done, parent))
        except queue.Full:
            self.dropped_writes += 1
            on_done()
            return False
        return True

    def put(self, key: bytes, payload: np.ndarray, parent: bytes | None = None) -> bool:
        """Write ``payload`` synchronously. Returns True if the chunk is on disk afterwards.

        Raises:
            ValueError: ``key`` is not 32 bytes or ``payload`` is empty or not contiguous.
        """
        _check_key(key)
        _bytes_view(payload)
        if key in self._index:
            return True
        if not self.writable or self._closed:
            return False
        return self._write(key, payload, parent)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            key, payload, on_done, parent = item
            try:
                if self.writable and not self._closed and key not in self._index:
                    self._write(key, payload, parent)
            except Exception:  # the writer thread must never die
                log.exception("kvtier disk tier: write of chunk %s failed", key.hex()[:16])
            finally:
                try:
                    on_done()
                except Exception:
                    log.exception("kvtier disk tier: on_done callback failed")
                finally:
                    self._queue.task_done()

    def _write(self, key: bytes, payload: np.ndarray, parent: bytes | None = None) -> bool:
        data = _bytes_view(payload)
        direct = self.direct_io
        size = HEADER_BYTES + (_align_up(len(data)) if direct else len(data))
        with self._lock:
            if key in self._index:
                return True
            if key in self._writing:
                return False  # another thread is writing it right now
            if size > self.capacity_bytes or not self._make_room_locked(size):
                self.dropped_writes += 1
                return False
            self.used_bytes += size  # reserve before the slow part
            self._writing.add(key)
        final = self._file(key)
        tmp = str(final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"))
        written = 0
        try:
            header = encode_header(key, self.namespace, data, stored=size - HEADER_BYTES)
            if direct:
                try:
                    written = self._write_direct(tmp, str(final), header, data)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._unlink_quietly(tmp)
                    self._disable_direct_io(exc)
            if not written:
                header = encode_header(key, self.namespace, data) if direct else header
                written = self._write_buffered(tmp, str(final), header, data)
        except OSError as exc:
            with self._lock:
                self.used_bytes -= size
                self._writing.discard(key)
                self.failed_writes += 1
            self._unlink_quietly(tmp)
            if exc.errno in _STOP_WRITES:
                self._stop_writes(exc)
            else:
                log.warning("kvtier disk tier: write of chunk %s failed: %s", key.hex()[:16], exc)
            return False
        with self._lock:
            self._writing.discard(key)
            self.used_bytes += written - size  # a direct-I/O fallback writes no padding
            self._index[key] = written
            self.policy.insert(key, parent)
            self.written_chunks += 1
        return True

    def _open_tmp(self, tmp: str, final: str, extra_flags: int) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | extra_flags
        try:
            return self.fs.open(tmp, flags, 0o644)
        except FileNotFoundError:
            try:
                self.fs.mkdir(os.path.dirname(final))
            except FileExistsError:
                pass
            return self.fs.open(tmp, flags, 0o644)

    def _write_buffered(self, tmp: str, final: str, header: bytes, data: memoryview) -> int:
        fd = self._open_tmp(tmp, final, 0)
        try:
            _write_all(self.fs, fd, memoryview(header))
            _write_all(self.fs, fd, data)
            if self.fsync:
                self.fs.fsync(fd)
        finally:
            self.fs.close(fd)
        self.fs.replace(tmp, final)
        return HEADER_BYTES + len(data)

    def _write_direct(self, tmp: str, final: str, header: bytes, data: memoryview) -> int:
        """O_DIRECT write: header, then the payload zero-padded to ``ALIGN``.

        An aligned payload's whole-``ALIGN`` prefix goes straight from the caller's
        buffer; the rest is staged through the thread's page-aligned scratch buffer.
        """
        fd = self._open_tmp(tmp, final, _O_DIRECT)
        try:
            s = self._scratch.view()
            s[:HEADER_BYTES] = header
            _write_all(self.fs, fd, s[:HEADER_BYTES])
            n, pos = len(data), 0
            if n >= ALIGN and _address(data) % ALIGN == 0:
                pos = n - n % ALIGN
                _write_all(self.fs, fd, data[:pos])
            while pos < n:
                m = min(len(s), n - pos)
                padded = _align_up(m)
                s[:m] = data[pos : pos + m]
                s[m:padded] = bytes(padded - m)
                _write_all(self.fs, fd, s[:padded])
                pos += m
            if self.fsync:
                self.fs.fsync(fd)
        finally:
            self.fs.close(fd)
        self.fs.replace(tmp, final)
        return HEADER_BYTES + _align_up(n)

    def _stop_writes(self, exc: OSError) -> None:
        with self._lock:
            was, self.writable = self.writable, False
        if was:
            log.error("kvtier disk tier %s stops accepting writes (%s); reads continue", self.path, exc)

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
        self._read_failures.pop(key, None)
        self.used_bytes -= size
        try:
            self.fs.unlink(str(self._file(key)))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("kvtier disk tier: cannot remove %s: %s", key.hex()[:16], exc)
        return size

    # -- read path -------------------------------------------------------------
    def get_into(self, key: bytes, out: np.ndarray) -> bool:
        """Read the chunk ``key`` into ``out`` (a writable, C-contiguous buffer of the payload size).

        Buffered mode reads the payload straight into ``out`` (no extra copy).
        Returns False on a miss, on an I/O error, or on a file that fails
        validation (which is then deleted and logged). A file whose payload length
        differs from ``len(out)`` is a miss but kept.

        Raises:
            ValueError: ``out`` is read-only or not contiguous (a caller bug).
        """
        try:
            dst = memoryview(out).cast("B")
        except TypeError as exc:
            raise ValueError(f"out must be a C-contiguous buffer: {exc}") from None
        if dst.readonly:
            raise ValueError("out must be writable")
        with self._lock:
            if key not in self._index:
                return False
            self._leased_reads[key] = self._leased_reads.get(key, 0) + 1
        try:
            ok = self._read(key, dst)
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

    def _read(self, key: bytes, dst: memoryview) -> bool:
        path = str(self._file(key))
        try:
            try:
                reason, remove = self._read_file(path, key, dst, self.direct_io)
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct_io:
                    raise
                self._disable_direct_io(exc)
                reason, remove = self._read_file(path, key, dst, False)
        except FileNotFoundError:
            reason, remove = "file missing", True
        except OSError as exc:
            with self._lock:
                self.read_errors += 1
                fails = self._read_failures.get(key, 0) + 1
                self._read_failures[key] = fails
                if fails >= _MAX_READ_ERRORS:
                    self._remove_locked(key)
            log.warning(
                "kvtier disk tier: read of chunk %s failed (%s); a miss%s",
                key.hex()[:16],
                exc,
                "; forgetting it" if fails >= _MAX_READ_ERRORS else "",
            )
            return False
        if reason is None:
            if self._read_failures:
                with self._lock:
                    self._read_failures.pop(key, None)
            return True
        if not remove:
            log.warning("kvtier disk tier: chunk %s is a miss: %s", key.hex()[:16], reason)
            return False
        self.corrupt_reads += 1
        log.warning("kvtier disk tier: chunk %s is a miss: %s; removing it", key.hex()[:16], reason)
        with self._lock:
            self._remove_locked(key)
        return False

    def _read_file(self, path: str, key: bytes, dst: memoryview, direct: bool) -> tuple[str | None, bool]:
        """Validate and read one file into ``dst``; returns (miss reason or None, delete the file?)."""
        with self.fs.open_read(path, direct) as f:
            size = os.fstat(f.fileno()).st_size
            if direct:
                hbuf = self._scratch.view()[:HEADER_BYTES]
            else:
                hbuf = memoryview(bytearray(HEADER_BYTES))
            got = _read_full(self.fs, f, hbuf, direct)
            header = bytes(hbuf[:got])  # the scratch buffer is reused for the payload tail
            reason, fields = self._check_header(header, key)
            if reason is not None:
                return reason, True
            n, stored = fields[4], fields[9]
            if n != len(dst):
                return f"payload size {n} != requested {len(dst)}", False
            if size != HEADER_BYTES + stored:
                return f"file size {size} != {HEADER_BYTES + stored} (truncated or extended)", True
            if direct:
                got = self._read_payload_direct(f, dst)
                digest = _checksum(dst) if got == n else b""
            else:
                got, digest = _read_and_checksum(self.fs, f, dst)  # straight into the caller's buffer
            if got != n:
                return "payload shorter than its header says", True
            if digest != fields[5]:
                return "payload checksum mismatch", True
        return None, False

    def _read_payload_direct(self, f: io.FileIO, dst: memoryview) -> int:
        """O_DIRECT read of ``len(dst)`` payload bytes (file position at HEADER_BYTES); returns bytes read."""
        n, pos = len(dst), 0
        if n >= ALIGN and _address(dst) % ALIGN == 0:
            body = n - n % ALIGN
            pos = _read_full(self.fs, f, dst[:body], True)
            if pos != body:
                return pos
        s = self._scratch.view()
        while pos < n:
            m = min(len(s), n - pos)
            got = _read_full(self.fs, f, s[: _align_up(m)], True)
            if got < m:
                return pos + got
            dst[pos : pos + m] = s[:m]
            pos += m
        return pos

    def _check_header(self, header: bytes, key: bytes) -> tuple[str | None, tuple]:
        if len(header) < _HDR_END:
            return "truncated header", ()
        if header[:8] != MAGIC:
            return "bad magic", ()
        if _checksum(header[: _HDR.size]) != header[_HDR.size : _HDR.size + _HDR_SUM.size]:
            return "header checksum mismatch", ()
        if len(header) != HEADER_BYTES or header[_HDR_END:] != _HDR_PAD:
            return "header padding is not zero", ()
        fields = _HDR.unpack_from(header)
        if fields[1] != FORMAT_VERSION or fields[2] != HEADER_BYTES:
            return f"unsupported format version {fields[1]}", ()
        codec = fields[3].rstrip(b"\x00")
        if codec != b"raw":
            return f"unknown codec {codec!r}", ()
        if fields[6] != key:
            return "key mismatch", ()
        if fields[7] != self.namespace:
            return "namespace (model/layout) mismatch", ()
        if fields[9] not in (fields[4], _align_up(fields[4])):
            return f"stored length {fields[9]} does not fit payload length {fields[4]}", ()
        return None, fields

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
        """Finish queued writes (up to ``timeout_s``), stop the writer, release the directory.

        Writes still queued after the timeout are skipped (their ``on_done`` runs).
        """
        if self._closed:
            return
        self.flush(timeout_s)
        self._closed = True  # from here the writer skips what is left in the queue
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._writer.join(timeout=timeout_s)
        if self._writer.is_alive():
            log.warning("kvtier disk tier %s: writer still busy at close", self.path)
        if self._lock_fd is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"chunk key must be {KEY_BYTES} bytes, got {key!r:.80}")


def _write_all(fs: FileOps, fd: int, data: memoryview) -> None:
    view = data
    while view:
        n = fs.write(fd, view)
        if n <= 0:
            raise OSError(errno.EIO, "write returned 0 bytes")
        view = view[n:]


#: Payload bytes read per step of a buffered read; each step is checksummed while
#: it is still in the CPU cache (few steps per chunk: each is a GIL hand-off).
READ_PIECE_BYTES = 2 * 1024 * 1024


def _read_and_checksum(fs: FileOps, f: io.FileIO, dst: memoryview) -> tuple[int, bytes]:
    """Buffered read of ``len(dst)`` bytes into ``dst``; returns (bytes read, xxh3-64 of them)."""
    h = xxhash.xxh3_64()
    pos, n = 0, len(dst)
    while pos < n:
        piece = dst[pos : min(n, pos + READ_PIECE_BYTES)]
        got = _read_full(fs, f, piece, False)
        h.update(piece[:got])
        pos += got
        if got < len(piece):
            break
    return pos, h.digest()


def _read_full(fs: FileOps, f: io.FileIO, buf: memoryview, direct: bool) -> int:
    """Fill ``buf`` from the file's position; returns bytes read (short only at end of file).

    With O_DIRECT one short read means end of file: a second read would start at an
    unaligned offset, which O_DIRECT refuses.
    """
    total = 0
    while total < len(buf):
        n = fs.readinto(f, buf[total:])
        if n <= 0:
            break
        total += n
        if direct and total < len(buf):
            break
    return total
