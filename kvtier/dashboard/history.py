"""Bounded rings of counter samples, and the rates derived from them.

Two rings: one sample per ``step_s`` for the last ``short_points`` steps (5 minutes
at 1 s) and one per minute for the last hour. A sample is ``(wall time s,
{counter name: cumulative value})``; rates are differences of neighbours
divided by their time apart, so a missed tick widens one interval and a
counter reset (server restart) yields no negative rate.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

Sample = tuple[float, dict[str, float]]


class CounterHistory:
    """Thread-safe short (per step) and long (per minute) rings of counter samples.

    Args:
        short_points: samples kept in the short ring (>= 2).
        long_points: samples kept in the long ring, one per ``long_step_s`` (>= 2).
        long_step_s: seconds between long-ring samples (> 0).

    Raises:
        ValueError: a bound below its minimum.
    """

    def __init__(self, short_points: int = 300, long_points: int = 61, long_step_s: float = 60.0):
        if short_points < 2 or long_points < 2 or not long_step_s > 0:
            raise ValueError("history needs >= 2 points per ring and a positive long step")
        self._short: deque[Sample] = deque(maxlen=short_points)
        self._long: deque[Sample] = deque(maxlen=long_points)
        self._long_step_s = long_step_s
        self._lock = threading.Lock()

    def add(self, t: float, counters: dict[str, float]) -> None:
        """Record cumulative ``counters`` at wall time ``t`` (seconds)."""
        with self._lock:
            self._short.append((t, dict(counters)))
            if not self._long or t - self._long[-1][0] >= self._long_step_s:
                self._long.append((t, dict(counters)))

    def samples(self, ring: str) -> list[Sample]:
        """A copy of the ``"short"`` or ``"long"`` ring, oldest first."""
        with self._lock:
            return list(self._short if ring == "short" else self._long)

    def latest(self) -> Sample | None:
        with self._lock:
            return self._short[-1] if self._short else None


def _delta(a: dict[str, float], b: dict[str, float], name: str) -> float:
    d = b.get(name, 0.0) - a.get(name, 0.0)
    return d if d > 0 else 0.0


def rate_series(samples: list[Sample], per_second: Iterable[str], ratios: dict[str, tuple[str, str]],
                scale: dict[str, float] | None = None) -> dict[str, list[float | None]]:
    """Per interval between neighbouring samples: ``t`` (end time, s), each counter of
    ``per_second`` as a rate (/s, times ``scale[name]``), and each ``ratios[out] = (num, den)``
    as ``delta num / delta den`` (None when ``den`` did not move)."""
    scale = scale or {}
    names = [n for n in per_second if any(n in c for _, c in samples)]  # a counter never sampled: no series
    out: dict[str, list[float | None]] = {"t": []}
    for n in names:
        out[n] = []
    for r in ratios:
        out[r] = []
    for (t0, a), (t1, b) in zip(samples, samples[1:]):
        dt = t1 - t0
        if dt <= 0:
            continue
        out["t"].append(round(t1, 3))
        for n in names:
            out[n].append(_delta(a, b, n) / dt * scale.get(n, 1.0))
        for r, (num, den) in ratios.items():
            d = _delta(a, b, den)
            out[r].append(min(1.0, _delta(a, b, num) / d) if d > 0 else None)
    return out
