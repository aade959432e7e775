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
from typing import TYPE_CHECKING, Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtier.dashboard.hot import HotPrefixes

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig
    from kvtier.tiers.base import LowerTier

#: Request latency buckets (seconds): 10 us .. 10 s.
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1, 1.0, 10.0)

#: Manager stats exported as counters (name in ``StorageManager.stats()`` -> help text).
_COUNTER_STATS = {
    "cpu_evicted_chunks": "Chunks evicted from the CPU tier",
    "cpu_evicted_bytes": "Bytes evicted from the CPU tier",
    "disk_evicted_chunks": "Chunks evicted from the disk tier",
    "disk_evicted_bytes": "Bytes evicted from the disk tier",
    "stored_chunks": "Chunks committed",
    "store_skipped": "Stores skipped (no room)",
    "promoted_chunks": "Disk hits promoted into the CPU tier",
    "load_failures": "Chunks clients asked to load that could not be served (evicted, a failing tier, quota)",
    "disk_written_chunks": "Chunks written to the disk tier",
    "disk_dropped_writes": "Write-behind chunks dropped",
    "leases_expired": "Leases ended by their TTL",
    "corrupt_chunks": "CPU chunks that failed their commit checksum (overwritten in shared memory); dropped",
    "expired_reservations": "Reservations aborted by the reservation timeout",
    "quota_refusals": "Reserve/load calls refused by a client id's quota",
}
#: Manager stats exported as gauges.
_GAUGE_STATS = {
    "leases": "Live leases",
    "pinned_chunks": "Chunks pinned by leases",
    "referenced_chunks": "CPU chunks being read or written",
    "cpu_chunks": "Chunks in the CPU tier",
    "cpu_used_bytes": "Bytes used in the CPU tier",
    "disk_chunks": "Chunks in the disk tier",
    "disk_used_bytes": "Bytes used in the disk tier",
    "prefetch_queued_chunks": "Chunks queued for promotion into the CPU tier",
    "disk_write_pending": "Chunks waiting to be written to the disk tier",
    "remote_write_pending": "Chunks waiting to be written to the remote tier",
}
#: Remote tier stats (``remote_<name>`` in ``StorageManager.stats()``) exported as counters:
#: stat name -> (metric name, help text). Zero until a namespace with a remote tier is hosted.
_REMOTE_COUNTERS = {
    "puts": ("kvtier_remote_put_chunks", "Chunks offered to the remote tier"),
    "put_ok": ("kvtier_remote_put_ok_chunks", "Chunks the remote tier stored"),
    "put_failed": ("kvtier_remote_put_failed_chunks", "Chunk writes the remote tier dropped (store error, OOM, unreachable)"),
    "dropped_writes": ("kvtier_remote_dropped_writes", "Write-behind chunks dropped before reaching the remote tier"),
    "gets": ("kvtier_remote_get_chunks", "Chunks asked of the remote tier"),
    "get_hits": ("kvtier_remote_get_hit_chunks", "Chunks the remote tier returned"),
    "get_corrupt": ("kvtier_remote_get_corrupt_chunks", "Remote chunks that were unusable (checksum, foreign, codec)"),
    "errors": ("kvtier_remote_errors", "Failed remote round trips (timeout, connection, I/O)"),
    "skipped_calls": ("kvtier_remote_skipped_calls", "Remote calls answered as misses without the store (breaker open)"),
    "breaker_trips": ("kvtier_remote_breaker_trips", "Times a remote node's circuit breaker opened"),
    "bytes_read": ("kvtier_remote_read_bytes", "Bytes read from the remote tier"),
    "bytes_written": ("kvtier_remote_written_bytes", "Bytes written to the remote tier"),
}


#: Stats ``/metrics`` exports as counters. A released namespace's values of these are kept by the
#: server (:attr:`kvtier.service.namespaces.NamespaceTable.released_counters`), so a counter never
#: goes down when an idle namespace is released (Prometheus would read that as a reset).
COUNTER_STAT_NAMES: frozenset[str] = frozenset(
    {*_COUNTER_STATS, *(f"remote_{s}" for s in _REMOTE_COUNTERS), "lookups", "lookup_tokens", "lookup_hit_tokens"})
#: Key marking the released namespaces' counter totals in a stats snapshot (not a hosted namespace).
RELEASED_MARK = "released_namespaces_totals"


class ServerMetrics:
    """The server's metric objects, in a private registry.

    Series (beyond the per-namespace manager stats): ``kvtier_lookup_tokens_total``
    and ``kvtier_lookup_hit_tokens_total{tier}`` (token hit rate = their ratio),
    ``kvtier_committed_bytes_total`` / ``kvtier_served_bytes_total``, the configured
    ``kvtier_cpu_capacity_bytes`` / ``kvtier_disk_capacity_bytes`` (from start),
    ``kvtier_remote_*`` counters and ``kvtier_remote_breaker_open{node}``,
    ``process_*`` (this process) and ``kvtier_build_info{version,python}``.

    Args:
        snapshot: returns ``(active_clients, [manager stats dict per namespace])``;
            called at scrape time.
        config: the server's settings (capacities are exported from start).
        tiers: returns the lower tiers of every hosted namespace (for per-node
            breaker state); called at scrape time.
    """

    def __init__(
        self,
        snapshot: Callable[[], tuple[int, list[dict[str, Any]]]],
        config: "KVTierConfig | None" = None,
        tiers: "Callable[[], list[LowerTier]] | None" = None,
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
        r.register(_StateCollector(snapshot, config, tiers))
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
        snapshot: Callable[[], tuple[int, list[dict[str, Any]]]],
        config: "KVTierConfig | None",
        tiers: "Callable[[], list[LowerTier]] | None",
    ):
        self._snapshot = snapshot
        self._config = config
        self._tiers = tiers

    def collect(self) -> Iterator[Metric]:
        clients, stats = self._snapshot()
        g = GaugeMetricFamily("kvtier_active_clients", "Registered client connections")
        g.add_metric([], clients)
        yield g
        g = GaugeMetricFamily("kvtier_namespaces", "Key namespaces hosted")
        g.add_metric([], sum(1 for s in stats if not s.get(RELEASED_MARK)))
        yield g
        for name, doc in _COUNTER_STATS.items():
            c = CounterMetricFamily(f"kvtier_{name}", doc)
            c.add_metric([], sum(float(s.get(name, 0)) for s in stats))
            yield c
        for name, doc in _GAUGE_STATS.items():
            g = GaugeMetricFamily(f"kvtier_{name}", doc)
            g.add_metric([], sum(float(s.get(name, 0)) for s in stats))
            yield g
        yield from self._capacities(stats)
        yield from _numa(stats)
        for stat, (metric, doc) in _REMOTE_COUNTERS.items():
            c = CounterMetricFamily(metric, doc)
            c.add_metric([], sum(float(s.get(f"remote_{stat}", 0)) for s in stats))
            yield c
        yield from self._breakers()

    def _capacities(self, stats: list[dict[str, Any]]) -> Iterator[Metric]:
        cfg = self._config
        for tier in ("cpu", "disk"):
            if cfg is not None:  # configured bounds: known before the first engine registers
                value = float(cfg.cpu_capacity if tier == "cpu" else (cfg.disk_capacity if cfg.disk_path else 0))
            else:
                value = sum(float(s.get(f"{tier}_capacity_bytes", 0)) for s in stats)
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
#: metric -> (stat, help, how namespaces combine).
_NUMA = {
    "kvtier_cpu_numa_node": ("cpu_numa_node", "NUMA node of the CPU segments (-1: none or interleaved)", max),
    "kvtier_cpu_numa_bound": ("cpu_numa_bound", "1 if every CPU segment's NUMA policy is set on its memory", min),
    "kvtier_cpu_numa_pages_on_node": ("cpu_numa_pages_on_node",
                                      "Share of sampled backed CPU-segment pages on the chosen node(s), worst namespace",
                                      min),
}


def _numa(stats: list[dict[str, Any]]) -> Iterator[Metric]:
    """The NUMA gauges (none until a namespace with a placement is hosted)."""
    for metric, (stat, doc, combine) in _NUMA.items():
        vals = [float(s[stat]) for s in stats if stat in s]
        if vals:
            g = GaugeMetricFamily(metric, doc)
            g.add_metric([], combine(vals))
            yield g
