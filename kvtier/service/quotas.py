"""Per-client-id quotas of the cache service (one client cannot starve the others).

A client id (``Register.client_id``) may open many connections; its quota is
shared by all of them, so opening more connections buys no more of the pool.

Counted per client id, against limits taken from the namespace's pool size:

- ``holds``: reservations plus read references held now (every connection of
  the client together), at most ``max_holds``;
- ``leased``: chunks pinned by the client's leases (``lookup`` with an owner),
  at most ``max_leased``. A lookup beyond it is narrowed to what still fits (the
  rest is a miss, not pinned).

Invariants (under ``ClientQuota._lock``): ``0 <= holds <= max_holds``;
``leased == sum(lease_sizes.values()) <= max_leased``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class QuotaLimits:
    """What one client id may hold at once.

    Attributes:
        max_holds: reservations plus read references (slots).
        max_leased: chunks pinned by its leases.
    """

    max_holds: int
    max_leased: int

    @classmethod
    def for_pool(cls, num_slots: int, hold_share: float, lease_share: float, cap_holds: int) -> "QuotaLimits":
        """Limits as shares of a pool of ``num_slots`` (each at least 1; holds at most ``cap_holds``)."""
        return cls(
            max_holds=max(1, min(cap_holds, int(num_slots * hold_share))),
            max_leased=max(1, int(num_slots * lease_share)),
        )


@dataclass
class ClientQuota:
    """What one client id holds now, across all its connections (thread-safe)."""

    client_id: str
    limits: QuotaLimits
    holds: int = 0
    leased: int = 0
    lease_sizes: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def take_upto(self, n: int) -> int:
        """Take as many of ``n`` holds as fit; returns how many were taken (0 to ``n``)."""
        with self._lock:
            got = max(0, min(n, self.limits.max_holds - self.holds))
            self.holds += got
            return got

    def give(self, n: int) -> None:
        """Give back ``n`` holds."""
        if n <= 0:
            return
        with self._lock:
            self.holds -= n
            assert self.holds >= 0, "client holds went negative"

    def lease_room(self, owner: str, alive: Callable[[str], int]) -> int:
        """Chunks ``owner`` may lease now (its previous lease is replaced, so its size counts as room).

        ``alive(owner)`` is the live size of a lease (0 once it ended by TTL or
        elsewhere); stale entries are dropped when the quota looks full.
        """
        with self._lock:
            room = self.limits.max_leased - self.leased + self.lease_sizes.get(owner, 0)
            if room >= self.limits.max_leased:
                return room
            for o, n in list(self.lease_sizes.items()):
                live = alive(o)
                if live != n:
                    self._set_locked(o, live)
            return self.limits.max_leased - self.leased + self.lease_sizes.get(owner, 0)

    def set_lease(self, owner: str, n: int) -> None:
        """Record that ``owner``'s lease now pins ``n`` chunks (0: ended)."""
        with self._lock:
            self._set_locked(owner, n)

    def _set_locked(self, owner: str, n: int) -> None:
        self.leased += n - self.lease_sizes.pop(owner, 0)
        if n:
            self.lease_sizes[owner] = n
        assert 0 <= self.leased, "leased chunks went negative"


class QuotaTable:
    """Quotas by client id, shared by the sessions of one id (thread-safe).

    An entry lives while a session of its id is registered (``attach`` /
    ``detach`` count sessions), so the table is bounded by ``max_clients``.
    """

    def __init__(self) -> None:
        self._quotas: dict[tuple[bytes, str], tuple[ClientQuota, int]] = {}
        self._lock = threading.Lock()

    def attach(self, scope: bytes, client_id: str, limits: QuotaLimits) -> ClientQuota:
        """The quota of ``client_id`` within ``scope`` (a namespace digest), counting one more session."""
        with self._lock:
            q, n = self._quotas.get((scope, client_id), (None, 0))
            if q is None:
                q = ClientQuota(client_id, limits)
            self._quotas[(scope, client_id)] = (q, n + 1)
            return q

    def detach(self, scope: bytes, client_id: str) -> None:
        """One session of ``client_id`` ended (after giving back its holds)."""
        with self._lock:
            q, n = self._quotas.get((scope, client_id), (None, 0))
            if q is None:
                return
            if n <= 1:
                del self._quotas[(scope, client_id)]
            else:
                self._quotas[(scope, client_id)] = (q, n - 1)

    def get(self, scope: bytes, client_id: str) -> ClientQuota | None:
        with self._lock:
            got = self._quotas.get((scope, client_id))
            return None if got is None else got[0]

    def __len__(self) -> int:
        with self._lock:
            return len(self._quotas)
