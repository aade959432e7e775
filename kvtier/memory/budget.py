"""One CPU byte budget shared dynamically by several chunk pools (the service's namespaces).

Each pool holds a :class:`BudgetShare`: the bytes of slots it has *charged*
(slots in use plus backed spare slots). A pool charges a slot before touching
it and uncharges it after releasing the slot's pages, so the sum of the charges
bounds the memory the pools' pages can use.

Fair share: ``total_bytes / number of shares``. A pool that needs a slot when the
budget is used up evicts one of its own chunks if it holds more than its fair
share, else :meth:`BudgetShare.reclaim` asks the share furthest above its fair
share to give slots back (its ``give_back`` callback evicts an unreferenced,
unpinned leaf chunk, releases the slot's pages and uncharges it).

Invariant (under the budget lock, asserted at each transition):
``sum(share.charged) == used <= total_bytes``. Room given back for a reclaim
stays reserved for it (``pending_bytes``) until it has charged its slot.

Lock order: a pool's locks, then the budget lock; the budget lock is never held
while calling a ``give_back`` callback.
"""

from __future__ import annotations

import threading
from typing import Callable


class ByteBudget:
    """``total_bytes`` of CPU memory shared by the pools holding a :meth:`share` of it (thread-safe).

    Raises:
        ValueError: ``total_bytes`` not positive.
    """

    def __init__(self, total_bytes: int):
        if total_bytes <= 0:
            raise ValueError(f"budget must be positive bytes, got {total_bytes}")
        self.total_bytes = int(total_bytes)
        self.used_bytes = 0
        self.reclaimed_bytes = 0  # bytes given back by one share for another
        self.pending_bytes = 0  # asked for by reclaims in progress: kept free for them, not for others
        self._shares: list[BudgetShare] = []
        self._lock = threading.Lock()

    def share(self, give_back: Callable[[], bool]) -> "BudgetShare":
        """A new share; ``give_back()`` frees one slot of it for another share (False: nothing could be freed now)."""
        s = BudgetShare(self, give_back)
        with self._lock:
            self._shares.append(s)
        return s

    @property
    def num_shares(self) -> int:
        return len(self._shares)

    def fair_share_bytes(self) -> int:
        """``total_bytes`` divided by the number of shares (bytes)."""
        return self.total_bytes // max(1, len(self._shares))

    def check_invariants(self) -> None:
        """Raises AssertionError if the charges do not add up or exceed the budget."""
        with self._lock:
            self._check_locked()

    def _check_locked(self) -> None:
        assert sum(s.charged for s in self._shares) == self.used_bytes, "charges do not add up"
        assert 0 <= self.used_bytes <= self.total_bytes, "namespaces use more than the CPU budget"

    def _victim(self, asker: "BudgetShare", skip: set[int]) -> "BudgetShare | None":
        with self._lock:
            fair = self.total_bytes // max(1, len(self._shares))
            best, over = None, 0
            for s in self._shares:
                if s is asker or id(s) in skip:
                    continue
                if s.charged - fair > over:
                    best, over = s, s.charged - fair
            return best


class BudgetShare:
    """One pool's part of a :class:`ByteBudget` (use :meth:`ByteBudget.share`)."""

    def __init__(self, budget: ByteBudget, give_back: Callable[[], bool]):
        self.budget = budget
        self.charged = 0  # bytes
        self.give_back = give_back

    def try_charge(self, nbytes: int, _pending_mine: int = 0) -> bool:
        """Charge ``nbytes`` if the budget has room; False (nothing charged) otherwise.

        Room given back for a share's :meth:`reclaim` in progress is not room
        for the others (a share above its fair share cannot take it first).
        """
        b = self.budget
        with b._lock:
            if b.used_bytes + nbytes + b.pending_bytes - _pending_mine > b.total_bytes:
                return False
            b.used_bytes += nbytes
            self.charged += nbytes
            b._check_locked()
            return True

    def uncharge(self, nbytes: int, given_back: bool = False) -> None:
        """Return ``nbytes`` (``given_back``: for another share; counted in ``reclaimed_bytes``)."""
        b = self.budget
        with b._lock:
            assert nbytes <= self.charged, "uncharging more than was charged"
            if given_back:
                b.reclaimed_bytes += nbytes
            b.used_bytes -= nbytes
            self.charged -= nbytes
            b._check_locked()

    def above_fair(self, extra: int) -> bool:
        """True if charging ``extra`` more bytes would put this share above its fair share."""
        return self.charged + extra > self.budget.fair_share_bytes()

    def reclaim(self, nbytes: int, max_rounds: int = 4096) -> bool:
        """Charge ``nbytes``, asking the shares furthest above their fair share to give slots back.

        Bounded: at most ``max_rounds`` ``give_back`` calls (a slot of this pool
        may be worth many of another's); a share that cannot
        give back (all its chunks referenced, pinned or parents; its lock busy)
        is skipped. Returns False (nothing charged) if no room could be made.
        """
        skip: set[int] = set()
        b = self.budget
        with b._lock:
            b.pending_bytes += nbytes
        try:
            for _ in range(max_rounds):
                if self.try_charge(nbytes, nbytes):
                    return True
                victim = b._victim(self, skip)
                if victim is None:
                    return False
                if not victim.give_back():
                    skip.add(id(victim))
            return self.try_charge(nbytes, nbytes)
        finally:
            with b._lock:
                b.pending_bytes -= nbytes

    def close(self) -> None:
        """Uncharge everything and leave the budget (the pool is closed)."""
        b = self.budget
        with b._lock:
            b.used_bytes -= self.charged
            self.charged = 0
            if self in b._shares:
                b._shares.remove(self)
            b._check_locked()
