"""Circuit breaker: stop calling a failing backing store for a back-off period.

States: *closed* (calls go through); after ``failures`` consecutive failures it
*opens* for ``backoff_s`` (calls are refused, the tier reports misses); when the
back-off ends one caller is let through as a probe (*half-open*): success closes
the breaker, failure reopens it with the back-off doubled up to ``max_backoff_s``.
This is the pattern of Nygard, "Release It!" (2007), ch. 5.

Invariant (under ``self._lock``): at most one probe is in flight; a probe that
never reports is presumed failed after another ``backoff_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half-open"


class CircuitBreaker:
    """Consecutive-failure breaker with exponential back-off (seconds).

    ``name`` (e.g. ``"redis 10.0.0.5:6379"``) turns on logging: WARNING when the
    breaker opens from closed (the store stopped answering; calls miss) and when
    it closes again (recovered) -- two lines per outage, whatever its length.

    Raises:
        ValueError: ``failures`` < 1 or non-positive back-off.
    """

    def __init__(
        self,
        failures: int = 3,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        name: str = "",
    ):
        if failures < 1 or backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError("breaker needs failures >= 1 and 0 < backoff_s <= max_backoff_s")
        self.failures = failures
        self.base_backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self.name = name
        self._lock = threading.Lock()
        self._consecutive = 0
        self._state = CLOSED
        self._backoff = backoff_s
        self._until = 0.0
        self.trips = 0

    @property
    def state(self) -> str:
        return self._state

    def allow(self) -> bool:
        """True if the caller may use the store now; the caller must then report
        :meth:`success` or :meth:`failure`."""
        with self._lock:
            if self._state == CLOSED:
                return True
            now = self._clock()
            if now < self._until:
                return False
            # Back-off over (or a probe vanished): let exactly one probe through.
            self._state = HALF_OPEN
            self._until = now + self._backoff
            return True

    def success(self) -> None:
        with self._lock:
            if self._state != CLOSED and self.name:
                log.warning("kvtier %s answers again: circuit breaker closed", self.name)
            self._consecutive = 0
            self._state = CLOSED
            self._backoff = self.base_backoff_s

    def failure(self) -> None:
        with self._lock:
            self._consecutive += 1
            if self._state == HALF_OPEN:
                self._backoff = min(self._backoff * 2, self.max_backoff_s)
                self._open_locked()
            elif self._state == CLOSED and self._consecutive >= self.failures:
                self._open_locked()
                if self.name:
                    log.warning(
                        "kvtier %s failed %d calls in a row: circuit breaker open, its calls miss; "
                        "probing again every %.1f-%.1f s",
                        self.name, self._consecutive, self.base_backoff_s, self.max_backoff_s,
                    )

    def _open_locked(self) -> None:
        self._state = OPEN
        self._until = self._clock() + self._backoff
        self.trips += 1
