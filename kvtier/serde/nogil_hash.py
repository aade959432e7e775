"""xxh3-64 without holding the GIL: the xxhash package's own ``XXH3_64bits`` through ctypes.

ctypes releases the GIL for the duration of a foreign call, so a thread hashing a
chunk here lets the process's other threads run Python meanwhile (I/O threads
returning from ``preadv``, a caller copying the previous chunk). The library is the
one the ``xxhash`` package ships (same algorithm and version, so the same digests as
``xxhash.xxh3_64_intdigest`` / ``xxh3_64_digest``); where its symbol cannot be called,
the package's own function is used (with the GIL).
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

import numpy as np
import xxhash

from kvtier.serde.base import byte_view


def _symbol() -> Callable[[int, int], int] | None:
    try:
        from xxhash import _xxhash  # type: ignore[attr-defined]

        fn: Any = ctypes.CDLL(_xxhash.__file__).XXH3_64bits
    except (ImportError, OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    probe = b"kvtier xxh3 probe"
    buf = ctypes.create_string_buffer(probe, len(probe))
    if fn(ctypes.addressof(buf), len(probe)) != xxhash.xxh3_64_intdigest(probe):  # a different library: not ours
        return None
    return fn


_XXH3 = _symbol()
#: True when hashing runs without the GIL (the package's C symbol is callable).
AVAILABLE = _XXH3 is not None


def xxh3_64_int(buf: Any) -> int:
    """xxh3-64 of ``buf``'s bytes (any buffer; a C-contiguous one is hashed in place without the GIL)."""
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    if _XXH3 is None:
        return xxhash.xxh3_64_intdigest(byte_view(arr).cast("B"))
    return int(_XXH3(arr.ctypes.data, arr.nbytes))


def xxh3_64_digest(buf: Any) -> bytes:
    """The 8-byte canonical (big-endian) digest, as ``xxhash.xxh3_64_digest``."""
    return xxh3_64_int(buf).to_bytes(8, "big")
