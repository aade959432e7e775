"""Prometheus metrics and the health endpoint of the cache service.

Metrics live in a registry private to one server (no process-global state).
Event counters (requests, latency, hit tokens, bytes moved) are updated on the
request path; state (active clients, leases, tier occupancy, evictions) is read
from the server when Prometheus scrapes. Exposition format and naming follow
https://prometheus.io/docs/instrumenting/writing_exporters/ (``_total`` for
counters, base units: bytes, seconds).

HTTP endpoints (:mod:`kvtier.service.http`, loopback by default):
``/metrics`` (Prometheus text format) and ``/health`` (JSON; 200 when serving,
503 when stopping).
"""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtier.dashboard.hot import HotPrefixes

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig
    from kvtier.service.namespace_host import NamespaceStats
    from kvtier.storage.stats import LowerTierStats
    from kvtier.tiers.base import LowerTier

#: Request latency buckets (seconds): 10 us .. 10 s.
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1, 1.0, 10.0)

#: Reads one number of a hosted namespace's stats (a field: a renamed one is a type error here).
Read = Callable[["NamespaceStats"], "float | None"]


def _disk(s: "NamespaceStats") -> "LowerTierStats":
    return s.manager.tier("disk")


def _remote(s: "NamespaceStats") -> "LowerTierStats":
    return s.manager.tier("remote")


#: Namespace stats exported as counters: stat name (``kvtier_<name>_total``; the wire stats name) ->
#: (read, help text).
_COUNTER_STATS: dict[str, tuple[Read, str]] = {
    "cpu_evicted_chunks": (lambda s: s.manager.cpu_evicted_chunks, "Chunks evicted from the CPU tier"),
    "cpu_evicted_bytes": (lambda s: s.manager.cpu_evicted_bytes, "Bytes evicted from the CPU tier"),
    "disk_evicted_chunks": (lambda s: _disk(s).evicted_chunks, "Chunks evicted from the disk tier"),
    "disk_evicted_bytes": (lambda s: _disk(s).evicted_bytes, "Bytes evicted from the disk tier"),
    "stored_chunks": (lambda s: s.manager.stored_chunks, "Chunks committed"),
    "store_skipped": (lambda s: s.manager.store_skipped, "Stores skipped (no room)"),
    "promoted_chunks": (lambda s: _disk(s).promoted_chunks, "Disk hits promoted into the CPU tier"),
    "load_failures": (lambda s: s.load_failures,
                      "Chunks clients asked to load that could not be served (evicted, a failing tier, quota)"),
    "disk_written_chunks": (lambda s: _disk(s).written_chunks, "Chunks written to the disk tier"),
    "disk_dropped_writes": (lambda s: _disk(s).dropped_writes, "Write-behind chunks dropped"),
    "leases_expired": (lambda s: s.manager.leases_expired, "Leases ended by their TTL"),
    "corrupt_chunks": (lambda s: s.corrupt_chunks,
                       "CPU chunks that failed their commit checksum (overwritten in shared memory); dropped"),
    "expired_reservations": (lambda s: s.expired_reservations, "Reservations aborted by the reservation timeout"),
    "quota_refusals": (lambda s: s.quota_refusals, "Reserve/load calls refused by a client id's quota"),
}
#: Namespace stats exported as gauges (``kvtier_<name>``).
_GAUGE_STATS: dict[str, tuple[Read, str]] = {
    "leases": (lambda s: s.manager.leases, "Live leases"),
    "pinned_chunks": (lambda s: s.manager.pinned_chunks, "Chunks pinned by leases"),
    "referenced_chunks": (lambda s: s.manager.referenced_chunks, "CPU chunks being read or written"),
    "cpu_chunks": (lambda s: s.manager.cpu_chunks, "Chunks in the CPU tier"),
    "cpu_used_bytes": (lambda s: s.manager.cpu_used_bytes, "Bytes used in the CPU tier"),
    "disk_chunks": (lambda s: _disk(s).chunks, "Chunks in the disk tier"),
    "disk_used_bytes": (lambda s: _disk(s).used_bytes, "Bytes used in the disk tier"),
    "prefetch_queued_chunks": (lambda s: s.manager.prefetch_queued_chunks,
                               "Chunks queued for promotion into the CPU tier"),
    "disk_write_pending": (lambda s: _disk(s).write_pending, "Chunks waiting to be written to the disk tier"),
    "remote_write_pending": (lambda s: _remote(s).write_pending, "Chunks waiting to be written to the remote tier"),
}
#: Remote tier stats exported as counters: wire stats name (``remote_<field>``) -> (read, metric name,
#: help text). Zero until a namespace with a remote tier is hosted.
_REMOTE_COUNTERS: dict[str, tuple[Read, str, str]] = {
    "remote_puts": (lambda s: _remote(s).puts, "kvtier_remote_put_chunks", "Chunks offered to the remote tier"),
    "remote_put_ok": (lambda s: _remote(s).put_ok, "kvtier_remote_put_ok_chunks", "Chunks the remote tier stored"),
    "remote_put_failed": (lambda s: _remote(s).put_failed, "kvtier_remote_put_failed_chunks",
                          "Chunk writes the remote tier dropped (store error, OOM, unreachable)"),
    "remote_dropped_writes": (lambda s: _remote(s).dropped_writes, "kvtier_remote_dropped_writes",
                              "Write-behind chunks dropped before reaching the remote tier"),
    "remote_gets": (lambda s: _remote(s).gets, "kvtier_remote_get_chunks", "Chunks asked of the remote tier"),
    "remote_get_hits": (lambda s: _remote(s).get_hits, "kvtier_remote_get_hit_chunks",
                        "Chunks the remote tier returned"),
    "remote_get_corrupt": (lambda s: _remote(s).get_corrupt, "kvtier_remote_get_corrupt_chunks",
                           "Remote chunks that were unusable (checksum, foreign, codec)"),
    "remote_errors": (lambda s: _remote(s).errors, "kvtier_remote_errors",
                      "Failed remote round trips (timeout, connection, I/O)"),
    "remote_skipped_calls": (lambda s: _remote(s).skipped_calls, "kvtier_remote_skipped_calls",
                             "Remote calls answered as misses without the store (breaker open)"),
    "remote_breaker_trips": (lambda s: _remote(s).breaker_trips, "kvtier_remote_breaker_trips",
                             "Times a remote node's circuit breaker opened"),
    "remote_bytes_read": (lambda s: _remote(s).bytes_read, "kvtier_remote_read_bytes",
                          "Bytes read from the remote tier"),
    "remote_bytes_written": (lambda s: _remote(s).bytes_written, "kvtier_remote_written_bytes",
                             "Bytes written to the remote tier"),
}


#: Stats ``/metrics`` exports as counters. A released namespace's values of these are kept by the
#: server (:attr:`kvtier.service.namespaces.NamespaceTable.released_counters`), so a counter never
#: goes down when an idle namespace is released (Prometheus would read that as a reset).
COUNTER_STAT_NAMES: frozenset[str] = frozenset({*_COUNTER_STATS, *_REMOTE_COUNTERS})


def counter_values(stats: "NamespaceStats") -> dict[str, float]:
    """The counter stats (:data:`COUNTER_STAT_NAMES`) of one namespace, by name."""
    reads = [*((n, r) for n, (r, _) in _COUNTER_STATS.items()), *((n, r) for n, (r, _, _) in _REMOTE_COUNTERS.items())]
    return {name: float(read(stats) or 0) for name, read in reads}


def _total(stats: "list[NamespaceStats]", read: Read) -> float:
    return sum(float(read(s) or 0) for s in stats)


class ServerMetrics:
    """The server's metric objects, in a private registry.

    Series (beyond the per-namespace manager stats): ``kvtier_lookup_tokens_total``
    and ``kvtier_lookup_hit_tokens_total{tier}`` (token hit rate = their ratio),
    ``kvtier_committed_bytes_total`` / ``kvtier_served_bytes_total``, the configured
    ``kvtier_cpu_capacity_bytes`` / ``kvtier_disk_capacity_bytes`` (from start),
    ``kvtier_remote_*`` counters and ``kvtier_remote_breaker_open{node}``,
    ``process_*`` (this process) and ``kvtier_build_info{version,python}``.

    Args:
        snapshot: returns ``(active_clients, [NamespaceStats of each hosted namespace])``;
            called at scrape time.
        config: the server's settings (capacities are exported from start).
        tiers: returns the lower tiers of every hosted namespace (for per-node
            breaker state); called at scrape time.
        released: returns the counter totals (:data:`COUNTER_STAT_NAMES`) of the namespaces
            released so far, added to the hosted ones' (None: none).
    """

    def __init__(
        self,
        snapshot: "Callable[[], tuple[int, list[NamespaceStats]]]",
        config: "KVTierConfig | None" = None,
        tiers: "Callable[[], list[LowerTier]] | None" = None,
        released: Callable[[], Mapping[str, float]] | None = None,
    ):
        from kvtier.version import __version__

        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        ProcessCollector(registry=r)
        Info("kvtier_build", "kvtier version and Python of this server", registry=r).info(
            {"version": __version__, "python": platform.python_version()}
        )
        self.lookup_tokens = Counter(
            "kvtier_lookup_tokens",
            "Tokens of the full chunks lookups asked about, a hit request's repeated lookups once "
            "(hit rate: kvtier_lookup_hit_tokens_total / this)",
            registry=r,
        )
        self.requests = Counter("kvtier_server_requests", "Requests by op and result", ["op", "result"], registry=r)
        self.latency = Histogram(
            "kvtier_server_request_seconds", "Request handling time by op", ["op"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.lookups = Counter("kvtier_lookups", "Lookups served", registry=r)
        self.lookup_hit_tokens = Counter(
            "kvtier_lookup_hit_tokens",
            "Tokens found by lookups, by tier; a request's hit counts once (a repeated lookup under its live lease "
            "adds only new hits)", ["tier"], registry=r
        )
        self.load_tokens = Counter("kvtier_load_tokens", "Tokens engines loaded, by tier", ["tier"], registry=r)
        self.bytes_in = Counter("kvtier_committed_bytes", "Chunk bytes committed by clients", registry=r)
        self.bytes_out = Counter("kvtier_served_bytes", "Chunk bytes handed to clients for loading", registry=r)
        self.disconnect_releases = Counter(
            "kvtier_disconnect_releases", "Reservations, read references and leases released on client disconnect",
            ["kind"], registry=r,
        )
        r.register(_StateCollector(snapshot, config, tiers, released))
        self.hot = HotPrefixes()  # chains reused by lookups (the dashboard's hot prefixes; bounded)
        self._ok: dict[str, Any] = {}
        self._err: dict[str, Any] = {}
        self._lat: dict[str, Any] = {}

    def observe(self, op: str, ok: bool, seconds: float) -> None:
        """Count one handled request (children cached per op: ~2 us per call)."""
        table = self._ok if ok else self._err
        child = table.get(op)
        if child is None:
            child = table[op] = self.requests.labels(op, "ok" if ok else "error")
        child.inc()
        lat = self._lat.get(op)
        if lat is None:
            lat = self._lat[op] = self.latency.labels(op)
        lat.observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    """Scrape-time series: clients, namespaces, manager stats, capacities, remote tier health."""

    def __init__(
        self,
        snapshot: "Callable[[], tuple[int, list[NamespaceStats]]]",
        config: "KVTierConfig | None",
        tiers: "Callable[[], list[LowerTier]] | None",
        released: Callable[[], Mapping[str, float]] | None,
    ):
        self._snapshot = snapshot
        self._config = config
        self._tiers = tiers
        self._released = released

    def collect(self) -> Iterator[Metric]:
        clients, stats = self._snapshot()
        kept = self._released() if self._released is not None else {}
        g = GaugeMetricFamily("kvtier_active_clients", "Registered client connections")
        g.add_metric([], clients)
        yield g
        g = GaugeMetricFamily("kvtier_namespaces", "Key namespaces hosted")
        g.add_metric([], len(stats))
        yield g
        for name, (read, doc) in _COUNTER_STATS.items():
            c = CounterMetricFamily(f"kvtier_{name}", doc)
            c.add_metric([], _total(stats, read) + kept.get(name, 0.0))
            yield c
        for name, (read, doc) in _GAUGE_STATS.items():
            g = GaugeMetricFamily(f"kvtier_{name}", doc)
            g.add_metric([], _total(stats, read))
            yield g
        yield from self._capacities(stats)
        yield from _numa(stats)
        for name, (read, metric, doc) in _REMOTE_COUNTERS.items():
            c = CounterMetricFamily(metric, doc)
            c.add_metric([], _total(stats, read) + kept.get(name, 0.0))
            yield c
        yield from self._breakers()

    def _capacities(self, stats: "list[NamespaceStats]") -> Iterator[Metric]:
        cfg = self._config
        reads: dict[str, Read] = {"cpu": lambda s: s.manager.cpu_capacity_bytes,
                                  "disk": lambda s: _disk(s).capacity_bytes}
        for tier, read in reads.items():
            if cfg is not None:  # configured bounds: known before the first engine registers
                value = float(cfg.cpu_capacity if tier == "cpu" else (cfg.disk_capacity if cfg.disk_path else 0))
            else:
                value = _total(stats, read)
            g = GaugeMetricFamily(f"kvtier_{tier}_capacity_bytes", f"Byte bound of the {tier} tier (all namespaces)")
            g.add_metric([], value)
            yield g

    def _breakers(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "kvtier_remote_breaker_open",
            "1 while the circuit breaker of a remote node is open or probing (calls miss), 0 when closed",
            labels=["node"],
        )
        states: dict[str, bool] = {}
        for tier in self._tiers() if self._tiers is not None else []:
            try:
                breakers = tier.stats().get("breakers")
            except Exception:  # a plug-in's stats must not break the scrape
                continue
            if isinstance(breakers, dict):
                for node, state in breakers.items():
                    states[str(node)] = states.get(str(node), False) or state != "closed"
        for node, is_open in sorted(states.items()):
            g.add_metric([node], 1.0 if is_open else 0.0)
        yield g



#: NUMA placement of the namespaces' CPU segments (one server setting, so one node for all):
#: metric -> (read, help, how namespaces combine).
_NUMA: dict[str, tuple[Read, str, Callable[[list[float]], float]]] = {
    "kvtier_cpu_numa_node": (lambda s: s.manager.cpu_numa_node,
                             "NUMA node of the CPU segments (-1: none or interleaved)", max),
    "kvtier_cpu_numa_bound": (lambda s: s.manager.cpu_numa_bound,
                              "1 if every CPU segment's NUMA policy is set on its memory", min),
    "kvtier_cpu_numa_pages_on_node": (lambda s: s.manager.cpu_numa_pages_on_node,
                                      "Share of sampled backed CPU-segment pages on the chosen node(s), worst namespace",
                                      min),
}


def _numa(stats: "list[NamespaceStats]") -> Iterator[Metric]:
    """The NUMA gauges (none until a namespace with a placement is hosted)."""
    for metric, (read, doc, combine) in _NUMA.items():
        vals = [float(v) for v in (read(s) for s in stats) if v is not None]
        if vals:
            g = GaugeMetricFamily(metric, doc)
            g.add_metric([], combine(vals))
            yield g
