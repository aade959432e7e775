"""O_DIRECT helpers shared by the disk tier's tests: whether a directory accepts O_DIRECT
writes, and page-aligned buffers for them."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from kvtier.serde.record import ALIGN


def o_direct_works(d: Path) -> bool:
    """True when ``d``'s file system accepts an O_DIRECT write of one aligned block (tmpfs does not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = d / ".o_direct_probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            os.write(fd, mmap.mmap(-1, ALIGN))
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def aligned(n: int, offset: int = 0) -> np.ndarray:
    """A uint8 array of ``n`` bytes whose address is page-aligned plus ``offset``."""
    mm = mmap.mmap(-1, n + offset + ALIGN)
    return np.frombuffer(mm, dtype=np.uint8)[offset : offset + n]
