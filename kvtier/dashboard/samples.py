"""Flatten a Prometheus registry (or its text exposition) into ``{series: value}``.

The dashboard's numbers are read from the very registry ``/metrics`` renders, so
the page and a scrape taken at the same moment agree. Series names follow the
text exposition: ``name`` or ``name{label="value",...}`` with labels sorted,
counters with their ``_total`` suffix (``prometheus_client`` sample names).
"""

from __future__ import annotations

import math
import re
from typing import Any

#: One sample line of the Prometheus text format (no timestamps here).
_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def series_name(name: str, labels: dict[str, str]) -> str:
    """``name{a="1",b="2"}`` (labels sorted; no braces without labels)."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def collect_samples(registry: Any, prefix: str = "kvtier_") -> dict[str, float]:
    """Every sample of ``registry`` whose name starts with ``prefix`` (one ``collect()`` pass).

    Args:
        registry: a ``prometheus_client.CollectorRegistry``.
        prefix: sample name prefix kept (``""``: all).

    Returns:
        ``{series_name: value}``; ``_created`` samples are left out.
    """
    out: dict[str, float] = {}
    for family in registry.collect():
        for s in family.samples:
            if not s.name.startswith(prefix) or s.name.endswith("_created"):
                continue
            out[series_name(s.name, dict(s.labels))] = float(s.value)
    return out


class Collectors:
    """Several collectors (metric objects) read as one registry by :func:`collect_samples`."""

    def __init__(self, *collectors: Any):
        self._collectors = collectors

    def collect(self) -> Any:
        for c in self._collectors:
            yield from c.collect()


def parse_exposition(text: str, prefix: str = "kvtier_") -> dict[str, float]:
    """The samples of a Prometheus text exposition, named as :func:`collect_samples` names them.

    Raises:
        ValueError: a sample line whose value is not a number.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None or not m.group(1).startswith(prefix) or m.group(1).endswith("_created"):
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        value = float(m.group(3))
        out[series_name(m.group(1), labels)] = value if not math.isnan(value) else 0.0
    return out


def labelled(samples: dict[str, float], name: str, label: str) -> dict[str, float]:
    """``{label value: sample}`` of the series ``name{label=...}`` that carry only that label."""
    head = f'{name}{{{label}="'
    out: dict[str, float] = {}
    for key, value in samples.items():
        if key.startswith(head) and key.endswith('"}') and key.count('="') == 1:
            out[key[len(head):-2]] = value
    return out
