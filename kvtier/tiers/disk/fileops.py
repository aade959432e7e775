"""File-system calls of the disk tier (the fault-injection seam) and its low-level I/O helpers."""

from __future__ import annotations

import errno
import mmap
import os
import threading
from typing import Sequence

import numpy as np

#: ``os.O_DIRECT`` where the OS has it, else 0 (direct I/O then stays off).
O_DIRECT = getattr(os, "O_DIRECT", 0)
#: Bytes of the per-thread aligned staging buffer used by direct I/O.
SCRATCH_BYTES = 1 << 20
#: Mode of every file the disk tier creates (owner only).
FILE_MODE = 0o600
#: Mode of every directory the disk tier creates (owner only).
DIR_MODE = 0o700


class FileOps:
    """The file-system calls of the disk tier, one method per call.

    This is the fault-injection seam: tests pass a subclass whose methods raise
    ``OSError(errno.ENOSPC, ...)``, ``EROFS`` or ``EIO``. Each method behaves
    (and raises ``OSError``) like the ``os``/``io`` call it wraps.
    """

    def open(self, path: str, flags: int, mode: int = FILE_MODE) -> int:
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
        os.mkdir(path, DIR_MODE)

    def open_read(self, path: str, direct: bool) -> int:
        """A file descriptor open for reading (O_DIRECT if ``direct``); the caller closes it with :meth:`close`."""
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if direct else 0))

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        """One ``pwritev`` of ``buffers`` at ``offset`` (releases the GIL); returns bytes written."""
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        """One ``preadv`` into ``buffers`` from ``offset`` (releases the GIL); returns bytes read."""
        return os.preadv(fd, buffers, offset)


class Scratch(threading.local):
    """A page-aligned staging buffer per thread (direct I/O of unaligned user buffers)."""

    def view(self) -> memoryview:
        buf = getattr(self, "buf", None)
        if buf is None:
            self.mm = mmap.mmap(-1, SCRATCH_BYTES)  # anonymous maps are page-aligned
            buf = self.buf = memoryview(self.mm)
        return buf


def address(view: memoryview) -> int:
    """The memory address of ``view``'s first byte."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def write_all(fs: FileOps, fd: int, data: memoryview) -> None:
    """Write all of ``data`` (``OSError(EIO)`` if a write makes no progress)."""
    view = data
    while view:
        n = fs.write(fd, view)
        if n <= 0:
            raise OSError(errno.EIO, "write returned 0 bytes")
        view = view[n:]


def pwritev_all(fs: FileOps, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
    """Write every byte of ``buffers`` at ``offset`` with as few ``pwritev`` calls as the kernel allows.

    Returns the offset after the last byte. A short write (the kernel may stop early,
    e.g. at a signal) is resumed from the first unwritten byte; with O_DIRECT the
    buffers and the write sizes are multiples of ``ALIGN``, so resumption stays aligned.

    Raises:
        OSError: the write failed (EIO if it made no progress).
    """
    bufs = [b for b in buffers if len(b)]
    while bufs:
        n = fs.pwritev(fd, bufs, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev returned 0 bytes")
        offset += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        if n:
            bufs[0] = bufs[0][n:]
    return offset
