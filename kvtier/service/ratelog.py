"""Rate-limited WARNING logs: one line per (client id, reason) per interval.

A client that repeats a refused request (a bad registration in a loop) must not
flood the server log: the first refusal of each kind is logged, the next ones
within ``interval_s`` only counted, and the count is reported with the next
line. The table of recent (client id, reason) pairs is bounded (``max_keys``);
when full, the oldest pairs are forgotten. A client that changes its id on
every request is bounded too: at most ``max_lines`` lines per interval in all.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable


class RateLimitedLog:
    """Log at WARNING at most once per key per ``interval_s`` seconds (thread-safe).

    Args:
        logger: where lines go.
        interval_s: seconds between two lines of the same key.
        max_keys: keys remembered at once.
        max_lines: lines per interval over all keys.
        clock: monotonic clock in seconds (injectable for tests).
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 60.0,
        max_keys: int = 4096,
        max_lines: int = 100,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._log = logger
        self.interval_s = interval_s
        self.max_keys = max_keys
        self.max_lines = max_lines
        self._window = (float("-inf"), 0)  # (start of the current interval, lines logged in it)
        self._clock = clock
        self._last: dict[tuple[str, str], tuple[float, int]] = {}  # key -> (time logged, suppressed since)
        self._lock = threading.Lock()
        self.suppressed = 0

    def warning(self, client_id: str, reason: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless this (client id, reason) was logged within the interval; True if logged."""
        key = (client_id[:128], str(reason))
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last[0] < self.interval_s:
                self._last[key] = (last[0], last[1] + 1)
                self.suppressed += 1
                return False
            start, lines = self._window
            if now - start >= self.interval_s:
                start, lines = now, 0
            if lines >= self.max_lines:
                self.suppressed += 1
                return False
            self._window = (start, lines + 1)
            skipped = 0 if last is None else last[1]
            self._last.pop(key, None)
            self._last[key] = (now, 0)
            while len(self._last) > self.max_keys:
                del self._last[next(iter(self._last))]
        if skipped:
            msg += " (%d more like it not logged)"
            args = (*args, skipped)
        self._log.warning(msg, *args)
        return True
