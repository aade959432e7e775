"""Prometheus metrics and the health endpoint of the cache service.

Metrics live in a registry private to one server (no process-global state).
Event counters (requests, latency, hit tokens, bytes moved) are updated on the
request path; state (active clients, leases, tier occupancy, evictions) is read
from the server when Prometheus scrapes. Exposition format and naming follow
https://prometheus.io/docs/instrumenting/writing_exporters/ (``_total`` for
counters, base units: bytes, seconds).

HTTP endpoints (``ThreadingHTTPServer``, loopback by default):
``/metrics`` (Prometheus text format) and ``/health`` (JSON; 200 when serving,
503 when stopping).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

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
    "load_failures": "Planned loads that could not be served",
    "disk_written_chunks": "Chunks written to the disk tier",
    "disk_dropped_writes": "Write-behind chunks dropped",
    "leases_expired": "Leases ended by their TTL",
}
#: Manager stats exported as gauges.
_GAUGE_STATS = {
    "leases": "Live leases",
    "pinned_chunks": "Chunks pinned by leases",
    "referenced_chunks": "CPU chunks being read or written",
    "cpu_chunks": "Chunks in the CPU tier",
    "cpu_used_bytes": "Bytes used in the CPU tier",
    "cpu_capacity_bytes": "Byte bound of the CPU tier",
    "disk_chunks": "Chunks in the disk tier",
    "disk_used_bytes": "Bytes used in the disk tier",
    "disk_capacity_bytes": "Byte bound of the disk tier",
}


class ServerMetrics:
    """The server's metric objects, in a private registry.

    Args:
        snapshot: returns ``(active_clients, [manager stats dict per namespace])``;
            called at scrape time.
    """

    def __init__(self, snapshot: Callable[[], tuple[int, list[dict[str, Any]]]]):
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("kvtier_server_requests", "Requests by op and result", ["op", "result"], registry=r)
        self.latency = Histogram(
            "kvtier_server_request_seconds", "Request handling time by op", ["op"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.lookups = Counter("kvtier_lookups", "Lookups served", registry=r)
        self.lookup_hit_tokens = Counter(
            "kvtier_lookup_hit_tokens", "Tokens found by lookups, by tier", ["tier"], registry=r
        )
        self.load_tokens = Counter("kvtier_load_tokens", "Tokens engines loaded, by tier", ["tier"], registry=r)
        self.bytes_in = Counter("kvtier_bytes_in", "Chunk bytes committed by clients", registry=r)
        self.bytes_out = Counter("kvtier_bytes_out", "Chunk bytes handed to clients for loading", registry=r)
        self.disconnect_releases = Counter(
            "kvtier_disconnect_releases", "Reservations, read references and leases released on client disconnect",
            ["kind"], registry=r,
        )
        r.register(_StateCollector(snapshot))
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
    def __init__(self, snapshot: Callable[[], tuple[int, list[dict[str, Any]]]]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        clients, stats = self._snapshot()
        g = GaugeMetricFamily("kvtier_active_clients", "Registered client connections")
        g.add_metric([], clients)
        yield g
        g = GaugeMetricFamily("kvtier_namespaces", "Key namespaces hosted")
        g.add_metric([], len(stats))
        yield g
        for name, doc in _COUNTER_STATS.items():
            c = CounterMetricFamily(f"kvtier_{name}", doc)
            c.add_metric([], sum(float(s.get(name, 0)) for s in stats))
            yield c
        for name, doc in _GAUGE_STATS.items():
            g = GaugeMetricFamily(f"kvtier_{name}", doc)
            g.add_metric([], sum(float(s.get(name, 0)) for s in stats))
            yield g


class MetricsHTTPServer:
    """Serves ``/metrics`` and ``/health`` on ``host:port`` in a daemon thread.

    Args:
        host: bind address (loopback by default in the CLI).
        port: TCP port; 0 picks a free one (see ``port`` after start).
        metrics: the server's metrics.
        health: returns ``(healthy, details)`` for ``/health``.

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(
        self, host: str, port: int, metrics: ServerMetrics, health: Callable[[], tuple[bool, dict[str, Any]]]
    ):
        outer_metrics, outer_health = metrics, health

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, code = outer_metrics.exposition(), CONTENT_TYPE_LATEST, 200
                elif path == "/health":
                    healthy, details = outer_health()
                    body = json.dumps({"status": "ok" if healthy else "unavailable", **details}).encode()
                    ctype, code = "application/json", 200 if healthy else 503
                else:
                    body, ctype, code = b"not found\n", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                return

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.host = host
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kvtier-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
