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
    """What engine connectors call on a store (both implementations satisfy it; mypy checks
    wherever one is passed or returned as a ``KVStore``). Token-level calls (``keys``,
    ``lookup``, ``prefetch``) are :class:`~kvtier.storage.manager.StorageManager`'s own: a
    connector hashes tokens itself (:class:`~kvtier.index.keys.KeyNamespace`) and looks keys up.
    """

    def lookup_keys(self, keys: Sequence[bytes], lease_owner: str | None = None) -> LookupResult:
        """Longest prefix of ``keys`` held by any tier; leased to ``lease_owner`` if given."""

    def release(self, lease_owner: str) -> None:
        """End ``lease_owner``'s lease."""

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

    def open_read_many(self, items: Sequence[tuple[bytes, bytes | None]]) -> Sequence[ReadHandle | None]:
        """``open_read`` for many ``(key, parent)`` pairs, in order, in as few round trips as possible."""

    def clear(self) -> dict[str, int]:
        """Remove this namespace's chunks from every tier; chunks removed per tier."""

    def stats(self) -> dict[str, int | float]: ...

    def close(self) -> None: ...
