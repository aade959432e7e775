"""The memory state every side of ``kvtier bench peers`` starts each timed put from (stdlib only).

On these VMs buffered writes run 0.5-1 GB/s when the kernel must find fresh
pages and 4-5 GB/s right after a process freed memory, so before every timed
put each side, kvtier's, LMCache's and the baselines', calls :func:`before_put`:
``os.sync()`` (flush earlier dirty pages, untimed), then touch and unmap
``free_bytes`` of fresh anonymous memory. Standard library only: the LMCache
driver (:mod:`kvtier.bench.lmcache_driver`) imports this file from LMCache's
own virtual environment, where kvtier is not installed.
"""

from __future__ import annotations

import mmap
import os

def free_fresh_memory(nbytes: int) -> None:
    """Touch ``nbytes`` of new anonymous memory page by page, then unmap it (no-op for <= 0)."""
    if nbytes <= 0:
        return
    m = mmap.mmap(-1, nbytes)
    try:
        for off in range(0, nbytes, mmap.PAGESIZE):
            m[off] = 1
    finally:
        m.close()


def before_put(free_bytes: int) -> None:
    """Untimed, before every timed put: flush dirty pages, then free ``free_bytes`` of fresh memory."""
    os.sync()
    free_fresh_memory(free_bytes)
