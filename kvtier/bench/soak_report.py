"""The report of ``kvtier bench soak``: per-client and overall figures, the judged targets, the tables.

Targets (issue 14): lookup p99 < ``P99_TARGET_MS`` over all the well-behaved
clients' lookups and for the worst client; no call of theirs refused (every
call not served counts: connect failures, error replies, calls skipped without
a connection, timeouts, disconnects, restarts not registered in time, a client
that failed); server RSS max within ``cpu_capacity + rss_allowance``. Issue 9 adds:
server RSS growth under ``RSS_GROWTH_TARGET_PCT`` (median of the samples 10-20% into the run
against the median of the last 10%), and no
live lease or held chunk left once every client has exited.
"""

from __future__ import annotations

from dataclasses import asdict
from statistics import median
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from kvtier.bench.common import Check, print_checks

if TYPE_CHECKING:
    from kvtier.bench.soak_options import SoakOptions

MiB = 1 << 20
#: Lookup p99 target of the well-behaved clients (milliseconds).
P99_TARGET_MS = 10.0
#: Server RSS growth allowed from 10% into the run to its end, percent (issue 9: under 1%).
RSS_GROWTH_TARGET_PCT = 1.0


def pct(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``xs`` (nan when empty)."""
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


#: Client counters that mean a call was not served.
REFUSAL_COUNTERS = ("connect_failures", "error_replies", "skipped_calls", "timeouts", "disconnects")


def summarise_clients(results: list[dict[str, Any]]) -> tuple[dict[str, Any], list[float]]:
    """Per-client and overall figures from the workers' JSON (latencies in ms)."""
    per: list[dict[str, Any]] = []
    every: list[float] = []
    for r in results:
        lat = r.get("lookup_ms", [])
        every.extend(lat)
        counters = r.get("counters", {})
        restarts = r.get("restart_ms", [])
        refused = (sum(int(counters.get(k, 0)) for k in REFUSAL_COUNTERS) + int(r.get("restart_failures", 0))
                   + (1 if r.get("error") else 0))
        per.append({
            "index": r.get("index"), "lookups": len(lat), "requests": r.get("requests", 0),
            "lookup_p50_ms": pct(lat, 50), "lookup_p99_ms": pct(lat, 99), "lookup_max_ms": max(lat, default=float("nan")),
            "hit_rate": r.get("hit_tokens", 0) / max(1, r.get("lookup_tokens", 0)),
            "refused": refused, "error": r.get("error", ""), "counters": counters,
            "restarts": len(restarts) + int(r.get("restart_failures", 0)),
            "restart_failures": int(r.get("restart_failures", 0)), "restart_max_ms": max(restarts, default=0.0),
            **{k: r.get(k, 0) for k in ("loaded_chunks", "stored_chunks", "load_misses", "corrupt_loads",
                                        "store_no_room", "store_in_flight", "store_present", "connected_s")},
        })
    tot = lambda k: sum(int(p.get(k, 0)) for p in per)
    overall = {
        "lookups": len(every), "lookup_p50_ms": pct(every, 50), "lookup_p99_ms": pct(every, 99),
        "lookup_max_ms": max(every, default=float("nan")),
        "hit_rate": sum(r.get("hit_tokens", 0) for r in results) / max(1, sum(r.get("lookup_tokens", 0) for r in results)),
        "refused": tot("refused"), "errors": sum(1 for p in per if p["error"]),
        "restarts": tot("restarts"), "restart_failures": tot("restart_failures"),
        "restart_max_ms": max((p["restart_max_ms"] for p in per), default=0.0),
        **{k: tot(k) for k in ("requests", "loaded_chunks", "stored_chunks", "load_misses", "corrupt_loads",
                               "store_no_room", "store_in_flight", "store_present")},
    }
    return {"per_client": per, "overall": overall}, every


def build_report(opts: SoakOptions, seconds: float, samples: dict[str, Any], results: list[dict[str, Any]],
            hostile: dict[str, Any], final_metrics: dict[str, float], server_alive: bool,
            server_exit: int | None, socket_removed: bool, server_log: dict[str, Any]) -> dict[str, Any]:
    clients, _ = summarise_clients(results)
    ov = clients["overall"]
    rss = samples["rss_bytes"]
    nan = float("nan")
    worst = max(clients["per_client"], key=lambda c: c["lookup_p99_ms"] if c["lookups"] else float("inf"),
                default={"index": -1, "lookup_p99_ms": nan, "lookup_p50_ms": nan, "lookup_max_ms": nan})
    bound = opts.cpu_capacity + opts.rss_allowance
    rss_max = max(rss, default=0)
    # Growth after warm-up: the first 10% of the samples fill the pool and the allocator's arenas.
    # Judged on window medians (samples 10-20% vs the last 10%): RSS oscillates by about +-1.5%
    # as clients restart, so two single samples measure the oscillation, not a leak.
    n = len(rss)
    warm = float(median(rss[n // 10 : max(n // 5, n // 10 + 1)])) if n else 0.0
    end = float(median(rss[-max(1, n // 10):])) if n else 0.0
    growth = (end - warm) / warm if warm else nan
    growth_endpoints = (rss[-1] - rss[n // 10]) / rss[n // 10] if n and rss[n // 10] else nan
    # Holds left once every client has exited (measured before the server is stopped): live leases
    # and CPU chunks still referenced (reserved or being read), summed over namespaces.
    holds = sum(v for k, v in final_metrics.items()
                if k.split("{")[0] in ("kvtier_leases", "kvtier_referenced_chunks"))
    checks = [
        Check("lookup p99, well-behaved clients", ov["lookup_p99_ms"], P99_TARGET_MS, False, "ms",
              f"p50 {ov['lookup_p50_ms']:.2f} ms, max {ov['lookup_max_ms']:.1f} ms, {ov['lookups']:,} lookups"),
        Check("lookup p99, worst client", worst["lookup_p99_ms"], P99_TARGET_MS, False, "ms",
              f"client {worst['index']}: p50 {worst['lookup_p50_ms']:.2f} ms, max {worst['lookup_max_ms']:.1f} ms"),
        Check("calls refused, well-behaved clients", ov["refused"], 0, False, "",
              f"{ov['errors']} clients failed; {ov['restarts']} restarts (slowest {ov['restart_max_ms']:.0f} ms); "
              f"store no-room {ov['store_no_room']:,} (not judged)"),
        Check("server RSS max vs bound", rss_max / MiB, bound / MiB, False, "MiB",
              f"pool {opts.cpu_capacity / MiB:.0f} MiB + allowance {opts.rss_allowance / MiB:.0f} MiB; "
              f"{len(rss)} samples"),
        Check("server RSS growth after warm-up", growth * 100, RSS_GROWTH_TARGET_PCT, False, "%",
              f"median {warm / MiB:.1f} MiB (10-20% of the run) -> {end / MiB:.1f} MiB (last 10%); "
              f"single samples {growth_endpoints * 100:.2f}%"),
        Check("leases and held chunks left after the clients exit", holds, 0, False, "",
              "kvtier_leases + kvtier_referenced_chunks from /metrics"),
        Check("server alive at the end", float(server_alive), 1.0, True, "", f"exit code {server_exit} after SIGTERM; log {server_log.get('lines', 0):,} lines, "
              f"{server_log.get('levels', {}).get('WARNING', 0):,} warnings, {server_log.get('tracebacks', 0)} tracebacks"),
    ]
    print_checks(f"kvtier bench soak: {opts.clients} clients + 1 hostile, {seconds:.0f} s, "
                 f"hit rate {ov['hit_rate']:.1%}", checks)
    _print_attacks(hostile)
    return {
        "options": asdict(opts), "seconds": seconds,
        "targets": {"lookup_p99_ms": P99_TARGET_MS, "refused": 0, "rss_bound_bytes": bound,
                    "rss_growth_pct": RSS_GROWTH_TARGET_PCT, "holds_left": 0},
        "checks": [{**asdict(c), "passed": c.passed} for c in checks],
        "passed": all(c.passed for c in checks),
        "clients": clients,
        "server": {
            "rss_max_bytes": rss_max, "rss_bound_bytes": bound, "rss_samples_bytes": rss,
            "rss_first_bytes": rss[0] if rss else 0, "rss_last_bytes": rss[-1] if rss else 0,
            "rss_warm_bytes": warm, "rss_end_bytes": end, "rss_growth_pct": growth * 100,
            "rss_growth_endpoints_pct": growth_endpoints * 100, "holds_left": holds,
            "alive_at_end": server_alive, "exit_code": server_exit, "socket_removed": socket_removed,
            "health": samples["health"], "health_not_ok": samples["health_not_ok"],
            "metrics_scrapes": samples["metrics_scrapes"], "metrics_scrape_failures": samples["metrics_scrape_failures"],
            "metrics_scrape_ms_p99": samples["metrics_scrape_ms_p99"], "final_metrics": final_metrics,
            "log": server_log,
        },
        "hostile": hostile,
    }


def _print_attacks(hostile: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="hostile client: attacks run and what the server answered")
    for col in ("attack", "runs", "actions", "outcomes"):
        table.add_column(col, justify="right" if col in ("runs", "actions") else "left")
    for name, t in hostile.items():
        outcomes = ", ".join(f"{k} {v:,}" for k, v in sorted(t.get("outcomes", {}).items()))
        table.add_row(name, f"{t.get('runs', 0):,}", f"{t.get('actions', 0):,}", outcomes)
    Console(width=max(Console().width, 130)).print(table)
