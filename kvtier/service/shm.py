"""The shared-memory segment that holds the cache service's CPU chunk pool.

The server creates one anonymous segment per key namespace (``memfd_create``
on Linux; else a 0600 file in ``/dev/shm`` unlinked at once, so nothing is left
behind if the server is killed) and pre-touches every page. Clients map the
same pages:

- over the Unix socket the server passes the file descriptor itself
  (``SCM_RIGHTS``), so only processes that may connect to the owner-only socket
  can map it;
- TCP clients (same machine, same user) open ``/proc/<server pid>/fd/<fd>``.

Both sides map with ``MAP_POPULATE`` so the first copy into or out of a slot
does not pay a page fault per 4 KiB page (first-touch copies run ~5x slower on
the reference VM, see shared notes/baselines.md).

Invariant: the segment's size is fixed at creation (``num_slots * slot_bytes``);
the server's CPU pool never grows, whatever clients ask.
"""

from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np

_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class SharedSegment:
    """A mapped shared-memory segment of ``size`` bytes.

    Use :meth:`create` (server) or :meth:`attach_fd` / :meth:`attach_path`
    (client). ``array`` is a writable ``uint8 [size]`` view of the mapping.
    """

    def __init__(self, fd: int | None, mm: mmap.mmap, size: int):
        self.fd = fd  # kept open by the server (passed to clients); None on clients
        self.size = size
        self._mm: mmap.mmap | None = mm
        self.array = np.frombuffer(mm, dtype=np.uint8, count=size)

    @classmethod
    def create(cls, size: int, name: str = "kvtier") -> "SharedSegment":
        """A new pre-touched segment (server side).

        Raises:
            ValueError: ``size`` not positive.
            OSError: the memory cannot be reserved.
        """
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        fd = _anonymous_fd(name)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=_MAP_FLAGS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        _advise_huge(mm)
        seg = cls(fd, mm, size)
        seg.array.fill(1)  # allocate every page now: no faults or OOM surprises later
        return seg

    @classmethod
    def attach_fd(cls, fd: int, size: int) -> "SharedSegment":
        """Map a segment received as a file descriptor; ``fd`` is closed afterwards.

        Raises:
            ValueError: the file is smaller than ``size``.
            OSError: mapping failed.
        """
        try:
            if os.fstat(fd).st_size < size:
                raise ValueError("shared segment is smaller than announced")
            mm = mmap.mmap(fd, size, flags=_MAP_FLAGS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            _advise_huge(mm)
        finally:
            os.close(fd)
        return cls(None, mm, size)

    @classmethod
    def attach_path(cls, path: str, size: int) -> "SharedSegment":
        """Map a segment by path (``/proc/<pid>/fd/<n>``, for TCP clients)."""
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        return cls.attach_fd(fd, size)

    def close(self) -> None:
        """Unmap (deferred until no numpy view is alive) and close the fd."""
        self.array = np.empty(0, dtype=np.uint8)
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views still alive (a reader mid-copy): the mapping goes with them
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _advise_huge(mm: mmap.mmap) -> None:
    """Ask for transparent huge pages (fewer TLB misses on chunk copies).

    Takes effect only where the kernel allows THP for shared memory
    (``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` = advise, within_size
    or always); elsewhere, e.g. ``never``, the segment stays on 4 KiB pages.
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mm.madvise(advice)
        except OSError:
            pass


def _anonymous_fd(name: str) -> int:
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name, os.MFD_CLOEXEC)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix=f"{name}-", dir=base)  # 0600
    os.unlink(path)
    return fd
