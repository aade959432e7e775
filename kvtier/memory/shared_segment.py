"""Shared-memory segments: the cache service's CPU chunk pools, and an instance's CPU tier
when it serves peers over shared memory (``peer_listen = shm://...``).

The server creates one anonymous segment per key namespace (``memfd_create``
on Linux; else a 0600 file in ``/dev/shm`` unlinked at once, so nothing is left
behind if the server is killed). Clients map the same pages:

- over the Unix socket the server passes the file descriptor itself
  (``SCM_RIGHTS``), so only processes that may connect to the owner-only socket
  can map it;
- TCP clients (same machine, same user) open ``/proc/<server pid>/fd/<fd>``.

A *sparse* segment (the service's: every namespace's segment spans the whole
CPU capacity, and the namespaces share one byte budget, see
:mod:`kvtier.memory.budget`) is neither pre-touched nor mapped with
``MAP_POPULATE``: its pages are backed when first written and
:meth:`SharedSegment.release` gives them back (``MADV_REMOVE``, a hole punched
in the file), so the memory used is what the budget charged, not the segments'
sizes. Clients never populate (that would back every page of every segment)
nor ask for huge pages (one would back 2 MiB where one slot is charged); a
client's first copy into a page takes a minor fault.

Invariant: the segment's size is fixed at creation (``num_slots * slot_bytes``), and on
Linux the kernel enforces it: the memfd is created with ``MFD_ALLOW_SEALING``, sized, then
sealed ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`` before any other process can hold it.
Whoever receives the fd (a hostile client included) cannot ``ftruncate`` it, so no mapping
of it (the server's, other engines') can SIGBUS on a page cut off the end. Hole punching
(:meth:`SharedSegment.release`) stays allowed: it keeps the size. Attaching
(:meth:`SharedSegment.attach_fd`) refuses a segment without ``F_SEAL_SHRINK``, so a server
or peer that could shrink it later cannot kill the client either.

The path-based fallback (no ``memfd_create``: not Linux) cannot be sealed (file seals exist
only on memfds); what protects it there is only that the file is unlinked at once, 0600,
and handed only to processes of the same user over the owner-only socket, any of which
could still truncate it. Where the platform has no sealing at all (no ``F_GET_SEALS``),
attaching cannot check it either and maps the segment as before.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import tempfile

from typing import TYPE_CHECKING

import numpy as np

from kvtier.memory.pool import ChunkPool

if TYPE_CHECKING:
    from kvtier.memory.numa import NumaReport
    from kvtier.memory.numa_topology import Placement

#: The seals of every segment this module creates (where the platform has them).
SEALS = (getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)
         | getattr(fcntl, "F_SEAL_SEAL", 0))
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_PAGE = mmap.PAGESIZE


class SharedSegment:
    """A mapped shared-memory segment of ``size`` bytes.

    Use :meth:`create` (server) or :meth:`attach_fd` / :meth:`attach_path`
    (client). ``array`` is a writable ``uint8 [size]`` view of the mapping.
    """

    def __init__(self, fd: int | None, mm: mmap.mmap, size: int):
        self.fd = fd  # kept open by the server (passed to clients); None on clients
        self.size = size
        #: True while the segment is registered with CUDA as pinned memory (kvtier.service.pinning):
        #: :meth:`release` then keeps the pages, since the GPU's DMA mapping points at them.
        self.keep_pages = False
        self._mm: mmap.mmap | None = mm
        self.array = np.frombuffer(mm, dtype=np.uint8, count=size)
        #: Where the pages are (:mod:`kvtier.memory.numa`; None: no placement asked).
        self.numa: NumaReport | None = None

    @classmethod
    def create(cls, size: int, name: str = "kvtier", sparse: bool = False,
               numa: "Placement | None" = None) -> "SharedSegment":
        """A new segment (server side) of ``size`` bytes: pre-touched, or ``sparse`` (pages backed
        on first write); sealed against any size change where the platform has seals.

        ``numa``: the segment's NUMA policy, set before any page is touched (a shared
        memory policy: pages backed later, by any process, follow it too), checked
        after the pre-touch (:attr:`numa`; a sparse segment's check finds no page yet).

        Raises:
            ValueError: ``size`` not positive.
            OSError: the memory cannot be reserved (:class:`~kvtier.memory.numa.NumaUnavailable`:
                ``numa`` binds to a node the kernel refuses).
        """
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        fd = _sized_fd(name, size)
        try:
            # with a placement, no MAP_POPULATE: the policy must be set before the pages exist
            flags = mmap.MAP_SHARED if sparse or numa is not None else _MAP_FLAGS
            mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        if not sparse:
            _advise_huge(mm)  # (sparse: a huge page would back 2 MiB where one slot is charged)
        seg = cls(fd, mm, size)

        def touch() -> None:
            if not sparse:
                seg.array.fill(1)  # allocate every page now: no faults or OOM surprises later

        if numa is None:
            touch()
        else:
            from kvtier.memory.numa import place

            try:
                seg.numa = place(seg.array.ctypes.data, size, numa, touch)
            except BaseException:
                seg.close()
                raise
        return seg

    @classmethod
    def attach_fd(cls, fd: int, size: int, writable: bool = True) -> "SharedSegment":
        """Map a segment received as a file descriptor; ``fd`` is closed afterwards.

        ``writable=False`` maps it read-only (``array`` is then read-only too): a peer that
        only copies out of another process's memory cannot corrupt it.

        The segment must be sealed against shrinking (``F_SEAL_SHRINK``, as :meth:`create`
        seals it) where the platform has seals: a file its sender (or anyone holding it)
        could truncate later would make any touch of the mapping past the new end a SIGBUS.

        Raises:
            ValueError: the file is smaller than ``size`` (bytes), or not sealed against shrinking.
            OSError: reading its seals or mapping failed.
        """
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        try:
            check_sealed(fd)
            if os.fstat(fd).st_size < size:
                raise ValueError(f"shared segment has {os.fstat(fd).st_size} B, smaller than the {size} B announced")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)
        return cls(None, mm, size)

    @classmethod
    def attach_path(cls, path: str, size: int) -> "SharedSegment":
        """Map a segment by path (``/proc/<pid>/fd/<n>``, for TCP clients), ``size`` bytes.

        The same checks as :meth:`attach_fd` (the seals belong to the file, not the fd).

        Raises:
            ValueError, OSError: as :meth:`attach_fd`; OSError also when the path cannot be opened.
        """
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        return cls.attach_fd(fd, size)

    def release(self, offset: int, length: int) -> None:
        """Give the whole pages inside ``[offset, offset + length)`` back to the OS (server side).

        Their contents become zeros in every mapping. Pages shared with the
        bytes around the range stay (a slot smaller than a page, or not
        page-aligned, keeps up to two partly used pages backed). A no-op where
        ``MADV_REMOVE`` is missing, or while :attr:`keep_pages` (pinned for CUDA).
        """
        mm = self._mm
        advice = getattr(mmap, "MADV_REMOVE", None)
        if mm is None or advice is None or self.keep_pages:
            return
        start = -(-offset // _PAGE) * _PAGE
        end = (offset + length) // _PAGE * _PAGE
        if end > start:
            try:
                mm.madvise(advice, start, end - start)
            except OSError:
                pass  # a filesystem without hole punching: the pages stay until the segment closes

    def resident_bytes(self) -> int:
        """Bytes of the segment backed by memory now (the file's allocated blocks; server side)."""
        if self.fd is None:
            return 0
        return os.fstat(self.fd).st_blocks * 512

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


def check_sealed(fd: int) -> None:
    """Refuse a segment file that can still shrink (no ``F_SEAL_SHRINK``).

    A no-op where the platform has no file seals (no ``fcntl.F_GET_SEALS``: not Linux).

    Raises:
        ValueError: the file is not sealed against shrinking (also a file that cannot carry
            seals, e.g. a regular tmpfs file: ``EINVAL``).
    """
    get = getattr(fcntl, "F_GET_SEALS", None)
    if get is None:
        return
    try:
        seals = fcntl.fcntl(fd, get)
    except OSError as exc:
        raise ValueError(f"shared segment cannot carry seals ({exc.strerror}); a sealed memfd is required") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise ValueError("shared segment is not sealed against shrinking (F_SEAL_SHRINK); refusing to map it")


def _sized_fd(name: str, size: int) -> int:
    """A new anonymous file of ``size`` bytes: a sealed memfd on Linux (see the module docstring),
    else an unlinked 0600 file in ``/dev/shm`` (no seals there).

    Raises:
        OSError: the file cannot be created, sized or sealed.
    """
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    else:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix=f"{name}-", dir=base)  # 0600
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
        if hasattr(os, "memfd_create"):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def shared_chunk_pool(slot_bytes: int, capacity_bytes: int, name: str = "kvtier-cpu",
                      numa: "Placement | None" = None) -> tuple[ChunkPool, SharedSegment]:
    """A :class:`ChunkPool` of ``capacity_bytes // slot_bytes`` slots inside a new pre-touched
    segment (returned too: the caller shares it, e.g. with peers, and closes it), placed by ``numa``.

    Raises:
        ValueError: the capacity is below one slot.
        OSError: the memory cannot be reserved.
    """
    num_slots = capacity_bytes // slot_bytes if slot_bytes > 0 else 0
    if num_slots < 1:
        raise ValueError(f"CPU tier capacity {capacity_bytes} B is below one chunk ({slot_bytes} B)")
    seg = SharedSegment.create(num_slots * slot_bytes, name=name, numa=numa)
    pool = ChunkPool(slot_bytes, num_slots, buffer=seg.array)
    pool.numa = seg.numa
    return pool, seg
