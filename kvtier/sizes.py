"""Byte sizes in settings: one parser, one rule, errors that show the value and the accepted forms.

Rule (decided once, issue 14 item 11):

- a bare number is **bytes** (``4`` is 4 bytes, not 4 GB as in LMCache's
  ``max_local_cpu_size``); write ``"4GiB"``;
- ``K``/``KB``, ``M``/``MB``, ``G``/``GB``, ``T``/``TB`` are SI (powers of 1000):
  ``"4G"`` == ``"4GB"`` == 4,000,000,000 bytes;
- ``KiB``, ``MiB``, ``GiB``, ``TiB`` are binary (powers of 1024): ``"4GiB"`` ==
  4,294,967,296 bytes;
- units are case-insensitive, a space between number and unit is allowed, a
  fraction is allowed with a unit (``"1.5GiB"``); the result is whole bytes.
"""

from __future__ import annotations

import math
import re

#: Unit (lower case) -> bytes.
UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

#: The accepted forms, for error messages.
SIZE_FORMS = (
    "a whole number of bytes, or a number with a unit: B, KB/K, MB/M, GB/G, TB/T (SI, powers of 1000) "
    "or KiB, MiB, GiB, TiB (powers of 1024), e.g. '4GiB' or '512MiB'; bare numbers are bytes"
)

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([a-zA-Z]*)\s*$")


#: Largest size a setting may name, in bytes (1 EiB): past any machine's memory or disk, so a larger one is
#: a typo, and one that reached numpy failed there with "Maximum allowed dimension exceeded".
MAX_SIZE_BYTES = 1 << 60


def parse_size(value: object) -> int:
    """Bytes denoted by ``value`` (an int, or a string such as ``"4GiB"``), at most :data:`MAX_SIZE_BYTES`.

    Raises:
        ValueError: not a size, a negative size, an unknown unit, a fraction
            of a byte, or above the bound; the message shows the value and :data:`SIZE_FORMS`.
    """
    n = _parse_size(value)
    if n > MAX_SIZE_BYTES:
        raise ValueError(f"{str(value)[:40]!r} is more than {MAX_SIZE_BYTES} bytes (1 EiB); use {SIZE_FORMS}")
    return n


def _parse_size(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a byte size; use {SIZE_FORMS}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value} is negative; use {SIZE_FORMS}")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0 or value != int(value):
            raise ValueError(f"{value!r} is not a whole, non-negative number of bytes; use {SIZE_FORMS}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a byte size; use {SIZE_FORMS}")
    if value.strip().startswith("-"):
        raise ValueError(f"{value!r} is negative; use {SIZE_FORMS}")
    m = _SIZE_RE.match(value)
    if m is None:
        raise ValueError(f"{value!r} is not a byte size; use {SIZE_FORMS}")
    number, unit = m.group(1), m.group(2).lower()
    if unit not in UNITS:
        raise ValueError(f"{value!r} has an unknown unit {m.group(2)!r}; use {SIZE_FORMS}")
    if not unit and "." in number:
        raise ValueError(f"{value!r} is a fraction of a byte; use {SIZE_FORMS}")
    return int(float(number) * UNITS[unit]) if "." in number else int(number) * UNITS[unit]
