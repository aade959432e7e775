"""Leases: a lookup that will be followed by a load pins its chunks until then.

Invariants (kept under ``self._lock``):
- ``_pins[key]`` equals the number of live leases that list ``key``; a key with
  a positive count is never evicted from any tier.
- A lease ends exactly once: on ``release`` (load done, request finished or
  aborted), when replaced by a new lease with the same id (the scheduler asked
  again), or when its TTL expires (``reap``). Ending a lease decrements the pin
  of each of its keys, so no pin outlives its lease.

Each lease has its own TTL (``grant(..., ttl_s=...)``; the table's by default;
None: never expires). Operator pins (:mod:`kvtier.storage.instance_ops`) are
leases whose owner is :data:`PIN_PREFIX` + the pin id.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

#: Owner prefix of operator pins (``"pin:" + pin_id``); request leases never use it.
PIN_PREFIX = "pin:"

_TABLE_TTL = object()  # sentinel: the table's default TTL


@dataclass(slots=True)
class Lease:
    keys: tuple[bytes, ...]
    expires_at: float


class LeaseTable:
    """Leases by owner id (a request id) with a TTL in seconds.

    Args:
        ttl_s: seconds after which an unreleased lease expires.
        clock: monotonic clock (injectable for tests).
    """

    def __init__(self, ttl_s: float = 300.0, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0:
            raise ValueError(f"lease TTL must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._pins: dict[bytes, int] = {}
        self._lock = threading.Lock()
        self.expired = 0

    def grant(self, owner: str, keys: Sequence[bytes], ttl_s: float | None | object = _TABLE_TTL) -> None:
        """Lease ``keys`` for ``owner``, replacing any lease it held.

        Args:
            ttl_s: seconds until the lease expires (default: the table's ``ttl_s``);
                None: it never expires (only ``release`` ends it).

        Raises:
            ValueError: ``ttl_s`` is not positive.
        """
        if ttl_s is _TABLE_TTL:
            ttl = self.ttl_s
        elif ttl_s is None:
            ttl = math.inf
        else:
            ttl = float(ttl_s)  # type: ignore[arg-type]
            if not ttl > 0:
                raise ValueError(f"lease TTL must be positive (or None for no expiry), got {ttl_s}")
        with self._lock:
            self._end_locked(owner)
            if not keys:
                return
            lease = Lease(tuple(keys), self._clock() + ttl)
            self._leases[owner] = lease
            for k in lease.keys:
                self._pins[k] = self._pins.get(k, 0) + 1

    def release(self, owner: str) -> bool:
        """End ``owner``'s lease; False if it had none."""
        with self._lock:
            return self._end_locked(owner)

    def reap(self) -> int:
        """End expired leases; returns how many ended."""
        now = self._clock()
        with self._lock:
            dead = [o for o, lease in self._leases.items() if lease.expires_at <= now]
            for o in dead:
                self._end_locked(o)
            self.expired += len(dead)
            return len(dead)

    def is_pinned(self, key: bytes) -> bool:
        return self._pins.get(key, 0) > 0

    def holds(self, owner: str) -> bool:
        return owner in self._leases

    def size(self, owner: str) -> int:
        """Chunks ``owner``'s live lease pins (0 without one; an expired lease counts until reaped)."""
        lease = self._leases.get(owner)
        return 0 if lease is None else len(lease.keys)

    def keys_of(self, owner: str) -> tuple[bytes, ...]:
        """The keys ``owner``'s lease lists (empty without one)."""
        lease = self._leases.get(owner)
        return () if lease is None else lease.keys

    def owners(self, prefix: str = "") -> list[str]:
        """Owners of live leases whose id starts with ``prefix``."""
        with self._lock:
            return [o for o in self._leases if o.startswith(prefix)]

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def pinned_keys(self) -> int:
        return len(self._pins)

    def check_invariants(self) -> None:
        """Assert pin counts equal the live leases that list each key (tests; O(leased keys)).

        Raises:
            AssertionError: an invariant is broken.
        """
        with self._lock:
            counts: dict[bytes, int] = {}
            for lease in self._leases.values():
                assert lease.keys, "an empty lease is kept"
                for k in lease.keys:
                    counts[k] = counts.get(k, 0) + 1
            assert counts == self._pins, "pin counts disagree with the live leases"

    def _end_locked(self, owner: str) -> bool:
        lease = self._leases.pop(owner, None)
        if lease is None:
            return False
        for k in lease.keys:
            n = self._pins[k] - 1
            assert n >= 0, "a pin count went negative"
            if n:
                self._pins[k] = n
            else:
                del self._pins[k]
        return True
