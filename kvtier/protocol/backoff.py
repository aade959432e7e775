"""The one reconnect/back-off policy of every control-plane client."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Exponential back-off with jitter: ``min_s`` doubling to ``max_s`` (seconds).

    After a failure a client waits ``next_delay()`` before trying again (calls
    meanwhile are misses without touching the network); a success calls
    ``reset()``. Jitter draws each delay from ``[delay/2, delay]`` so clients that
    failed together do not retry together.

    Raises:
        ValueError: ``min_s <= 0`` or ``min_s > max_s``.
    """

    min_s: float = 0.05
    max_s: float = 2.0
    _delay: float = field(init=False)
    _down_until: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if not 0 < self.min_s <= self.max_s:
            raise ValueError("back-off must satisfy 0 < min_s <= max_s")
        self._delay = self.min_s

    def next_delay(self) -> float:
        """Seconds to wait after one more failure (and remember the retry time)."""
        d = self._delay * random.uniform(0.5, 1.0)
        self._delay = min(self._delay * 2, self.max_s)
        self._down_until = time.monotonic() + d
        return d

    def reset(self) -> None:
        """A call succeeded: the next failure waits ``min_s`` again."""
        self._delay = self.min_s
        self._down_until = 0.0

    def waiting(self) -> bool:
        """True while the delay after the last failure has not passed."""
        return time.monotonic() < self._down_until
