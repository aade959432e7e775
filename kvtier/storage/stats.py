"""Counters of the storage manager and the folding of tier stats into one flat dict.

Stat names (read by the server's Prometheus metrics, the demo and tests):
``cpu_*`` for the CPU tier, ``<kind>_<name>`` for each lower tier (``disk_*``,
``remote_*``: the tier's own :meth:`~kvtier.tiers.base.LowerTier.stats` numbers
plus the manager's write-behind counters ``<kind>_queued_chunks``,
``<kind>_dropped_writes``, ``<kind>_write_pending`` and promotion counters),
and the manager's own counters (:class:`Counters`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvtier.tiers.base import AtomicCounters, LowerTier

log = logging.getLogger(__name__)


@dataclass
class Counters(AtomicCounters):
    """Monotonic counters of a storage manager (tokens, chunks, bytes)."""

    lookups: int = 0
    lookup_tokens: int = 0
    #: tokens found by lookups, a request's hit once: a repeated lookup under the same live lease
    #: (vLLM asks again after a failed block allocation) adds only what it finds beyond the last one.
    lookup_hit_tokens: int = 0
    stored_chunks: int = 0
    stored_bytes: int = 0
    store_skipped: int = 0
    prefetch_calls: int = 0


def tier_prefixes(tiers: list[LowerTier]) -> list[str]:
    """Stat prefix of each lower tier: its kind (``disk``, ``remote``), numbered if a kind repeats."""
    seen: dict[str, int] = {}
    out = []
    for t in tiers:
        n = seen.get(t.kind, 0)
        seen[t.kind] = n + 1
        out.append(t.kind if n == 0 else f"{t.kind}{n + 1}")
    return out


def tier_stats(prefix: str, tier: LowerTier) -> dict[str, int | float]:
    """A lower tier's numeric stats as ``<prefix>_<name>`` (breaker states folded into a count).

    Also derives the names older callers read when the tier does not report them:
    ``<prefix>_written_chunks`` (= ``put_ok``), ``<prefix>_corrupt_reads``
    (= ``get_corrupt``), ``<prefix>_writable``.
    """
    try:
        raw: dict[str, Any] = dict(tier.stats())
    except Exception:  # defensive: stats must not raise
        log.exception("kvtier: %s stats failed", tier.name)
        return {}
    raw.setdefault("written_chunks", raw.get("put_ok", 0))
    raw.setdefault("corrupt_reads", raw.get("get_corrupt", 0))
    raw.setdefault("writable", tier.writable)
    out: dict[str, int | float] = {}
    for name, value in raw.items():
        if isinstance(value, bool):
            out[f"{prefix}_{name}"] = int(value)
        elif isinstance(value, (int, float)):
            out[f"{prefix}_{name}"] = value
        elif name == "breakers" and isinstance(value, dict):
            out[f"{prefix}_breakers_open"] = sum(1 for state in value.values() if state != "closed")
    return out
