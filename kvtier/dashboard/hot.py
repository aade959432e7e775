"""A bounded top-k counter of reused prefix chains (Space-Saving).

Algorithm: Metwally, Agrawal, El Abbadi, "Efficient Computation of Frequent and
Top-k Elements in Data Streams" (ICDT 2005): ``capacity`` counters (the smallest found through a lazily refreshed min-heap); an unseen
item replaces the item with the smallest count and inherits that count + 1
(its ``error`` records the inherited part). Memory and the cost of :meth:`top`
are bounded by ``capacity``, never by the number of chunks cached.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class HotChain:
    """One counted chain, identified by its first chunk (``head``: 32-byte key or token bytes)."""

    head: bytes
    count: int = 0
    error: int = 0
    hit_tokens: int = 0      # longest hit seen (tokens)
    nbytes: int = 0          # bytes of that hit (0: unknown)
    tiers: dict[str, int] = field(default_factory=dict)  # tokens per tier label in the last hit
    pinned_tokens: int = 0   # pinned tokens in the last hit (-1: unknown)
    tokens: bytes = b""       # the hit prefix's token ids (uint32 little-endian), when known
    last_s: float = 0.0      # wall-clock time of the last hit
    instance: str | None = None  # the instance holding the longest match (controller)
    salt: str | None = None      # the lookup's cache salt (controller)


class HotPrefixes:
    """Thread-safe Space-Saving counter of chain hits.

    Args:
        capacity: counters kept (>= 1); :meth:`top` answers at most this many.

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int = 256):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: dict[bytes, HotChain] = {}
        # one (count when pushed, head) entry per item; counts only grow, so an entry whose count
        # is behind its item's is refreshed when it reaches the top: finding the minimum is
        # O(log capacity) amortized instead of a scan of every counter per new chain
        self._heap: list[tuple[int, bytes]] = []
        self._lock = threading.Lock()
        self.observed = 0

    def observe(self, head: bytes, hit_tokens: int, nbytes: int, tiers: dict[str, int],
                pinned_tokens: int = -1, tokens: bytes | Callable[[], bytes] = b"",
                instance: str | None = None, salt: str | None = None) -> None:
        """Count one hit of the chain starting at ``head``: ``hit_tokens`` tokens (``nbytes`` bytes)
        found, ``tiers`` the tokens per tier label, ``tokens`` the hit prefix's token ids (uint32 LE bytes, or a callable
        returning them: called only when this hit is longer than the one kept)."""
        with self._lock:
            self.observed += 1
            item = self._items.get(head)
            if item is None:
                if len(self._items) >= self.capacity:
                    victim = self._pop_min()
                    item = HotChain(head, count=victim.count, error=victim.count)
                else:
                    item = HotChain(head)
                self._items[head] = item
                heapq.heappush(self._heap, (item.count + 1, head))
            item.count += 1
            if tokens and (hit_tokens > item.hit_tokens or not item.tokens):
                item.tokens = tokens() if callable(tokens) else tokens
            item.hit_tokens = max(item.hit_tokens, hit_tokens)
            item.nbytes = max(item.nbytes, nbytes)
            item.tiers = dict(tiers)
            item.pinned_tokens = pinned_tokens
            item.instance = instance
            item.salt = salt
            item.last_s = time.time()

    def _pop_min(self) -> HotChain:
        """Remove and return the item with the smallest count (lock held; the table is full)."""
        while True:
            count, head = self._heap[0]
            item = self._items[head]
            if item.count == count:
                heapq.heappop(self._heap)
                del self._items[head]
                return item
            heapq.heapreplace(self._heap, (item.count, head))  # stale entry: refresh, look again

    def top(self, k: int = 20) -> list[HotChain]:
        """The ``k`` chains counted most often (copies), most first."""
        with self._lock:
            items = sorted(self._items.values(), key=lambda c: (-c.count, c.head))[:k]
            return [HotChain(c.head, c.count, c.error, c.hit_tokens, c.nbytes, dict(c.tiers), c.pinned_tokens,
                             c.tokens, c.last_s, c.instance, c.salt) for c in items]

    def get(self, head: bytes) -> HotChain | None:
        """The counted chain ``head`` (a copy), or None."""
        with self._lock:
            c = self._items.get(head)
            return None if c is None else HotChain(c.head, c.count, c.error, c.hit_tokens, c.nbytes, dict(c.tiers),
                                                   c.pinned_tokens, c.tokens, c.last_s, c.instance, c.salt)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._heap.clear()
