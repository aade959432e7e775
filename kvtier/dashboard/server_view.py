"""The dashboard of one ``kvtier server``: tiers, rates and hot prefixes from its ``ServerMetrics``.

Every tier cell names one series of ``/metrics`` (see :data:`TIER_SERIES`); a
field a tier does not report is absent (the page shows a dash).
"""

from __future__ import annotations

from typing import Any

from kvtier.dashboard.hot import HotPrefixes
from kvtier.dashboard.samples import Collectors, collect_samples, labelled
from kvtier.dashboard.source import DashboardSource, Decode

#: Tier label -> field -> the ``/metrics`` series shown in that cell.
TIER_SERIES: dict[str, dict[str, str]] = {
    "cpu": {
        "used_bytes": "kvtier_cpu_used_bytes", "capacity_bytes": "kvtier_cpu_capacity_bytes",
        "chunks": "kvtier_cpu_chunks", "stores": "kvtier_stored_chunks_total",
        "evictions": "kvtier_cpu_evicted_chunks_total", "read_errors": "kvtier_corrupt_chunks_total",
        "write_errors": "kvtier_store_skipped_total", "queue": "kvtier_prefetch_queued_chunks",
    },
    "disk": {
        "used_bytes": "kvtier_disk_used_bytes", "capacity_bytes": "kvtier_disk_capacity_bytes",
        "chunks": "kvtier_disk_chunks", "stores": "kvtier_disk_written_chunks_total",
        "evictions": "kvtier_disk_evicted_chunks_total",
        "write_errors": "kvtier_disk_dropped_writes_total", "queue": "kvtier_disk_write_pending",
    },
    "remote": {
        "stores": "kvtier_remote_put_ok_chunks_total", "read_errors": "kvtier_remote_errors_total",
        "write_errors": "kvtier_remote_put_failed_chunks_total", "queue": "kvtier_remote_write_pending",
    },
}
#: Headline counters shown as tiles: (label, series).
SERVER_COUNTERS = (
    ("Lookups", "kvtier_lookups_total"),
    ("Tokens asked", "kvtier_lookup_tokens_total"),
    ("Committed bytes", "kvtier_committed_bytes_total"),
    ("Served bytes", "kvtier_served_bytes_total"),
    ("Load failures", "kvtier_load_failures_total"),
    ("Clients", "kvtier_active_clients"),
    ("Leases", "kvtier_leases"),
    ("Pinned chunks", "kvtier_pinned_chunks"),
    ("Remote breakers trips", "kvtier_remote_breaker_trips_total"),
)


class ServerDashboard(DashboardSource):
    """Dashboard of a cache server.

    Args:
        metrics: the server's ``ServerMetrics`` (its ``registry``; ``hot`` if it has one).
        step_s / decode / sample: as :class:`~kvtier.dashboard.source.DashboardSource`.
    """

    kind = "server"

    def __init__(self, metrics: Any, step_s: float = 1.0, decode: Decode | None = None, sample: bool = True):
        hot = getattr(metrics, "hot", None)
        # the sampler's counters, read from the very metric objects /metrics renders, without the
        # scrape-time state collector (its CPU-tier stats are O(chunks): not once a second)
        self._counters = Collectors(metrics.lookups, metrics.lookup_tokens, metrics.lookup_hit_tokens,
                                    metrics.bytes_in, metrics.bytes_out)
        super().__init__(metrics.registry, hot if isinstance(hot, HotPrefixes) else HotPrefixes(), step_s, decode,
                         sample)

    def counter_samples(self) -> dict[str, float]:
        return collect_samples(self._counters)

    def tiers(self, m: dict[str, float]) -> list[dict[str, Any]]:
        hits = labelled(m, "kvtier_lookup_hit_tokens_total", "tier")
        rows = []
        for tier, series in TIER_SERIES.items():
            present = {f: s for f, s in series.items() if s in m}
            used = any(m.get(s, 0) for s in present.values()) or hits.get(tier, 0) > 0
            if tier != "cpu" and not used:
                continue  # a tier this server does not have (its series are all zero)
            if tier in hits:
                present["hit_tokens"] = f'kvtier_lookup_hit_tokens_total{{tier="{tier}"}}'
            rows.append({"tier": tier, "series": present})
        return rows

    def counters(self, m: dict[str, float]) -> dict[str, float]:
        out = {
            "lookups": m.get("kvtier_lookups_total", 0.0),
            "lookup_tokens": m.get("kvtier_lookup_tokens_total", 0.0),
            "load_bytes": m.get("kvtier_served_bytes_total", 0.0),
            "store_bytes": m.get("kvtier_committed_bytes_total", 0.0),
        }
        for tier, v in labelled(m, "kvtier_lookup_hit_tokens_total", "tier").items():
            out[f"hit:{tier}"] = v
        out.setdefault("hit:cpu", 0.0)
        return out

    def extra(self, m: dict[str, float]) -> dict[str, Any]:
        return {"counters": [[label, s] for label, s in SERVER_COUNTERS if s in m], "ops": None, "instances": None}
