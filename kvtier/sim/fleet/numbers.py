"""Bounded numbers read from timing files (``bench serve`` runs, calibrations, timing checks).

A file another run wrote (or anyone edited) may hold any JSON number: ``NaN``, ``Infinity``,
``1e308``, 0 where a time divides, a 400-digit integer, a bool. Each field is read through
:func:`number` with the range that makes sense for it, so a bad value is a one-line error naming
the field rather than a hang in a least-squares fit, a ``NaN`` in the result, or a replay that
builds 10**13 block ids.
"""

from __future__ import annotations

import math
from typing import Any

#: Most tokens of one prompt or answer (vLLM's largest context lengths are ~10**6).
MAX_TOKENS = 1 << 22
#: Most engine instances a replayed run may have.
MAX_WORKERS = 256
#: Most seconds a measured time may be (a request's TTFT, a step, a send time offset).
MAX_SECONDS = 1e7


def number(v: Any, where: str, lo: float, hi: float, integer: bool = False, lo_open: bool = False) -> float:
    """``v`` as a float within ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); an int when ``integer``.

    Raises:
        ValueError: a bool, a non-number, a non-finite number, a non-integer where one is needed,
            or a value out of range; the message names ``where`` and the range.
    """
    kind = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ValueError(f"{where} must be {kind}, got {type(v).__name__}")
    if isinstance(v, int) and not integer and abs(v) > 1 << 1000:
        raise ValueError(f"{where} is out of range")
    x = float(v) if not isinstance(v, int) or abs(v) <= 1 << 1000 else math.inf
    if not math.isfinite(x) or x > hi or x < lo or (lo_open and x <= lo):
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:40] + "..."
        raise ValueError(f"{where} must be {kind} in {rng}, got {shown}")
    return x
