"""What one client connection holds, and the table of live connections.

Invariants (each :class:`Holds` is touched only by its connection's own thread;
:meth:`SessionTable.drop` runs exactly once per connection):

- Everything a connection holds is listed in its :class:`Holds`: slots it
  reserved (``writes``), read references (``reads``) and lease owners it was
  granted (``owners``). When the connection ends, for whatever reason (clean
  close, crash, SIGKILL, protocol abuse), each is released: reservations are
  aborted, read references dropped, leases ended. Committed chunks stay.
- A client can commit, abort or unload only what its own connection holds.
- ``len(writes) + len(reads) <= max_holds`` (one client cannot pin the pool).
- Read handle ids are unique per connection: every id in ``reads`` is below
  ``next_handle``.
- A connection leaves the table only after its holds are released, so a table
  with no sessions means nothing is held.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

from kvtier.storage.types import ReadHandle

if TYPE_CHECKING:
    from kvtier.service.namespace_host import NamespaceHost

log = logging.getLogger(__name__)

#: Lease owners one connection tracks; beyond this the oldest lease is ended
#: (65,536 lookups ago: its load is long done or the request is gone).
MAX_OWNERS = 65_536


class LeaseStore(Protocol):
    """What releasing a connection's holds needs of a storage manager."""

    def abort(self, key: bytes) -> None: ...

    def release(self, lease_owner: str) -> None: ...


@dataclass
class Holds:
    """Reservations, read references and lease owners of one connection.

    Attributes:
        max_holds: bound on ``len(writes) + len(reads)``.
        writes: key -> reserved slot index.
        reads: handle id -> read reference.
        owners: lease owners granted on this connection (already prefixed), oldest
            first; at most :data:`MAX_OWNERS` (the oldest lease is ended beyond).
        next_handle: the id the next read reference gets.
    """

    max_holds: int
    writes: dict[bytes, int] = field(default_factory=dict)
    reads: dict[int, ReadHandle] = field(default_factory=dict)
    owners: dict[str, None] = field(default_factory=dict)  # insertion-ordered set
    next_handle: int = 1

    @property
    def count(self) -> int:
        """Reservations plus read references held now."""
        return len(self.writes) + len(self.reads)

    def room(self) -> int:
        """How many more reservations or reads this connection may take."""
        return self.max_holds - self.count

    def add_read(self, handle: ReadHandle) -> int:
        """Record a read reference; returns its handle id."""
        hid = self.next_handle
        self.next_handle += 1
        self.reads[hid] = handle
        assert self.count <= self.max_holds, "holds over the per-client bound"
        return hid

    def add_write(self, key: bytes, slot: int) -> None:
        assert key not in self.writes, "a key reserved twice by one connection"
        self.writes[key] = slot
        assert self.count <= self.max_holds, "holds over the per-client bound"

    def add_owner(self, owner: str, store: LeaseStore) -> None:
        """Track a lease owner granted on this connection (ends the oldest beyond :data:`MAX_OWNERS`)."""
        self.owners.pop(owner, None)
        self.owners[owner] = None
        while len(self.owners) > MAX_OWNERS:
            oldest = next(iter(self.owners))
            del self.owners[oldest]
            _quiet(lambda: store.release(oldest))

    def check_invariants(self) -> None:
        """Assert the module invariants that one connection's holds can show."""
        assert self.count <= self.max_holds, f"{self.count} holds > bound {self.max_holds}"
        assert all(0 < h < self.next_handle for h in list(self.reads)), "read handle id out of range"
        assert len(self.owners) <= MAX_OWNERS, "lease owners over the bound"
        assert all(slot >= 0 for slot in list(self.writes.values())), "negative reserved slot"

    def release_all(self, store: LeaseStore) -> tuple[int, int, int]:
        """Abort reservations, close reads, end leases; returns the three counts released.

        A failing release is logged and skipped (the rest is still released).
        """
        counts = (len(self.writes), len(self.reads), len(self.owners))
        for key in list(self.writes):
            _quiet(lambda: store.abort(key))
        for handle in list(self.reads.values()):
            _quiet(handle.close)
        for owner in list(self.owners):
            _quiet(lambda: store.release(owner))
        self.writes.clear()
        self.reads.clear()
        self.owners.clear()
        return counts


@dataclass
class Registered:
    """A client that registered: its namespace host is fixed and never None.

    Attributes:
        host: the tiers of the client's key namespace.
        client_id / pid: the client's identity (for logs).
        prefix: prepended to lease owners, so two engines' request ids never
            collide while an engine's scheduler and worker (same client id) share
            leases.
    """

    host: "NamespaceHost"
    client_id: str
    pid: int
    prefix: str


@dataclass
class Session:
    """One client connection: its socket, its holds, and its registration (None until ``register``)."""

    sid: int
    sock: socket.socket
    kind: str  # "unix" or "tcp"
    holds: Holds
    registered: Registered | None = None


class SessionTable:
    """Live sessions by id, bounded by ``max_clients`` (thread-safe)."""

    def __init__(self, max_clients: int, max_holds: int):
        self.max_clients = max_clients
        self.max_holds = max_holds
        self._sessions: dict[int, Session] = {}
        self._lock = threading.Lock()
        self._next_sid = 1

    def open(self, sock: socket.socket, kind: str) -> Session | None:
        """A new session for ``sock``, or None when ``max_clients`` are connected."""
        with self._lock:
            if len(self._sessions) >= self.max_clients:
                return None
            s = Session(self._next_sid, sock, kind, Holds(self.max_holds))
            self._next_sid += 1
            self._sessions[s.sid] = s
            return s

    def remove(self, s: Session) -> None:
        """Take ``s`` out of the table (after its holds are released)."""
        assert s.holds.count == 0 and not s.holds.owners, "session removed while holding"
        with self._lock:
            self._sessions.pop(s.sid, None)

    def snapshot(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def total_holds(self) -> int:
        return sum(s.holds.count for s in self.snapshot())

    def add_owner(self, owner: str, store: LeaseStore) -> None:
        """Track a lease owner granted on this connection (ends the oldest beyond :data:`MAX_OWNERS`)."""
        self.owners.pop(owner, None)
        self.owners[owner] = None
        while len(self.owners) > MAX_OWNERS:
            oldest = next(iter(self.owners))
            del self.owners[oldest]
            _quiet(lambda: store.release(oldest))

    def check_invariants(self) -> None:
        """Assert every session's holds invariants and the client bound."""
        sessions = self.snapshot()
        assert len(sessions) <= self.max_clients
        for s in sessions:
            s.holds.check_invariants()


def _quiet(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:
        log.debug("kvtier server: release step failed", exc_info=True)
