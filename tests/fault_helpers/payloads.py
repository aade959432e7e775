"""Deterministic chunk keys and payloads, shared by the crash-test writer and its checker.

The checker re-derives every payload from its key, so it can verify the bytes of
any chunk a killed writer left behind without the writer having to report them.
"""

from __future__ import annotations

import hashlib

import numpy as np

#: Namespace digest used by the crash tests (any 32 bytes; both sides must agree).
CRASH_NS = hashlib.blake2b(b"kvtier crash-test namespace", digest_size=32).digest()


def key_for(seed: int, i: int) -> bytes:
    """32-byte key of the ``i``-th chunk of writer ``seed``."""
    return hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=32).digest()


def size_for(key: bytes) -> int:
    """Payload bytes for ``key``: mostly 1 B..48 KiB, one in 16 between 512 KiB and 2 MiB.

    The large ones widen the window in which a kill lands mid-write; the odd
    lengths exercise direct-I/O padding.
    """
    r = int.from_bytes(key[:4], "little")
    if key[4] % 16 == 0:
        return (512 << 10) + r % (1536 << 10)
    return 1 + r % (48 << 10)


def payload_for_key(key: bytes) -> np.ndarray:
    """Deterministic uint8 payload of ``size_for(key)`` bytes."""
    rng = np.random.default_rng(int.from_bytes(key[8:16], "little"))
    return rng.integers(0, 256, size_for(key), dtype=np.uint8)
