"""A ``kvtier server`` serving its chunks to peers: one peer listener for every hosted namespace.

An embedded connector's storage manager serves its own chunks on ``peer_listen``
(:func:`kvtier.transfer.peer_open.start_peer_server`). A server hosts one storage manager per
key namespace, and one listener each would bind ``peer_listen`` once per hosted model, so
the server runs one peer server over :class:`HostedChunks`, a read-only view of all of
them with the two calls a peer server makes (``where``, ``open_read_many``). Chunk keys
are rooted in their namespace's digest, so a key can only be held by its own namespace;
the view asks each hosted namespace in turn (at most ``--max-namespaces``, dictionary
lookups).

Invariant kept here: a namespace is never released (its shared segment unmapped) while a
peer read holds one of its chunks: each handle this view returns holds its namespace
(:meth:`kvtier.service.namespaces.NamespaceTable.hold`) until it is closed. CPU-tier chunks
are checked against their commit checksums (:meth:`NamespaceHost.open_verified`) before a
peer gets them; a mismatch is a miss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    import numpy as np

    from kvtier.service.namespaces import NamespaceTable
    from kvtier.storage.types import ReadHandle


@dataclass
class HeldRead:
    """A read handle of one hosted namespace that also holds that namespace until :meth:`close`.

    Attributes:
        key: the chunk key (bytes).
        buffer: the chunk payload, ``uint8 [chunk_bytes]`` (valid until :meth:`close`).
        source: the tier it was read from (``"cpu"``, ``"disk"``, ...).
    """

    handle: ReadHandle
    release: Callable[[], None]
    closed: bool = field(default=False)

    @property
    def key(self) -> bytes:
        return self.handle.key

    @property
    def buffer(self) -> np.ndarray:
        return self.handle.buffer

    @property
    def source(self) -> str:
        return self.handle.source

    def close(self) -> None:
        """Release the chunk, then the namespace (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.handle.close()
        finally:
            self.release()


class HostedChunks:
    """Every namespace a server hosts, as the store a peer server reads (thread-safe).

    Args:
        table: the server's :class:`~kvtier.service.namespaces.NamespaceTable`.
    """

    def __init__(self, table: "NamespaceTable"):
        self.table = table

    def where(self, key: bytes) -> str | None:
        """The local tier holding ``key`` in any hosted namespace (``"cpu"``, ``"disk"``), or None."""
        for host in self.table.hosts():
            try:
                tier = host.manager.where(key)
            except Exception:  # a namespace being released right now: not here
                continue
            if tier is not None:
                return tier
        return None

    def namespace_of(self, key: bytes) -> Any:
        """The :class:`~kvtier.index.keys.KeyNamespace` of the hosted namespace whose local tiers hold
        ``key``, or None (a peer server checks it against the asking member's ``models``)."""
        for host in self.table.hosts():
            try:
                if host.manager.where(key) is not None:
                    return host.namespace
            except Exception:  # a namespace being released right now: not here
                continue
        return None

    def lineage_of(self, key: bytes) -> bytes | None:
        """The lineage marker ``key``'s chain starts from, in the namespace holding it (None: unknown)."""
        for host in self.table.hosts():
            try:
                if host.manager.where(key) is not None:
                    return host.manager.lineage_of(key)
            except Exception:
                continue
        return None

    def open_read_many(self, items: Sequence[tuple[bytes, bytes | None]]) -> list[HeldRead | None]:
        """Open each ``(key, parent)`` in the namespace that holds it; None where none does.

        Every returned handle must be closed (it holds its namespace until then).
        """
        out: list[HeldRead | None] = [None] * len(items)
        todo = list(range(len(items)))
        held = self.table.hold_all()
        for n, (digest, host, release) in enumerate(held):
            if not todo:
                for _, _, rest in held[n:]:
                    rest()
                break
            try:
                mine = [i for i in todo if host.manager.where(items[i][0]) is not None]
                handles = host.open_verified([items[i] for i in mine]) if mine else []
            except Exception:
                release()
                continue
            for i, h in zip(mine, handles):
                if h is not None:
                    out[i] = HeldRead(h, self.table.hold_again(digest))
            release()
            todo = [i for i in todo if out[i] is None]
        return out
