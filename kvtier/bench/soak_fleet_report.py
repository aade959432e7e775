"""The report of ``kvtier bench soak-fleet``: attacks and their successes, the fleet's health, the verdict.

An attack run **succeeds** when it achieved its aim: the hostile client saw it itself (an answer
from a socket that must not answer, a chunk, an event, a 200 without the token...), the monitor
recorded, during the run or within ``GRACE_S`` after it, an event the attack aims at (an instance
dropping off, a stalled lookup, a locked-out operator or peer, an RSS jump...), or an answer it got
without credentials holds one of the fleet's secrets (token, server token, secret keys: the
hostile does not know them; the report scans what it kept). PD proxy forwarding is seen by the
fake decoder, which records every ``kv_transfer_params`` carrying the hostile's marker.

Targets (issue 24): no attack succeeds; no instance drops off (and every fleet process is alive at
the end); no load of a poisoned or foreign chunk (every load audited: workload clients and the
monitor's peer pulls; at least one load arrived via P2P, so the audit covered that path); no fleet
failure the monitor saw, attributed or not; lookup p99 < ``P99_TARGET_MS`` (the instances' lookups,
a local miss included, and the controller's ``/lookup``); controller and router RSS bounded (max
within ``rss_allowance`` of its median 10-20 % into the run).
"""

from __future__ import annotations

from statistics import median
from typing import Any, Sequence

from kvtier.bench.common import Check, print_checks
from kvtier.bench.soak_report import pct

MiB = 1 << 20
#: Lookup p99 target (milliseconds).
P99_TARGET_MS = 10.0
#: Seconds after an attack run in which a monitor event still counts as its effect.
GRACE_S = 2.0
#: Monitor events that are fleet failures whatever caused them.
FAILURE_EVENTS = ("drop_off", "lookup_stall", "router_stall", "operator_lockout", "peer_lockout", "peer_mismatch",
                  "index_poisoned", "over_capacity", "foreign_namespace", "rss_controller", "rss_router",
                  "audit_mismatch")


def rss_summary(samples: Sequence[tuple[float, int]], allowance: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start/end/max/warm RSS (bytes) of one process's ``(monotonic t, rss)`` samples, and an event per
    sample above ``warm + allowance`` (warm: the median of the samples 10-20 % into the run)."""
    rss = [r for _, r in samples]
    n = len(rss)
    if not n:
        return {"samples": 0}, []
    warm = float(median(rss[n // 10 : max(n // 5, n // 10 + 1)]))
    events = [{"t": t, "detail": f"RSS {r / MiB:.0f} MiB > warm {warm / MiB:.0f} + {allowance / MiB:.0f} MiB"}
              for t, r in samples if r > warm + allowance]
    return {"samples": n, "start_bytes": rss[0], "end_bytes": rss[-1], "max_bytes": max(rss), "warm_bytes": warm,
            "bound_bytes": warm + allowance, "over_bound_samples": len(events)}, events


def _attribute(tally: dict[str, Any], events: list[dict[str, Any]], leaks: int) -> dict[str, Any]:
    """Runs of one attack that succeeded (direct, by an effect event in their window, or leaked secrets)."""
    mine = [e for e in events if e["kind"] in tally.get("effects", [])]
    succeeded = 0
    by_effect: dict[str, int] = {}
    for t0, t1, direct in tally.get("windows", []):
        hits = [e for e in mine if t0 <= e["t"] <= t1 + GRACE_S]
        for e in hits:
            by_effect[e["kind"]] = by_effect.get(e["kind"], 0) + 1
        succeeded += bool(direct or hits)
    return {"kind": tally["kind"], "attempts": tally.get("runs", 0), "actions": tally.get("actions", 0),
            "successes": succeeded + leaks, "direct_successes": tally.get("direct_successes", 0),
            "effect_events": by_effect, "secret_leaks": leaks, "outcomes": tally.get("outcomes", {}),
            "examples": tally.get("examples", []), "effects": tally.get("effects", [])}


def _leaks(tally: dict[str, Any], secrets: Sequence[str]) -> list[str]:
    return [where for where, body in tally.get("bodies", {}).items() if any(s and s in body for s in secrets)]


def build_report(opts: Any, seconds: float, clients: list[dict[str, Any]], lookups: dict[str, Any],
                 monitor: dict[str, Any], hostile: dict[str, Any], rss: dict[str, list[tuple[float, int]]],
                 seen_pd: dict[str, Any], dead: list[str], exits: dict[str, int | None], logs: dict[str, Any],
                 secrets: Sequence[str], p2p_metrics: dict[str, float],
                 controller_counters: dict[str, float] | None = None,
                 floor: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON report (and the printed tables) of one run; ``passed`` is the verdict.

    ``floor``: :mod:`.soak_fleet_floor`'s samples (the machine's wake-up and one-hop IPC latency in
    the same run); reported beside the lookup figures, not judged.
    """
    baseline = bool(hostile.get("baseline"))
    rss_out: dict[str, Any] = {}
    events = [*monitor.get("events", []), *lookups.get("events", [])]
    for name, samples in rss.items():
        summary, over = rss_summary(samples, opts.rss_allowance)
        rss_out[name] = summary
        if name in ("controller", "router"):
            events += [{"kind": f"rss_{name}", **e} for e in over]
    for c in clients:
        events += [{"kind": "audit_mismatch", "t": d.get("t", 0.0), "detail": d.get("key", "")}
                   for d in c.get("mismatch_details", [])]
    pd_marked = sum(int(s.get("marked", 0)) for s in seen_pd.values())
    attacks: dict[str, Any] = {}
    for name, tally in hostile.get("attacks", {}).items():
        leaked = _leaks(tally, secrets)
        attacks[name] = _attribute(tally, events, len(leaked))
        attacks[name]["leaked_in"] = leaked
    if "pd_client_params" in attacks:  # the fake decoder saw the client's params: forwarded
        attacks["pd_client_params"]["successes"] += pd_marked
        attacks["pd_client_params"]["decoder_received_client_params"] = pd_marked
    kinds: dict[str, dict[str, int]] = {}
    for a in attacks.values():
        k = kinds.setdefault(str(a["kind"]), {"attacks": 0, "attempts": 0, "successes": 0})
        k["attacks"] += 1
        k["attempts"] += a["attempts"]
        k["successes"] += a["successes"]
    failures = {k: sum(1 for e in events if e["kind"] == k) for k in FAILURE_EVENTS}
    failures = {k: v for k, v in failures.items() if v}
    timed = {"instances": [x for c in clients for x in c.get("lookup_ms", [])],
             "controller": lookups.get("lookup_ms", []), "router_request": lookups.get("router_ms", [])}
    lookup_ms, ctl_ms, router_ms = ([ms for _, ms in timed[k]] for k in ("instances", "controller", "router_request"))
    for name, a in attacks.items():  # which attacks the slow lookups coincide with (diagnosis, not judged)
        wins = hostile["attacks"][name].get("windows", [])
        a["lookup_p99_ms_during"] = {k: pct([ms for t, ms in v if any(w[0] <= t <= w[1] for w in wins)], 99)
                                     for k, v in timed.items()}
    loads = sum(int(c.get("loads", 0)) for c in clients)
    by_source: dict[str, int] = {}
    for c in clients:
        for src, n in c.get("loads_by_source", {}).items():
            by_source[src] = by_source.get(src, 0) + int(n)
    mismatches = sum(int(c.get("mismatches", 0)) for c in clients)
    probe_loads = int(monitor.get("counters", {}).get("peer_probe_loads", 0))
    probe_mismatch = int(monitor.get("event_counts", {}).get("peer_mismatch", 0))
    drop_offs = int(monitor.get("event_counts", {}).get("drop_off", 0))
    member_events = sum(v for k, v in monitor.get("counters", {}).items() if k.startswith("member_event_batches_"))
    errors = {f"client-{c.get('index')}": c["error"] for c in clients if c.get("error")}
    for name, part in (("lookups", lookups), ("monitor", monitor), ("hostile", hostile)):
        if part.get("error") or not part or (name == "hostile" and not baseline and not part.get("attacks")):
            errors[name] = part.get("error") or "no result"
    total_success = sum(a["successes"] for a in attacks.values())
    never_ran = [n for n, a in attacks.items() if a["attempts"] == 0]
    if not baseline and not attacks:
        never_ran = ["(no hostile result)"]
    p2p = by_source.get("peer", 0)
    ctl, rtr = rss_out.get("controller", {}), rss_out.get("router", {})
    checks = [] if baseline else [
        Check("attack runs that achieved their aim", total_success, 0, False, "",
              ", ".join(f"kind {k}: {v['successes']}/{v['attempts']}" for k, v in sorted(kinds.items()))),
        Check("attacks that never ran", len(never_ran), 0, False, "", ", ".join(never_ran)[:120]),
    ]
    floor_ms = {k: [ms for _, ms in (floor or {}).get(k, [])] for k in ("wake_ms", "echo_ms")}
    stopped = (floor or {}).get("stopped_early")
    floor_note = (f"; machine floor p99: wake-up {pct(floor_ms['wake_ms'], 99):.2f} ms, one-hop IPC "
                  f"{pct(floor_ms['echo_ms'], 99):.2f} ms" + (" (probe stopped early)" if stopped else "")
                  if floor_ms["echo_ms"] else "")
    checks += [
        Check("instance drop-offs", drop_offs + sum(1 for d in dead if d.startswith("inst-")), 0, False, "",
              f"dead processes: {', '.join(dead) or 'none'}"),
        Check("fleet processes dead before the end", len(dead), 0, False, ""),
        Check("audited loads of wrong bytes", mismatches + probe_mismatch, 0, False, "",
              f"{loads:,} loads audited ({p2p:,} via P2P) + {probe_loads:,} monitor peer pulls"),
        Check("loads that arrived via P2P (audit covers them)", p2p, 1, True, "", f"by source: {by_source}"),
        Check("fleet failures the monitor saw", sum(failures.values()), 0, False, "",
              ", ".join(f"{k} {v}" for k, v in failures.items()) or "none"),
        Check("instance lookup p99", pct(lookup_ms, 99), P99_TARGET_MS, False, "ms",
              f"p50 {pct(lookup_ms, 50):.2f} ms, {len(lookup_ms):,} lookups (a local miss asks the controller and a peer)"
              f"{floor_note}"),
        Check("controller /lookup p99", pct(ctl_ms, 99), P99_TARGET_MS, False, "ms",
              f"p50 {pct(ctl_ms, 50):.2f} ms, {len(ctl_ms):,} lookups"),
        Check("controller RSS max", ctl.get("max_bytes", 0) / MiB, ctl.get("bound_bytes", 0) / MiB, False, "MiB",
              f"start {ctl.get('start_bytes', 0) / MiB:.0f}, end {ctl.get('end_bytes', 0) / MiB:.0f} MiB"),
        Check("router RSS max", rtr.get("max_bytes", 0) / MiB, rtr.get("bound_bytes", 0) / MiB, False, "MiB",
              f"start {rtr.get('start_bytes', 0) / MiB:.0f}, end {rtr.get('end_bytes', 0) / MiB:.0f} MiB"),
        Check("member KV event batches read (the stream works)", member_events, 1, True, ""),
        Check("worker errors", len(errors), 0, False, "", "; ".join(f"{k}: {v}" for k, v in errors.items())[:120]),
    ]
    print_checks(f"kvtier bench soak-fleet: {len(clients)} clients, 3 instances + controller + router"
                 f"{' (baseline: no hostile client)' if baseline else ' + hostile'}, {seconds:.0f} s", checks)
    _print_attacks(attacks)
    return {
        "options": {k: getattr(opts, k) for k in opts.__dataclass_fields__}, "seconds": seconds,
        "passed": all(c.passed for c in checks), "baseline": baseline,
        "checks": [{"name": c.name, "measured": c.measured, "target": c.target, "passed": c.passed, "note": c.note}
                   for c in checks],
        "kinds": kinds, "attacks": attacks, "failures": failures,
        "monitor_events": [e for e in events if e["kind"] in FAILURE_EVENTS][:200],
        "drop_offs": drop_offs,
        "loads": {"audited": loads, "mismatches": mismatches, "by_source": by_source, "via_p2p": p2p,
                  "monitor_peer_pulls": probe_loads, "monitor_peer_mismatches": probe_mismatch,
                  "mismatch_details": [d for c in clients for d in c.get("mismatch_details", [])][:32],
                  "server_p2p_metrics": p2p_metrics},
        "lookup_ms": {
            "instances": {"p50": pct(lookup_ms, 50), "p99": pct(lookup_ms, 99), "max": max(lookup_ms, default=0.0),
                          "count": len(lookup_ms)},
            "controller": {"p50": pct(ctl_ms, 50), "p99": pct(ctl_ms, 99), "max": max(ctl_ms, default=0.0),
                           "count": len(ctl_ms)},
            "router_request": {"p50": pct(router_ms, 50), "p99": pct(router_ms, 99), "max": max(router_ms, default=0.0),
                               "count": len(router_ms)},
        },
        "noise_floor_ms": {k.removesuffix("_ms"): {"p50": pct(v, 50), "p99": pct(v, 99), "max": max(v, default=0.0),
                                                   "count": len(v)} for k, v in floor_ms.items()}
                           | {"stopped_early": stopped},
        "rss": rss_out, "exit_codes": exits, "dead": dead, "errors": errors, "logs": logs,
        "clients": [{k: v for k, v in c.items() if k not in ("lookup_ms",)} for c in clients],
        "monitor_counters": monitor.get("counters", {}), "pd_seen": seen_pd,
        "controller_counters": controller_counters or {},
    }


def _print_attacks(attacks: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="hostile client: attacks (issue 24 kinds), runs, and runs that achieved their aim")
    for col in ("kind", "attack", "runs", "actions", "successes", "outcomes"):
        table.add_column(col, justify="right" if col in ("kind", "runs", "actions", "successes") else "left")
    for name, a in sorted(attacks.items(), key=lambda kv: (kv[1]["kind"], kv[0])):
        outcomes = ", ".join(f"{k} {v:,}" for k, v in sorted(a["outcomes"].items()))
        ok = a["successes"] == 0
        table.add_row(str(a["kind"]), name, f"{a['attempts']:,}", f"{a['actions']:,}",
                      f"[{'green' if ok else 'red'}]{a['successes']}[/]", outcomes[:200])
    Console(width=max(Console().width, 160)).print(table)
