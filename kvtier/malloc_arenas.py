"""Bounding glibc's malloc arenas in a long-running kvtier process whose threads handle large requests.

glibc gives a thread that finds the heap busy an arena of its own (up to 8 per core), and memory
freed in an arena stays with it: a process whose worker threads each parse and tokenize large
request bodies keeps the high-water mark of every arena, so its RSS grows with the number of
threads that ever held a large body, not with what it holds now
(https://www.gnu.org/software/libc/manual/html_node/Memory-Allocation-Tunables.html,
``glibc.malloc.arena_max``). Measured in ``kvtier bench soak-fleet`` (10 minutes, the router loading
SmolLM2's tokenizer, the hostile client's 16 MiB bodies and huge prompts): the router's RSS rose
from 556 MiB warm to 726 MiB with glibc's default, and stayed between 497 and 566 MiB with two arenas.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

#: ``mallopt`` parameter number of the arena limit (glibc's malloc.h).
M_ARENA_MAX = -8
#: Arenas a router keeps: the event loop's and one for all its worker threads.
DEFAULT_ARENAS = 2


def limit_arenas(arenas: int = DEFAULT_ARENAS) -> bool:
    """Cap this process's malloc arenas at ``arenas`` (``mallopt(M_ARENA_MAX)``); call it before
    the process starts its threads. An operator's ``MALLOC_ARENA_MAX`` wins (nothing is changed).

    Returns:
        True if the cap was set; False where the C library is not glibc, or the variable is set.

    Raises:
        ValueError: ``arenas`` below 1.
    """
    if arenas < 1:
        raise ValueError(f"arenas must be >= 1, got {arenas}")
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # only glibc has it (musl has mallopt without arenas)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(M_ARENA_MAX, arenas) == 1
    if not ok:
        log.info("kvtier: mallopt(M_ARENA_MAX, %d) was refused; the C library's default stays", arenas)
    return ok
