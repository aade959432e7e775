"""Opening a disk tier directory: the ownership lock and the index rebuild from the record headers."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path


from kvtier.index.keys import chain_parent
from kvtier.serde.record import (
    HEADER_BYTES,
    MAX_FIELDS_BYTES,
    SUFFIX,
    BadMagic,
    RecordError,
    decode_header,
    record_relpath,
)
from kvtier.tiers.disk.fileops import FILE_MODE, FileOps

log = logging.getLogger("kvtier.tiers.disk")

#: Suffix of the previous disk format's files (dropped at open).
OLD_SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
#: Threads reading record headers at open.
SCAN_THREADS = 8
#: Errors after which no further write can succeed: the tier becomes read-only.
STOP_WRITES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


class DiskTierLocked(RuntimeError):
    """Another process owns the disk tier directory."""


def take_ownership(path: Path, fs: FileOps) -> tuple[int | None, OSError | None]:
    """Lock ``path/.lock`` (``flock``, released by the kernel when the owner dies).

    Returns:
        (lock fd or None, the error that makes the directory read-only or None).

    Raises:
        DiskTierLocked: another live process (or tier) holds the lock.
        OSError: the lock file cannot be opened for another reason.
    """
    lock_path = str(path / ".lock")
    read_only: OSError | None = None
    try:
        fd = fs.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    except OSError as exc:
        if exc.errno not in STOP_WRITES:
            raise
        # Read-only directory or full disk: serve what is there, write nothing.
        read_only = exc
        try:
            fd = fs.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None, read_only  # no lock file and none can be made: nobody can write here either
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        finally:
            os.close(fd)
        raise DiskTierLocked(
            f"disk tier directory {path} is owned by another process (pid {holder}); "
            "point this process at another directory or stop the other one"
        ) from None
    if read_only is None:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            log.warning("kvtier disk tier %s: cannot record owner pid: %s", path, exc)
    return fd, read_only


@dataclass
class ScanResult:
    """Chunks found at open, oldest first: ``(key, file bytes, parent)``; and what was dropped."""

    found: list[tuple[bytes, int, bytes | None]] = field(default_factory=list)
    old_format: int = 0
    unusable: int = 0
    orphans: int = 0


def scan(path: Path, namespace: bytes, fs: FileOps, remove: bool) -> ScanResult:
    """Read every record header under ``path`` (``<2 hex>/<name>.kvc``).

    Drops (deletes, if ``remove``) leftovers of killed writers (``.tmp``), files of
    the previous format, records that fail their header check or size, records of
    another namespace, and orphans: records whose parent is not on disk (a chain
    can only be hit from its first chunk on, so they could never be hit again).
    """
    res = ScanResult()
    raw: list[tuple[int, bytes, int, bytes | None, str]] = []
    with os.scandir(path) as top:
        subdirs = []
        for ent in top:
            if ent.name.endswith(TMP_SUFFIX):
                _drop(fs, ent.path, remove)  # e.g. a direct-I/O probe of a killed process
            elif len(ent.name) == 2 and ent.is_dir(follow_symlinks=False):
                subdirs.append(ent.path)
    # Header reads of a cold cache are random 4 KiB reads: a few threads overlap them.
    with ThreadPoolExecutor(max_workers=max(1, min(SCAN_THREADS, len(subdirs)))) as pool:
        for part in pool.map(lambda sub: _scan_subdir(sub, namespace, fs, remove), subdirs):
            raw += part.records
            res.old_format += part.old_format
            res.unusable += part.unusable
    present = {k for _, k, _, _, _ in raw}
    children: dict[bytes, list[bytes]] = {}
    for _, key, _, parent, _ in raw:
        parent = chain_parent(parent)
        if parent is not None and parent in present:
            children.setdefault(parent, []).append(key)
    reachable: set[bytes] = set()
    stack = [k for _, k, _, p, _ in raw if chain_parent(p) is None]  # first chunks (parent None or a lineage marker)
    while stack:
        k = stack.pop()
        if k not in reachable:
            reachable.add(k)
            stack.extend(children.get(k, ()))
    raw.sort(key=lambda r: r[0])
    for _, key, size, parent, p in raw:
        if key in reachable:
            res.found.append((key, size, parent))
        else:
            res.orphans += 1
            _drop(fs, p, remove)
    return res


@dataclass
class _SubdirScan:
    records: list[tuple[int, bytes, int, bytes | None, str]] = field(default_factory=list)
    old_format: int = 0
    unusable: int = 0


def _scan_subdir(sub: str, namespace: bytes, fs: FileOps, remove: bool) -> _SubdirScan:
    """Records of one ``<2 hex>`` directory: ``(mtime ns, key, file bytes, parent, path)``."""
    out = _SubdirScan()
    with os.scandir(sub) as it:
        entries = list(it)
    for ent in entries:
        name = ent.name
        if name.endswith(TMP_SUFFIX):  # a write killed before its rename: never complete
            _drop(fs, ent.path, remove)
            continue
        if name.endswith(OLD_SUFFIX):
            out.old_format += 1
            _drop(fs, ent.path, remove)
            continue
        if not name.endswith(SUFFIX) or name.startswith("."):
            continue
        try:
            st = ent.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                continue
            head = _read_head(ent.path) if st.st_size > HEADER_BYTES else b""
            hdr = decode_header(head, full=False)
            hdr.expect(hdr.key, namespace, st.st_size)
            if record_relpath(hdr.key) != f"{os.path.basename(sub)}/{name}":
                raise RecordError("file name does not match the record's key")
        except BadMagic as exc:
            if exc.old_format:
                out.old_format += 1
            else:
                out.unusable += 1
            _drop(fs, ent.path, remove)
            continue
        except (RecordError, OSError):
            out.unusable += 1
            _drop(fs, ent.path, remove)
            continue
        out.records.append((st.st_mtime_ns, hdr.key, st.st_size, hdr.parent, ent.path))
    return out


def _read_head(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, MAX_FIELDS_BYTES, 0)
    finally:
        os.close(fd)


def _drop(fs: FileOps, path: str, remove: bool) -> None:
    if not remove:
        return
    try:
        fs.unlink(path)
    except OSError:
        pass
