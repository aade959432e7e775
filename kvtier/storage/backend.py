"""The storage interface an engine connector programs against.

Implemented by :class:`kvtier.storage.manager.StorageManager` (embedded tiers in
the engine's process) and by :class:`kvtier.service.client.ServiceClient` (tiers
in a standalone ``kvtier server`` shared by every engine on the machine).
Buffers are ``uint8 [chunk_bytes]`` numpy arrays the caller copies into or out
of; no method raises for a tier failure (it is a miss, or a skipped store).
Request accounting (where a request's tokens came from) is the connector's, not
the store's.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from kvtier.storage.types import LookupResult, ReadHandle, WriteSkip


class KVStore(Protocol):
    chunk_bytes: int

    def keys(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """Chunk keys (32-byte digests) of every full chunk of ``tokens``."""

    def lookup(
        self,
        tokens: Sequence[int],
        cache_salt: str | None = None,
        lease_owner: str | None = None,
        keys: Sequence[bytes] | None = None,
    ) -> LookupResult:
        """Longest cached prefix of ``tokens`` (never the whole prompt); leased to ``lease_owner`` if given."""

    def lookup_keys(self, keys: Sequence[bytes], lease_owner: str | None = None) -> LookupResult:
        """Longest prefix of ``keys`` held by any tier; leased to ``lease_owner`` if given."""

    def release(self, lease_owner: str) -> None:
        """End ``lease_owner``'s lease."""

    def contains(self, key: bytes) -> bool:
        """True if the CPU or a local lower tier holds ``key`` (never a remote round trip)."""

    def where(self, key: bytes) -> str | None:
        """Fastest local tier kind holding ``key`` (``"cpu"``, ``"disk"``), or None."""

    def open_write(self, key: bytes, parent: bytes | None) -> np.ndarray | None:
        """A buffer to fill for ``key``, or None (already stored, being written, or no room)."""

    def open_write_many(
        self, keys: Sequence[bytes], parents: Sequence[bytes | None]
    ) -> list[np.ndarray | WriteSkip]:
        """Per key a buffer to fill, or why not (:class:`WriteSkip`), in as few round trips as possible.

        ``parents`` (required, one per key; None for a prompt's first chunk): the key
        each will be committed with; room is never made by evicting it, so a chunk
        stored after a hit never evicts the chunks it extends.

        Raises:
            ValueError: ``parents`` is missing or not as long as ``keys``.
        """

    def commit(self, key: bytes, parent: bytes | None) -> None:
        """Publish a buffer filled after ``open_write``."""

    def abort(self, key: bytes) -> None:
        """Drop a buffer reserved by ``open_write``."""

    def open_read(self, key: bytes, parent: bytes | None = None) -> ReadHandle | None:
        """Hold ``key`` for reading (``.buffer``, ``.source``, ``.close()``), or None on a miss."""

    def open_read_many(self, items: Sequence[tuple[bytes, bytes | None]]) -> list[ReadHandle | None]:
        """``open_read`` for many ``(key, parent)`` pairs, in order, in as few round trips as possible."""

    def prefetch(self, tokens: Sequence[int], cache_salt: str | None = None) -> int:
        """Queue promotion of a prompt's lower-tier chunks; returns chunks queued."""

    def flush(self, timeout_s: float | None = None) -> bool: ...

    def clear(self) -> dict[str, int]:
        """Remove this namespace's chunks from every tier; chunks removed per tier."""

    def stats(self) -> dict[str, int | float]: ...

    def close(self) -> None: ...
