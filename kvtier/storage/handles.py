"""Read handles the storage manager hands out (implementations of :class:`kvtier.storage.types.ReadHandle`)."""

from __future__ import annotations

import numpy as np

from kvtier.tiers.cpu import CpuTier


class CpuReadHandle:
    """A chunk held for reading: ``buffer`` (uint8 ``[chunk_bytes]``) stays valid until ``close()``.

    Holds one read reference of a CPU slot (``tier`` given), or a private buffer
    (``tier`` None: a lower-tier hit that could not be promoted because no CPU slot
    could be freed). ``source`` is the tier kind it was served from.
    """

    __slots__ = ("_tier", "key", "buffer", "source")

    def __init__(self, tier: CpuTier | None, key: bytes, buffer: np.ndarray, source: str):
        self._tier: CpuTier | None = tier
        self.key = key
        self.buffer = buffer
        self.source = source

    def close(self) -> None:
        """Drop the read reference (idempotent)."""
        if self._tier is not None:
            self._tier.release(self.key)
            self._tier = None

    def __enter__(self) -> "CpuReadHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def acquire_handle(cpu: CpuTier, key: bytes, source: str = "cpu") -> CpuReadHandle | None:
    """A handle on ``key``'s committed CPU slot, or None when the CPU tier lacks it."""
    buf = cpu.acquire(key)
    return CpuReadHandle(cpu, key, buf, source) if buf is not None else None
