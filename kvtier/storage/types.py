"""Value types of the storage layer, shared by every caller (a leaf of the storage package: it
imports only the CPU tier's ``WriteSkip``, below it in the layering).

Engine connectors, the cache service, its client and the (future) controller
all speak these types; none of them may import the storage manager just to
name a result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Self

import numpy as np

from kvtier.tiers.cpu import WriteSkip as WriteSkip  # re-exported: the CPU tier's reservation outcomes

#: Tier labels a lookup reports, fastest first. ``cpu`` is the CPU DRAM tier; every
#: lower tier reports its ``kind`` (:class:`kvtier.tiers.base.LowerTier`).
TIER_KINDS: tuple[str, ...] = ("cpu", "disk", "remote", "peer")


@dataclass
class LookupResult:
    """Outcome of a lookup.

    Attributes:
        num_tokens: tokens of the longest cached prefix (a multiple of chunk_size,
            never the whole prompt: the engine computes at least the last token).
        keys: keys of the hit chunks, in prompt order (32-byte blake3 digests).
        tiers: for each hit chunk, the fastest tier kind that holds it (one of
            :data:`TIER_KINDS`).
        repeated: leading hit chunks the same lease owner's live lease already held: a
            repeated lookup of one request (vLLM repeats it after each failed block
            allocation). Hit counters count ``keys[repeated:]`` only, so a request's hit
            counts once (set by the storage manager; 0 from a remote answer).
    """

    num_tokens: int
    keys: list[bytes] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)
    repeated: int = 0


class ChunkUnavailable(RuntimeError):
    """Raised by a read handle's ``buffer`` when the chunk failed a check made as it was read
    (a ``kvtier server`` client that verifies loads itself): treat it as a miss from that chunk on."""


class ReadHandle(Protocol):
    """A chunk held for reading: ``buffer`` (uint8 ``[chunk_bytes]``) stays valid until ``close()``.

    ``source`` is the tier kind it was served from (promotion from a lower tier
    reports that tier's kind).
    """

    key: bytes
    source: str

    @property
    def buffer(self) -> np.ndarray: ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None:
        """``close()``."""
