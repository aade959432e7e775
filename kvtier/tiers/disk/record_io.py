"""Reading and writing one disk record file, buffered or with O_DIRECT, through :class:`FileOps`."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Callable

import xxhash

from kvtier.serde.base import Buffer, byte_view
from kvtier.serde.record import (
    ALIGN,
    HEADER_BYTES,
    PayloadSizeMismatch,
    RecordError,
    align_up,
    decode_header,
)
from kvtier.tiers.disk.fileops import FILE_MODE, O_DIRECT, FileOps, Scratch, address, pwritev_all
from kvtier.tiers.disk.scan import TMP_SUFFIX

log = logging.getLogger("kvtier.tiers.disk")

#: Payload bytes per ``preadv`` of a buffered read (the first one also carries the header): in practice
#: the whole chunk (a 256-token SmolLM2-135M chunk is 5.9 MB), hashed once after it landed. On the
#: 2-vCPU VM, where page-cache reads are CPU-bound, 8 x 5.9 MB chunks on 4 threads, paired A/B per
#: trial: whole-chunk steps 1.24x (IQR 1.02-1.37) the previous 256 KiB steps (each hashed while in
#: L2) right after the writes and 1.08x (0.96-1.21) with the chunks pushed out of the CPU caches
#: (1 and 2 MiB steps in between); every step is a GIL hand-off per thread (benchmarks/README.md).
READ_STEP_BYTES = 64 * 1024 * 1024
#: Payload bytes per ``preadv`` of an O_DIRECT read: the device DMAs around the CPU caches, so
#: the hash reads memory whatever the step; large steps mean fewer, larger device I/Os.
DIRECT_READ_STEP_BYTES = 8 * 1024 * 1024
#: Payload bytes per ``pwritev`` of a buffered write, each hashed right after the kernel copied it.
WRITE_STEP_BYTES = 2 * 1024 * 1024


class RecordIO:
    """Record file I/O of one disk tier directory (thread-safe: per-thread staging buffers).

    Args:
        fs: the file-system seam.
        namespace: 32-byte digest every record read must carry.
        fsync: fsync each file before its rename.
        verify: check each payload's xxh3-64 on read (False: header checks only).
    """

    def __init__(self, fs: FileOps, namespace: bytes, fsync: bool, verify: bool = True):
        self.fs = fs
        self.namespace = namespace
        self.fsync = fsync
        self.verify = verify
        self.scratch = Scratch()

    def probe_direct_io(self, directory: Path) -> bool:
        """True if the directory's file system accepts O_DIRECT writes of aligned buffers."""
        if not O_DIRECT:
            log.warning("kvtier disk tier: O_DIRECT is not available on this OS; using buffered I/O")
            return False
        probe = str(directory / f".direct-probe.{os.getpid()}{TMP_SUFFIX}")
        try:
            fd = self.fs.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | O_DIRECT)
            try:
                self.fs.write(fd, self.scratch.view()[:ALIGN])
            finally:
                self.fs.close(fd)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                log.warning(
                    "kvtier disk tier %s: the file system refuses O_DIRECT (%s); using buffered I/O", directory, exc
                )
                return False
            # Read-only or full: no writes will happen; reads still try O_DIRECT and fall back.
        finally:
            unlink_quietly(self.fs, probe)
        return True

    def _open_tmp(self, tmp: str, final: str, extra_flags: int) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | extra_flags
        try:
            return self.fs.open(tmp, flags, FILE_MODE)
        except FileNotFoundError:
            try:
                self.fs.mkdir(os.path.dirname(final))
            except FileExistsError:
                pass
            return self.fs.open(tmp, flags, FILE_MODE)

    def write_record(self, tmp: str, final: str, header: bytes, data: memoryview, direct: bool) -> int:
        """Write one complete record to ``tmp`` and close it (fsync'd first if ``fsync``); no rename.

        Buffered: one ``pwritev`` of header and payload straight from ``data`` (no copy).
        O_DIRECT: the header is staged in the thread's page-aligned scratch buffer, an
        aligned payload's whole-``ALIGN`` prefix goes straight from ``data`` in the same
        ``pwritev``, and only an unaligned rest is staged (zero-padded to ``ALIGN``).

        Returns:
            file bytes written (header, payload and padding).

        Raises:
            OSError: the write failed (``tmp`` may be left behind; the caller unlinks it).
        """
        fd = self._open_tmp(tmp, final, O_DIRECT if direct else 0)
        try:
            if direct:
                size = self._pwrite_direct(fd, header, data)
            else:
                size = pwritev_all(self.fs, fd, [memoryview(header), data], 0)
            if self.fsync:
                self.fs.fsync(fd)
        finally:
            self.fs.close(fd)
        return size

    def write_record_hashed(self, tmp: str, final: str, make_header: Callable[[bytes], bytes], data: memoryview) -> int:
        """Buffered write of one complete record to ``tmp``, checksumming the payload as it goes.

        Each ``WRITE_STEP_BYTES`` piece of ``data`` is written at its place (one
        ``pwritev``, which leaves the piece in the CPU cache) and hashed right after;
        then ``make_header(xxh3-64 digest)`` is written at offset 0. One pass over the
        payload from memory instead of two (hash, then copy). The file is closed (and
        fsync'd if ``fsync``), not renamed.

        Returns:
            file bytes written.

        Raises:
            OSError: the write failed (``tmp`` may be left behind; the caller unlinks it).
        """
        fd = self._open_tmp(tmp, final, 0)
        try:
            h = xxhash.xxh3_64()
            n, pos = len(data), 0
            while pos < n:
                piece = data[pos : pos + WRITE_STEP_BYTES]
                pwritev_all(self.fs, fd, [piece], HEADER_BYTES + pos)
                h.update(piece)
                pos += len(piece)
            pwritev_all(self.fs, fd, [memoryview(make_header(h.digest()))], 0)
            if self.fsync:
                self.fs.fsync(fd)
        finally:
            self.fs.close(fd)
        return HEADER_BYTES + n

    def publish(self, tmp: str, final: str) -> None:
        """Rename a complete ``tmp`` record into place (atomic: readers see all or nothing)."""
        self.fs.replace(tmp, final)

    def _pwrite_direct(self, fd: int, header: bytes, data: memoryview) -> int:
        s = self.scratch.view()
        s[:HEADER_BYTES] = header
        bufs = [s[:HEADER_BYTES]]
        n, pos = len(data), 0
        if n >= ALIGN and address(data) % ALIGN == 0:
            pos = n - n % ALIGN
            bufs.append(data[:pos])
        rest = n - pos
        if rest and HEADER_BYTES + align_up(rest) <= len(s):  # the tail fits next to the header
            t = s[HEADER_BYTES : HEADER_BYTES + align_up(rest)]
            t[:rest] = data[pos:]
            t[rest:] = bytes(len(t) - rest)
            bufs.append(t)
            pos = n
        off = pwritev_all(self.fs, fd, bufs, 0)
        while pos < n:  # an unaligned payload larger than the scratch buffer: staged piecewise
            m = min(len(s), n - pos)
            padded = align_up(m)
            s[:m] = data[pos : pos + m]
            s[m:padded] = bytes(padded - m)
            off = pwritev_all(self.fs, fd, [s[:padded]], off)
            pos += m
        return off

    def read(self, path: str, key: bytes, dst: memoryview, direct: bool) -> None:
        """Validate and read one record into ``dst``, checksumming each step after it lands.

        The header and the first payload step (``READ_STEP_BYTES``, in practice the whole
        payload; O_DIRECT: ``DIRECT_READ_STEP_BYTES``) come in one ``preadv`` straight into
        ``dst``; each step is hashed (xxh3-64) right after it lands while the batch's other
        I/O threads read their chunks, and the digest must match the header's before the
        chunk counts as a hit (``verify`` False: no hash, the header checks only). On a
        miss ``dst`` may hold part of the record.

        Raises:
            RecordError: the record is unusable (delete it).
            PayloadSizeMismatch: the record holds another payload size (keep it).
            OSError: I/O errors.
        """
        fd = self.fs.open_read(path, direct)
        try:
            self._read_fd(fd, key, dst, direct)
        finally:
            self.fs.close(fd)

    def _read_fd(self, fd: int, key: bytes, dst: memoryview, direct: bool) -> None:
        size = os.fstat(fd).st_size
        n = len(dst)
        s = self.scratch.view()
        hbuf = s[:HEADER_BYTES]
        # Bytes of dst that may be read straight into it (O_DIRECT: aligned address and length).
        straight = n if not direct else (n - n % ALIGN if address(dst) % ALIGN == 0 else 0)
        step = DIRECT_READ_STEP_BYTES if direct else READ_STEP_BYTES
        first = dst[: min(straight, step)]
        got = self._pread(fd, [hbuf, first] if len(first) else [hbuf], 0, direct)
        hdr = decode_header(hbuf[: min(got, HEADER_BYTES)])  # copies what it keeps
        hdr.expect(key, self.namespace)
        if hdr.codec != "raw" or hdr.body_len != hdr.payload_len:
            raise RecordError(f"unknown codec {hdr.codec!r} for the disk tier")
        if hdr.payload_len != n:
            raise PayloadSizeMismatch(f"payload size {hdr.payload_len} != requested {n}")
        hdr.expect(key, self.namespace, size)
        pos = max(0, got - HEADER_BYTES)
        if pos < len(first):
            raise RecordError("payload shorter than its header says")
        h = xxhash.xxh3_64() if self.verify else None
        if h is not None:
            h.update(first)
        preadv = self.fs.preadv  # the loop's one call per step (tens per chunk): no extra Python layers
        while pos < n:
            if pos < straight:
                piece = dst[pos : min(straight, pos + step)]
                got = preadv(fd, [piece], HEADER_BYTES + pos)
                if 0 < got < len(piece) and not direct:  # a short read before the end: go on
                    got += self._pread(fd, [piece[got:]], HEADER_BYTES + pos + got, direct)
            else:  # O_DIRECT into an unaligned destination: staged through the scratch buffer
                m = min(len(s), n - pos)
                got = min(m, self._pread(fd, [s[: align_up(m)]], HEADER_BYTES + pos, direct))
                piece = dst[pos : pos + m]
                piece[:got] = s[:got]
            if got < len(piece):
                raise RecordError("payload shorter than its header says")
            if h is not None:
                h.update(piece)
            pos += len(piece)
        if h is not None and h.digest() != hdr.body_sum:
            raise RecordError("payload checksum mismatch")

    def _pread(self, fd: int, bufs: list[memoryview], offset: int, direct: bool) -> int:
        """Fill ``bufs`` from ``offset``; returns bytes read (short only at end of file).

        With O_DIRECT one short read means end of file (a retry would be unaligned).
        """
        want = sum(len(b) for b in bufs)
        total = 0
        while total < want:
            n = self.fs.preadv(fd, bufs, offset + total)
            if n <= 0:
                break
            total += n
            if direct or total >= want:
                break
            while bufs and n >= len(bufs[0]):
                n -= len(bufs[0])
                bufs = bufs[1:]
            if n:
                bufs = [bufs[0][n:], *bufs[1:]]
        return total


def unlink_quietly(fs: FileOps, path: str) -> None:
    """Remove ``path``, ignoring every error."""
    try:
        fs.unlink(path)
    except OSError:
        pass


def payload_view(payload: Buffer) -> memoryview:
    """A flat byte view of ``payload``; raises ValueError for empty or non-contiguous input."""
    try:
        mv = byte_view(payload)
    except TypeError as exc:
        raise TypeError(f"payload must be a buffer, got {type(payload).__name__}") from exc
    if not mv.c_contiguous:
        raise ValueError("payload must be a C-contiguous buffer")
    view = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    if not len(view):
        raise ValueError("payload is empty")
    return view
