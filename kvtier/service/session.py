"""What one client connection holds, and the table of live connections.

Invariants (each :class:`Holds` is touched only by its connection's own thread;
:meth:`SessionTable.drop` runs exactly once per connection):

- Everything a connection holds is listed in its :class:`Holds`: slots it
  reserved (``writes``), read references (``reads``) and lease owners it was
  granted (``owners``). When the connection ends, for whatever reason (clean
  close, crash, SIGKILL, protocol abuse), each is released: reservations are
  aborted, read references dropped, leases ended. Committed chunks stay.
- A client can commit, abort or unload only what its own connection holds.
- ``len(writes) + len(reads) <= max_holds`` per connection, and every
  connection of one client id together stays within that id's quota
  (:mod:`kvtier.service.quotas`): one client cannot pin the pool.
- A reservation older than the reservation timeout is aborted by the server's
  maintenance thread (its slot is freed); a late commit gets ``EXPIRED``.
- Read handle ids are unique per connection: every id in ``reads`` is below
  ``next_handle``.
- A connection leaves the table only after its holds are released, so a table
  with no sessions means nothing is held.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

from kvtier.storage.types import ReadHandle

if TYPE_CHECKING:
    from kvtier.service.namespace_host import NamespaceHost
    from kvtier.service.quotas import ClientQuota

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

    Its connection's thread takes and gives back holds; the server's maintenance
    thread may expire old reservations (:meth:`expire_reservations`), so changes
    to ``writes`` happen under ``lock``.

    Attributes:
        max_holds: bound on ``len(writes) + len(reads)`` (per connection).
        writes: key -> reserved slot index.
        reads: handle id -> read reference.
        owners: lease owners granted on this connection (already prefixed), oldest
            first; at most :data:`MAX_OWNERS` (the oldest lease is ended beyond).
        next_handle: the id the next read reference gets.
        quota: the client id's quota (shared by its connections; None until
            ``register``). Every reservation and read reference here is counted
            in it.
        reserved_at: key -> monotonic time (s) of its reservation.
        expired: keys whose reservation timed out (a late commit gets a clear
            error); at most ``max_holds`` remembered.
    """

    max_holds: int
    writes: dict[bytes, int] = field(default_factory=dict)
    reads: dict[int, ReadHandle] = field(default_factory=dict)
    owners: dict[str, None] = field(default_factory=dict)  # insertion-ordered set
    next_handle: int = 1
    quota: "ClientQuota | None" = None
    reserved_at: dict[bytes, float] = field(default_factory=dict)
    expired: dict[bytes, None] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def count(self) -> int:
        """Reservations plus read references held now."""
        return len(self.writes) + len(self.reads)

    def room(self) -> int:
        """How many more reservations or reads this connection may take."""
        return self.max_holds - self.count

    def add_read(self, handle: ReadHandle) -> int:
        """Record a read reference (its quota already taken); returns its handle id."""
        hid = self.next_handle
        self.next_handle += 1
        self.reads[hid] = handle
        assert self.count <= self.max_holds, "holds over the per-client bound"
        return hid

    def pop_read(self, hid: int) -> ReadHandle | None:
        """Forget read reference ``hid`` (the caller closes it) and give its quota back."""
        handle = self.reads.pop(hid, None)
        if handle is not None and self.quota is not None:
            self.quota.give(1)
        return handle

    def add_write(self, key: bytes, slot: int, now: float | None = None) -> None:
        """Record a reservation (its quota already taken)."""
        with self.lock:
            assert key not in self.writes, "a key reserved twice by one connection"
            self.writes[key] = slot
            self.reserved_at[key] = time.monotonic() if now is None else now
            self.expired.pop(key, None)
            assert self.count <= self.max_holds, "holds over the per-client bound"

    def pop_write(self, key: bytes) -> int | None:
        """Forget reservation ``key`` (the caller commits or aborts it) and give its quota back.

        Returns its slot, or None if this connection does not hold it.
        """
        with self.lock:
            slot = self.writes.pop(key, None)
            self.reserved_at.pop(key, None)
        if slot is not None and self.quota is not None:
            self.quota.give(1)
        return slot

    def was_expired(self, key: bytes) -> bool:
        """True if ``key``'s reservation here was aborted by the reservation timeout."""
        with self.lock:
            return self.expired.pop(key, 0) is None

    def expire_reservations(self, older_than: float, store: LeaseStore) -> int:
        """Abort reservations taken before monotonic time ``older_than``; returns how many.

        Runs on the maintenance thread; the slot goes back to the pool and a late
        commit of the key gets ``EXPIRED``.
        """
        with self.lock:
            old = [k for k, t in self.reserved_at.items() if t < older_than]
            for k in old:
                del self.writes[k]
                del self.reserved_at[k]
                _quiet(lambda: store.abort(k))
                self.expired[k] = None
            while len(self.expired) > self.max_holds:
                del self.expired[next(iter(self.expired))]
        if old and self.quota is not None:
            self.quota.give(len(old))
        return len(old)

    def add_owner(self, owner: str, store: LeaseStore) -> None:
        """Track a lease owner granted on this connection (ends the oldest beyond :data:`MAX_OWNERS`)."""
        self.owners.pop(owner, None)
        self.owners[owner] = None
        while len(self.owners) > MAX_OWNERS:
            oldest = next(iter(self.owners))
            del self.owners[oldest]
            _quiet(lambda: store.release(oldest))
            if self.quota is not None:
                self.quota.set_lease(oldest, 0)

    def check_invariants(self) -> None:
        """Assert the module invariants that one connection's holds can show."""
        assert self.count <= self.max_holds, f"{self.count} holds > bound {self.max_holds}"
        assert all(0 < h < self.next_handle for h in list(self.reads)), "read handle id out of range"
        assert len(self.owners) <= MAX_OWNERS, "lease owners over the bound"
        assert all(slot >= 0 for slot in list(self.writes.values())), "negative reserved slot"
        if self.quota is not None:
            assert self.quota.holds <= self.quota.limits.max_holds, "client id over its holds quota"

    def release_all(self, store: LeaseStore) -> tuple[int, int, int]:
        """Abort reservations, close reads, end leases; returns the three counts released.

        A failing release is logged and skipped (the rest is still released).
        """
        with self.lock:
            counts = (len(self.writes), len(self.reads), len(self.owners))
            for key in list(self.writes):
                _quiet(lambda: store.abort(key))
            self.writes.clear()
            self.reserved_at.clear()
        for handle in list(self.reads.values()):
            _quiet(handle.close)
        for owner in list(self.owners):
            _quiet(lambda: store.release(owner))
            if self.quota is not None:
                self.quota.set_lease(owner, 0)
        self.reads.clear()
        self.owners.clear()
        if self.quota is not None:
            self.quota.give(counts[0] + counts[1])
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
    """Live sessions by id (thread-safe).

    Args:
        max_clients: sessions open at once, registered or not (more are refused).
        max_holds: each session's bound on reservations plus read references.
        max_registered: sessions that may have registered (or be registering) at
            once (:meth:`claim_registration`); default ``max_clients``.
    """

    def __init__(self, max_clients: int, max_holds: int, max_registered: int | None = None):
        self.max_clients = max_clients
        self.max_holds = max_holds
        self.max_registered = max_clients if max_registered is None else max_registered
        self._sessions: dict[int, Session] = {}
        self._registered: set[int] = set()  # sids holding a registration place
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

    def claim_registration(self, s: Session) -> bool:
        """Take a registration place for ``s`` (True if it has one); False when
        ``max_registered`` other sessions hold theirs."""
        with self._lock:
            if s.sid not in self._registered:
                if len(self._registered) >= self.max_registered:
                    return False
                self._registered.add(s.sid)
            return True

    def unclaim_registration(self, s: Session) -> None:
        """Give back ``s``'s registration place (its register failed)."""
        with self._lock:
            self._registered.discard(s.sid)

    def registered(self) -> int:
        """Sessions holding a registration place."""
        with self._lock:
            return len(self._registered)

    def remove(self, s: Session) -> None:
        """Take ``s`` out of the table (after its holds are released), with its registration place."""
        assert s.holds.count == 0 and not s.holds.owners, "session removed while holding"
        with self._lock:
            self._sessions.pop(s.sid, None)
            self._registered.discard(s.sid)

    def snapshot(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def total_holds(self) -> int:
        return sum(s.holds.count for s in self.snapshot())

    def check_invariants(self) -> None:
        """Assert every session's holds invariants and the client bounds."""
        sessions = self.snapshot()
        assert len(sessions) <= self.max_clients
        assert self.registered() <= self.max_registered, "registered sessions over max_registered"
        for s in sessions:
            s.holds.check_invariants()


def _quiet(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:
        log.debug("kvtier server: release step failed", exc_info=True)
