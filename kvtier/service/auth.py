"""Back-off for failed TCP tokens, per source address (one concept: slowing token guessing).

A failed token closes its connection and makes its source address wait before
the next token is even compared: ``first_s`` after the first failure, doubling
per further failure up to ``max_s``. Attempts during the wait are refused
without looking at the token, so guessing runs at most one guess per back-off
period per address instead of thousands per second. A correct token clears
the address's record.

The table is bounded (``max_sources``, least recently failed evicted first):
client-controlled addresses never grow server memory beyond it.

Trade-off: clients behind one address (every loopback client is 127.0.0.1)
share a back-off, so a guesser on the same host also delays a legitimate TCP
client's next register by up to ``max_s``; local engines should use the Unix
socket, which needs no token.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Record:
    failures: int
    until: float  # monotonic seconds: no token is compared before this


class AuthThrottle:
    """Per-source exponential back-off after failed tokens (thread-safe, bounded).

    Args:
        first_s: back-off after a source's first failure (seconds, > 0).
        max_s: longest back-off (seconds, >= ``first_s``).
        max_sources: sources remembered at once (>= 1).
        clock: monotonic seconds (tests pass a fake).

    Raises:
        ValueError: a bound that cannot work.
    """

    def __init__(
        self, first_s: float, max_s: float, max_sources: int, clock: Callable[[], float] = time.monotonic
    ):
        if not 0 < first_s <= max_s or max_sources < 1:
            raise ValueError(
                f"auth back-off needs 0 < first_s <= max_s and max_sources >= 1, "
                f"got first_s={first_s}, max_s={max_s}, max_sources={max_sources}"
            )
        self.first_s = first_s
        self.max_s = max_s
        self.max_sources = max_sources
        self._clock = clock
        self._table: OrderedDict[str, _Record] = OrderedDict()
        self._lock = threading.Lock()

    def retry_after(self, source: str) -> float:
        """Seconds ``source`` must still wait before its token is compared (0: now)."""
        with self._lock:
            rec = self._table.get(source)
            return 0.0 if rec is None else max(rec.until - self._clock(), 0.0)

    def failed(self, source: str) -> tuple[int, float]:
        """Record a failed token from ``source``; returns (its failures so far, its back-off in seconds)."""
        with self._lock:
            rec = self._table.pop(source, None) or _Record(0, 0.0)
            rec.failures += 1
            delay = min(self.first_s * 2.0 ** min(rec.failures - 1, 62), self.max_s)
            rec.until = self._clock() + delay
            self._table[source] = rec
            while len(self._table) > self.max_sources:
                self._table.popitem(last=False)
            assert len(self._table) <= self.max_sources, "auth back-off table over its bound"
            return rec.failures, delay

    def succeeded(self, source: str) -> None:
        """``source`` presented the right token: forget its failures."""
        with self._lock:
            self._table.pop(source, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._table)
