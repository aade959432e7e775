"""Value types of the storage layer, shared by every caller (leaf module: imports nothing of kvtier).

Engine connectors, the cache service, its client and the (future) controller
all speak these types; none of them may import the storage manager just to
name a result.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

#: Tier labels a lookup reports, fastest first. ``cpu`` is the CPU DRAM tier; every
#: lower tier reports its ``kind`` (:class:`kvtier.tiers.base.LowerTier`).
TIER_KINDS: tuple[str, ...] = ("cpu", "disk", "remote", "peer")


class WriteSkip(enum.IntEnum):
    """Why ``open_write_many`` gave no buffer for a key.

    - ``PRESENT``: a tier already holds the chunk (nothing to store).
    - ``IN_FLIGHT``: another writer (this or another engine) holds an uncommitted
      reservation of it; the chain stays reachable once that writer commits, so a
      caller storing a prompt goes on with the rest of its chain.
    - ``NO_ROOM``: no CPU slot could be freed (or the store failed): the caller
      stops storing that chain (later chunks would be unreachable without it).
    """

    PRESENT = 1
    IN_FLIGHT = 2
    NO_ROOM = 3


@dataclass
class LookupResult:
    """Outcome of a lookup.

    Attributes:
        num_tokens: tokens of the longest cached prefix (a multiple of chunk_size,
            never the whole prompt: the engine computes at least the last token).
        keys: keys of the hit chunks, in prompt order (32-byte blake3 digests).
        tiers: for each hit chunk, the fastest tier kind that holds it (one of
            :data:`TIER_KINDS`).
    """

    num_tokens: int
    keys: list[bytes] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)


class ReadHandle(Protocol):
    """A chunk held for reading: ``buffer`` (uint8 ``[chunk_bytes]``) stays valid until ``close()``.

    ``source`` is the tier kind it was served from (promotion from a lower tier
    reports that tier's kind).
    """

    key: bytes
    buffer: np.ndarray
    source: str

    def close(self) -> None: ...
