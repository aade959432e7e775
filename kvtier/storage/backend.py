"""The storage interface an engine connector programs against.

Implemented by :class:`kvtier.storage.manager.StorageManager` (embedded tiers in
the engine's process) and by the cache service client (tiers in a standalone
``kvtier server`` shared by every engine on the machine). Buffers are
``uint8 [chunk_bytes]`` numpy arrays the caller copies into or out of; no
method raises for a tier failure (it is a miss, or a skipped store).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from kvtier.storage.manager import LookupResult, ReadHandle, RequestRecord


class KVStore(Protocol):
    chunk_bytes: int

    def lookup_keys(self, keys: Sequence[bytes], lease_owner: str | None = None) -> LookupResult:
        """Longest prefix of ``keys`` held by any tier; leased to ``lease_owner`` if given."""

    def release(self, lease_owner: str) -> None:
        """End ``lease_owner``'s lease."""

    def contains(self, key: bytes) -> bool: ...

    def open_write(self, key: bytes) -> np.ndarray | None:
        """A buffer to fill for ``key``, or None (already stored, or no room)."""

    def open_write_many(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """``open_write`` for many distinct keys, in order, in as few round trips as possible."""

    def commit(self, key: bytes, parent: bytes | None = None) -> None:
        """Publish a buffer filled after ``open_write``."""

    def abort(self, key: bytes) -> None:
        """Drop a buffer reserved by ``open_write``."""

    def open_read(self, key: bytes, parent: bytes | None = None) -> ReadHandle | None:
        """Hold ``key`` for reading (``.buffer``, ``.source``, ``.close()``), or None on a miss."""

    def open_read_many(self, items: Sequence[tuple[bytes, bytes | None]]) -> list[ReadHandle | None]:
        """``open_read`` for many ``(key, parent)`` pairs, in order, in as few round trips as possible."""

    def record_request(self, request_id: str, record: RequestRecord) -> None: ...

    def record_load(self, request_id: str, tier: str, num_tokens: int) -> None: ...

    def record_load_failure(self) -> None: ...

    def flush(self, timeout_s: float | None = None) -> bool: ...

    def stats(self) -> dict[str, int | float]: ...

    def close(self) -> None: ...
