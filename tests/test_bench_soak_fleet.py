"""``kvtier bench soak-fleet``: a short run (45 s) of the issue-24 soak, every attack in it.

A keyed fleet (3 ``kvtier server`` processes, a controller, ``kvtier router`` and ``kvtier pd-proxy``
in front of fake OpenAI backends) under load while the hostile client loops over every attack. The
latency and RSS targets are not asserted here (a shared, noisy machine: the full 10-minute run
judges them); what is asserted is what no load excuses: every attack ran, none of kinds 1-3
achieved its aim, no instance dropped off, every load was audited and none had wrong bytes (P2P
loads among them), members still read the event streams, and everything was cleaned up.
"""

from __future__ import annotations

import pytest

import json
import os
import subprocess
import sys
from pathlib import Path

from kvtier.bench.soak_fleet_hostile import attacks


def _leftovers() -> set[str]:
    return {n for n in os.listdir("/tmp") if n.startswith(("kvsoakf-", "kvsoak-hostile-"))}


@pytest.mark.slow  # over 5 s on 2 cores: out of the fast loop
def test_short_fleet_soak_runs_every_attack_and_nothing_gets_through(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    before = _leftovers()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "soak-fleet", "--duration", "45", "--router-model", "",
         "--json", str(out)], env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["passed"] is (proc.returncode == 0)
    assert "attacks" in rep, (rep.get("error", rep), proc.stdout[-2000:], proc.stderr[-3000:])  # the fleet came up
    assert set(rep["attacks"]) == set(attacks())
    for name, a in rep["attacks"].items():
        assert a["attempts"] > 0 and a["actions"] > 0, (name, a)
        if a["kind"] <= 3:
            assert a["successes"] == 0, (name, a["examples"], a["effect_events"])
    assert {k for k, v in rep["kinds"].items() if v["attempts"]} == {"1", "2", "3", "4", "5", "6"}
    assert rep["errors"] == {}, rep["errors"]  # no worker failed, no attack hung
    assert rep["drop_offs"] == 0 and rep["dead"] == [], (rep["monitor_events"], rep["dead"])
    loads = rep["loads"]
    assert loads["audited"] > 0 and loads["mismatches"] == 0, loads["mismatch_details"]
    assert loads["via_p2p"] > 0 and loads["monitor_peer_pulls"] > 0 and loads["monitor_peer_mismatches"] == 0
    for k in ("index_poisoned", "over_capacity", "foreign_namespace", "peer_mismatch", "audit_mismatch", "drop_off"):
        assert k not in rep["failures"], rep["monitor_events"]
    assert sum(v for k, v in rep["monitor_counters"].items() if k.startswith("member_event_batches_")) > 0
    for k in ("instances", "controller", "router_request"):
        assert rep["lookup_ms"][k]["count"] > 0, k
    for name in ("controller", "router", "inst-0"):
        assert rep["rss"][name]["samples"] >= 30 and rep["rss"][name]["max_bytes"] > 0, name
    assert _leftovers() <= before  # temp dirs (sockets, keys, logs, the hostile's poison store) removed


def test_the_report_counts_a_run_as_a_success_by_what_it_saw_its_effects_or_leaked_secrets() -> None:
    from dataclasses import dataclass

    from kvtier.bench.soak_fleet_report import build_report

    @dataclass
    class Opts:
        rss_allowance: int = 1 << 20

    def tally(kind: int, effects: list[str], windows: list[list[float]], bodies: dict[str, str] | None = None):
        return {"kind": kind, "effects": effects, "runs": len(windows), "actions": len(windows), "windows": windows,
                "direct_successes": sum(int(w[2]) for w in windows), "bodies": bodies or {}}

    hostile = {"attacks": {
        "quiet": tally(1, ["drop_off"], [[0.0, 1.0, 0], [5.0, 6.0, 0]]),
        "seen": tally(3, [], [[0.0, 1.0, 1], [2.0, 3.0, 0]]),
        "effect": tally(2, ["drop_off"], [[10.0, 11.0, 0], [20.0, 21.0, 0]]),
        "leaky": tally(4, [], [[0.0, 1.0, 0]], {"controller GET /": "... s3cret-token ..."}),
        "pd_client_params": tally(5, [], [[0.0, 1.0, 0]]),
    }}
    monitor = {"events": [{"kind": "drop_off", "t": 12.5, "detail": "inst-0"}], "event_counts": {"drop_off": 1},
               "counters": {"member_event_batches_inst-0": 3}}
    clients = [{"index": 0, "lookup_ms": [[1.0, 2.0]], "loads": 5, "loads_by_source": {"peer": 2, "cpu": 3},
                "mismatches": 0}]
    rss = {"controller": [(float(t), 100 << 20) for t in range(20)], "router": [(float(t), 100 << 20) for t in range(20)]}
    rss["router"][15] = (15.0, 300 << 20)  # above warm + allowance: an rss_router event at t=15
    rep = build_report(Opts(), 30.0, clients, {"lookup_ms": [[1.0, 3.0]], "router_ms": [[1.0, 9.0]]}, monitor,
                       hostile, rss, {"decode": {"marked": 2}}, [], {}, {}, ["s3cret-token"], {})
    a = rep["attacks"]
    assert a["quiet"]["successes"] == 0
    assert a["seen"]["successes"] == 1  # the run that saw its aim achieved
    assert a["effect"]["successes"] == 1 and a["effect"]["effect_events"] == {"drop_off": 1}  # 12.5 is within 11 + 2 s
    assert a["leaky"]["successes"] == 1 and a["leaky"]["leaked_in"] == ["controller GET /"]
    assert a["pd_client_params"]["successes"] == 2  # the fake decoder received client params twice
    assert rep["kinds"]["2"] == {"attacks": 1, "attempts": 2, "successes": 1}
    assert rep["failures"] == {"drop_off": 1, "rss_router": 1} and not rep["passed"]
    assert rep["rss"]["router"]["max_bytes"] == 300 << 20 and rep["loads"]["via_p2p"] == 2
