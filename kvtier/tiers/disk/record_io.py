"""Reading and writing one disk record file, buffered or with O_DIRECT, through :class:`FileOps`."""

from __future__ import annotations

import errno
import io
import logging
import os
from pathlib import Path

from kvtier.serde.base import Buffer
from kvtier.serde.record import (
    ALIGN,
    HEADER_BYTES,
    PayloadSizeMismatch,
    RecordError,
    align_up,
    checksum,
    decode_header,
    read_and_checksum,
)
from kvtier.tiers.disk.fileops import FILE_MODE, O_DIRECT, FileOps, Scratch, address, read_full, write_all
from kvtier.tiers.disk.scan import TMP_SUFFIX

log = logging.getLogger("kvtier.tiers.disk")


class RecordIO:
    """Record file I/O of one disk tier directory (thread-safe: per-thread staging buffers).

    Args:
        fs: the file-system seam.
        namespace: 32-byte digest every record read must carry.
        fsync: fsync each file before its rename.
    """

    def __init__(self, fs: FileOps, namespace: bytes, fsync: bool):
        self.fs = fs
        self.namespace = namespace
        self.fsync = fsync
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

    def write_buffered(self, tmp: str, final: str, header: bytes, data: memoryview) -> int:
        fd = self._open_tmp(tmp, final, 0)
        try:
            write_all(self.fs, fd, memoryview(header))
            write_all(self.fs, fd, data)
            if self.fsync:
                self.fs.fsync(fd)
        finally:
            self.fs.close(fd)
        self.fs.replace(tmp, final)
        return HEADER_BYTES + len(data)

    def write_direct(self, tmp: str, final: str, header: bytes, data: memoryview) -> int:
        """O_DIRECT write: header, then the payload zero-padded to ``ALIGN``.

        An aligned payload's whole-``ALIGN`` prefix goes straight from the caller's
        buffer; the rest is staged through the thread's page-aligned scratch buffer.
        """
        fd = self._open_tmp(tmp, final, O_DIRECT)
        try:
            s = self.scratch.view()
            s[:HEADER_BYTES] = header
            write_all(self.fs, fd, s[:HEADER_BYTES])
            n, pos = len(data), 0
            if n >= ALIGN and address(data) % ALIGN == 0:
                pos = n - n % ALIGN
                write_all(self.fs, fd, data[:pos])
            while pos < n:
                m = min(len(s), n - pos)
                padded = align_up(m)
                s[:m] = data[pos : pos + m]
                s[m:padded] = bytes(padded - m)
                write_all(self.fs, fd, s[:padded])
                pos += m
            if self.fsync:
                self.fs.fsync(fd)
        finally:
            self.fs.close(fd)
        self.fs.replace(tmp, final)
        return HEADER_BYTES + align_up(n)

    def read(self, path: str, key: bytes, dst: memoryview, direct: bool) -> None:
        """Validate and read one record into ``dst``.

        Raises:
            RecordError: the record is unusable (delete it).
            PayloadSizeMismatch: the record holds another payload size (keep it).
            OSError: I/O errors.
        """
        with self.fs.open_read(path, direct) as f:
            size = os.fstat(f.fileno()).st_size
            hbuf = self.scratch.view()[:HEADER_BYTES] if direct else memoryview(bytearray(HEADER_BYTES))
            got = read_full(self.fs, f, hbuf, direct)
            hdr = decode_header(hbuf[:got])  # copies what it keeps: the scratch is reused below
            hdr.expect(key, self.namespace)
            if hdr.codec != "raw" or hdr.body_len != hdr.payload_len:
                raise RecordError(f"unknown codec {hdr.codec!r} for the disk tier")
            n = hdr.payload_len
            if n != len(dst):
                raise PayloadSizeMismatch(f"payload size {n} != requested {len(dst)}")
            hdr.expect(key, self.namespace, size)
            if direct:
                got = self._read_payload_direct(f, dst)
                digest = checksum(dst) if got == n else b""
            else:
                got, digest = read_and_checksum(lambda v: read_full(self.fs, f, v, False), dst)
            if got != n:
                raise RecordError("payload shorter than its header says")
            if digest != hdr.body_sum:
                raise RecordError("payload checksum mismatch")

    def _read_payload_direct(self, f: io.FileIO, dst: memoryview) -> int:
        """O_DIRECT read of ``len(dst)`` payload bytes (file position at HEADER_BYTES); returns bytes read."""
        n, pos = len(dst), 0
        if n >= ALIGN and address(dst) % ALIGN == 0:
            body = n - n % ALIGN
            pos = read_full(self.fs, f, dst[:body], True)
            if pos != body:
                return pos
        s = self.scratch.view()
        while pos < n:
            m = min(len(s), n - pos)
            got = read_full(self.fs, f, s[: align_up(m)], True)
            if got < m:
                return pos + got
            dst[pos : pos + m] = s[:m]
            pos += m
        return pos


def unlink_quietly(fs: FileOps, path: str) -> None:
    """Remove ``path``, ignoring every error."""
    try:
        fs.unlink(path)
    except OSError:
        pass


def payload_view(payload: Buffer) -> memoryview:
    """A flat byte view of ``payload``; raises ValueError for empty or non-contiguous input."""
    try:
        mv = memoryview(payload)
    except TypeError as exc:
        raise TypeError(f"payload must be a buffer, got {type(payload).__name__}") from exc
    if not mv.c_contiguous:
        raise ValueError("payload must be a C-contiguous buffer")
    view = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    if not len(view):
        raise ValueError("payload is empty")
    return view
