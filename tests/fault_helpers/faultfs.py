"""A :class:`FileOps` that fails chosen calls with a chosen errno (the disk tier's fault seam)."""

from __future__ import annotations

import errno
import os
import threading

from kvtier.tiers.disk import FileOps

#: Operation names accepted by :meth:`FaultyFileOps.fail`.
OPS = ("open_write", "open_lock", "write", "fsync", "replace", "mkdir", "unlink", "open_read", "read")


class FaultyFileOps(FileOps):
    """Real file-system calls, except those told to fail.

    ``fail(op, err)`` makes every later ``op`` raise ``OSError(err)``; ``times``
    limits it to that many calls. ``write_budget`` lets writes through until that
    many bytes were written in total, then writes the part that fits and raises
    ENOSPC (a disk filling up in the middle of a file). ``direct_einval`` makes
    every O_DIRECT open fail with EINVAL (a file system without O_DIRECT).

    ``calls`` counts calls per operation (failed ones included).
    """

    def __init__(self) -> None:
        self._faults: dict[str, list[int]] = {}  # op -> [errno, remaining (-1 = forever)]
        self.write_budget: int | None = None
        self.direct_einval = False
        self.calls: dict[str, int] = {op: 0 for op in OPS}
        self._lock = threading.Lock()

    def fail(self, op: str, err: int, times: int = -1) -> None:
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; one of {OPS}")
        self._faults[op] = [err, times]

    def heal(self, op: str | None = None) -> None:
        if op is None:
            self._faults.clear()
            self.write_budget = None
            self.direct_einval = False
        else:
            self._faults.pop(op, None)

    def _check(self, op: str) -> None:
        with self._lock:
            self.calls[op] += 1
            fault = self._faults.get(op)
            if fault is None or fault[1] == 0:
                return
            if fault[1] > 0:
                fault[1] -= 1
            err = fault[0]
        raise OSError(err, f"injected {os.strerror(err)} on {op}")

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if self.direct_einval and flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "injected EINVAL on O_DIRECT open")
        if os.path.basename(path) == ".lock":
            if flags & (os.O_WRONLY | os.O_RDWR):
                self._check("open_lock")
        elif flags & (os.O_WRONLY | os.O_RDWR):
            self._check("open_write")
        return super().open(path, flags, mode)

    def write(self, fd: int, data: memoryview) -> int:
        self._check("write")
        if self.write_budget is not None:
            with self._lock:
                room = self.write_budget
                take = min(room, len(data))
                self.write_budget -= take
            if take == 0:
                raise OSError(errno.ENOSPC, "injected ENOSPC (write budget spent)")
            return super().write(fd, data[:take])
        return super().write(fd, data)

    def pwritev(self, fd: int, buffers, offset: int) -> int:  # type: ignore[no-untyped-def]
        """A vectored write counts as one ``write`` (same faults, same byte budget)."""
        self._check("write")
        if self.write_budget is not None:
            with self._lock:
                take = min(self.write_budget, sum(len(b) for b in buffers))
                self.write_budget -= take
            if take == 0:
                raise OSError(errno.ENOSPC, "injected ENOSPC (write budget spent)")
            cut, left = [], take
            for b in buffers:
                if left <= 0:
                    break
                cut.append(b[:left])
                left -= len(cut[-1])
            return super().pwritev(fd, cut, offset)
        return super().pwritev(fd, buffers, offset)

    def fsync(self, fd: int) -> None:
        self._check("fsync")
        super().fsync(fd)

    def replace(self, src: str, dst: str) -> None:
        self._check("replace")
        super().replace(src, dst)

    def mkdir(self, path: str) -> None:
        self._check("mkdir")
        super().mkdir(path)

    def unlink(self, path: str) -> None:
        self._check("unlink")
        super().unlink(path)

    def open_read(self, path: str, direct: bool) -> int:
        if direct and self.direct_einval:
            raise OSError(errno.EINVAL, "injected EINVAL on O_DIRECT open")
        self._check("open_read")
        return super().open_read(path, direct)

    def preadv(self, fd: int, buffers, offset: int) -> int:  # type: ignore[no-untyped-def]
        """A vectored read counts as one ``read``."""
        self._check("read")
        return super().preadv(fd, buffers, offset)
