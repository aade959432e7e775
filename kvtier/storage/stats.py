"""Counters of the storage manager and its stats as typed objects (per tier), with the flat form.

:class:`ManagerStats` (manager counters, the CPU tier, leases, prefetch, and one
:class:`LowerTierStats` per lower tier) is what the server's Prometheus metrics read,
as fields: a renamed field is a type error there, not a silently missing series.
:meth:`ManagerStats.flat` gives the flat ``{name: number}`` form the wire ``stats``
op, the dashboards, the demo and tests read: ``cpu_*`` for the CPU tier,
``<prefix>_<name>`` for each lower tier (``disk_*``, ``remote_*``: the tier's own
:meth:`~kvtier.tiers.base.LowerTier.stats` numbers plus the manager's write-behind
counters ``<prefix>_queued_chunks``, ``<prefix>_dropped_writes``,
``<prefix>_write_pending`` and promotion counters), and the manager's own counters
(:class:`Counters`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from kvtier.tiers.base import AtomicCounters, LowerTier

if TYPE_CHECKING:
    from kvtier.storage.leases import LeaseTable
    from kvtier.storage.promotion import Promoter
    from kvtier.storage.write_behind import WriteBehind
    from kvtier.tiers.cpu import CpuTier

log = logging.getLogger(__name__)

Number = int | float


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


@dataclass(frozen=True)
class LowerTierStats:
    """One lower tier's numbers: its own :meth:`~kvtier.tiers.base.LowerTier.stats` and the manager's for it.

    Attributes:
        prefix: the tier's stat prefix (:func:`tier_prefixes`: ``disk``, ``remote``, ``remote2``).
        reported: the tier's own numbers by name, as the tier reports them (plus the derived
            ``written_chunks``, ``corrupt_reads``, ``writable`` and ``breakers_open``); the
            typed fields below that come from the tier are read from here, 0 where absent.
        chunks / used_bytes / capacity_bytes: occupancy (chunks; bytes).
        evicted_chunks / evicted_bytes: removed by the tier's capacity eviction (chunks; bytes).
        written_chunks: chunks stored (``put_ok`` where the tier does not count it apart).
        puts / put_ok / put_failed, gets / get_hits / get_corrupt, errors, skipped_calls,
            bytes_read / bytes_written, breaker_trips: :class:`~kvtier.tiers.base.TierCounters` and
            the breaker's trips (chunks, calls, bytes).
        queued_chunks / dropped_writes / write_pending: the manager's write-behind queue
            (chunks queued, dropped by a full queue or the tier, waiting now).
        promoted_chunks / promote_failures: chunks promoted from this tier into the CPU tier,
            and reads of it that missed.
    """

    prefix: str
    reported: Mapping[str, Number] = field(default_factory=dict)
    chunks: Number = 0
    used_bytes: Number = 0
    capacity_bytes: Number = 0
    evicted_chunks: Number = 0
    evicted_bytes: Number = 0
    written_chunks: Number = 0
    puts: Number = 0
    put_ok: Number = 0
    put_failed: Number = 0
    gets: Number = 0
    get_hits: Number = 0
    get_corrupt: Number = 0
    errors: Number = 0
    skipped_calls: Number = 0
    bytes_read: Number = 0
    bytes_written: Number = 0
    breaker_trips: Number = 0
    queued_chunks: int = 0
    dropped_writes: Number = 0
    write_pending: int = 0
    promoted_chunks: int = 0
    promote_failures: int = 0

    @classmethod
    def of(cls, prefix: str, tier: LowerTier, queued: int = 0, dropped: int = 0, pending: int = 0,
           promoted: int = 0, promote_failures: int = 0) -> "LowerTierStats":
        """``tier``'s stats (a tier whose ``stats`` raises reports nothing) plus the manager's counters."""
        reported = tier_numbers(tier)
        own = {f.name: reported[f.name] for f in fields(cls) if f.name in _FROM_TIER and f.name in reported}
        return cls(prefix, reported, **own, queued_chunks=queued,
                   dropped_writes=reported.get("dropped_writes", 0) + dropped, write_pending=pending,
                   promoted_chunks=promoted, promote_failures=promote_failures)

    def flat(self) -> dict[str, Number]:
        """``<prefix>_<name>`` for every reported number and the manager's counters (the wire names;
        the disk tier's promotions are ``promoted_chunks``, another tier's ``promoted_chunks_<prefix>``)."""
        p = self.prefix
        out = {f"{p}_{name}": value for name, value in self.reported.items()}
        out[f"{p}_queued_chunks"] = self.queued_chunks
        out[f"{p}_dropped_writes"] = self.dropped_writes
        out[f"{p}_write_pending"] = self.write_pending
        out["promoted_chunks" if p == "disk" else f"promoted_chunks_{p}"] = self.promoted_chunks
        out[f"{p}_promote_failures"] = self.promote_failures
        return out


#: The :class:`LowerTierStats` fields read from the tier's own numbers.
_FROM_TIER = frozenset({
    "chunks", "used_bytes", "capacity_bytes", "evicted_chunks", "evicted_bytes", "written_chunks", "puts", "put_ok",
    "put_failed", "gets", "get_hits", "get_corrupt", "errors", "skipped_calls", "bytes_read", "bytes_written",
    "breaker_trips",
})


@dataclass(frozen=True)
class ManagerStats:
    """A storage manager's stats (see the module doc; every field but ``tiers`` is a flat name as is).

    Counters (monotonic): ``lookups``, ``lookup_tokens``, ``lookup_hit_tokens`` (tokens),
    ``stored_chunks``, ``stored_bytes``, ``store_skipped``, ``prefetch_calls``,
    ``remote_stale_forgotten`` (chunks reported stored that a remote store later answered
    absent, :mod:`kvtier.storage.stale_remote`), ``cpu_evicted_chunks``/``_bytes``,
    ``leases_expired``, ``prefetch_promoted_chunks``, ``prefetch_dropped_chunks``,
    ``unpromoted_reads``. Gauges: ``cpu_chunks``, ``cpu_used_bytes``, ``cpu_capacity_bytes``,
    ``leases``, ``pinned_chunks``, ``referenced_chunks``, ``prefetch_queued_chunks``, and the
    CPU pool's NUMA placement (None without one: ``cpu_numa_node``, -1 none or interleaved;
    ``cpu_numa_bound``, 1 if the policy is on the memory; ``cpu_numa_pages_on_node``, a share).
    ``tiers``: one :class:`LowerTierStats` per lower tier, fastest first.
    """

    lookups: int = 0
    lookup_tokens: int = 0
    lookup_hit_tokens: int = 0
    stored_chunks: int = 0
    stored_bytes: int = 0
    store_skipped: int = 0
    prefetch_calls: int = 0
    remote_stale_forgotten: int = 0
    cpu_chunks: int = 0
    cpu_used_bytes: int = 0
    cpu_capacity_bytes: int = 0
    cpu_evicted_chunks: int = 0
    cpu_evicted_bytes: int = 0
    leases: int = 0
    leases_expired: int = 0
    pinned_chunks: int = 0
    referenced_chunks: int = 0
    cpu_numa_node: int | None = None
    cpu_numa_bound: int | None = None
    cpu_numa_pages_on_node: float | None = None
    prefetch_queued_chunks: int = 0
    prefetch_promoted_chunks: int = 0
    prefetch_dropped_chunks: int = 0
    unpromoted_reads: int = 0
    tiers: tuple[LowerTierStats, ...] = ()

    def tier(self, prefix: str) -> LowerTierStats:
        """The lower tier with stat prefix ``prefix`` (``disk``, ``remote``); all zero without one."""
        return next((t for t in self.tiers if t.prefix == prefix), LowerTierStats(prefix))

    def flat(self) -> dict[str, Number]:
        """The flat ``{name: number}`` form (the wire ``stats`` op; see the module doc)."""
        out: dict[str, Number] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "tiers" and value is not None:
                out[f.name] = value
        for t in self.tiers:
            out.update(t.flat())
        return out


def collect_stats(counters: Counters, forgotten: int, cpu: "CpuTier", leases: "LeaseTable", promoter: "Promoter",
                  write_behind: "WriteBehind", prefixes: Sequence[str], lower: Sequence[LowerTier]) -> ManagerStats:
    """The :class:`ManagerStats` of a manager's parts (``lower``: its tiers, ``prefixes`` their stat
    prefixes; ``forgotten``: ``remote_stale_forgotten``)."""
    c, p = counters.snapshot(), promoter
    numa: dict[str, Any] = dict(cpu.pool.numa_stats())
    tiers = tuple(
        LowerTierStats.of(prefix, tier, write_behind.counters[i].queued, write_behind.counters[i].dropped,
                          write_behind.pending(i), p.promoted[i], p.failures[i])
        for i, (prefix, tier) in enumerate(zip(prefixes, lower))
    )
    return ManagerStats(
        **c, remote_stale_forgotten=forgotten,
        cpu_chunks=len(cpu), cpu_used_bytes=cpu.used_bytes, cpu_capacity_bytes=cpu.capacity_bytes,
        cpu_evicted_chunks=cpu.evicted_chunks, cpu_evicted_bytes=cpu.evicted_bytes,
        leases=len(leases), leases_expired=leases.expired, pinned_chunks=leases.pinned_keys,
        referenced_chunks=cpu.referenced_chunks(),
        cpu_numa_node=numa.get("cpu_numa_node"), cpu_numa_bound=numa.get("cpu_numa_bound"),
        cpu_numa_pages_on_node=numa.get("cpu_numa_pages_on_node"),
        prefetch_queued_chunks=p.prefetch_queued, prefetch_promoted_chunks=p.prefetch_promoted,
        prefetch_dropped_chunks=p.prefetch_dropped, unpromoted_reads=p.unpromoted, tiers=tiers,
    )


def tier_prefixes(tiers: list[LowerTier]) -> list[str]:
    """Stat prefix of each lower tier: its kind (``disk``, ``remote``), numbered if a kind repeats."""
    seen: dict[str, int] = {}
    out = []
    for t in tiers:
        n = seen.get(t.kind, 0)
        seen[t.kind] = n + 1
        out.append(t.kind if n == 0 else f"{t.kind}{n + 1}")
    return out


def tier_numbers(tier: LowerTier) -> dict[str, Number]:
    """A lower tier's numeric stats by name (breaker states folded into ``breakers_open``; bools as 0/1).

    Also derives the names older callers read when the tier does not report them:
    ``written_chunks`` (= ``put_ok``), ``corrupt_reads`` (= ``get_corrupt``), ``writable``.
    A tier whose ``stats`` raises reports nothing (logged).
    """
    try:
        raw: dict[str, Any] = dict(tier.stats())
    except Exception:  # defensive: stats must not raise
        log.exception("kvtier: %s stats failed", tier.name)
        return {}
    raw.setdefault("written_chunks", raw.get("put_ok", 0))
    raw.setdefault("corrupt_reads", raw.get("get_corrupt", 0))
    raw.setdefault("writable", tier.writable)
    out: dict[str, Number] = {}
    for name, value in raw.items():
        if isinstance(value, bool):
            out[name] = int(value)
        elif isinstance(value, (int, float)):
            out[name] = value
        elif name == "breakers" and isinstance(value, dict):
            out["breakers_open"] = sum(1 for state in value.values() if state != "closed")
    return out
