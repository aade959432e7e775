"""The soak's machine-floor probe: it measures wake-up and one-hop IPC latency, and the report shows them."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

from kvtier.bench.soak_fleet_floor import ECHO_TIMEOUT_S, measure
from kvtier.bench.soak_fleet_report import build_report


def test_the_probe_samples_both_floors():
    out = measure(0.3)
    assert len(out["wake_ms"]) >= 5 and len(out["echo_ms"]) == len(out["wake_ms"])
    assert all(ms >= 0 for _, ms in out["wake_ms"])
    assert all(0 < ms < ECHO_TIMEOUT_S * 1e3 for _, ms in out["echo_ms"])  # a real round trip, not a timeout
    times = [t for t, _ in out["echo_ms"]]
    assert times == sorted(times)


def test_the_probe_runs_as_the_soak_starts_it(tmp_path):
    go, res = tmp_path / "go", tmp_path / "floor.json"
    go.write_text("go")
    subprocess.run([sys.executable, "-m", "kvtier.bench.soak_fleet_floor", "--seconds", "0.2", "--go", str(go),
                    "--out", str(res)], check=True, timeout=60)
    data = json.loads(res.read_text())
    assert data["echo_ms"] and data["wake_ms"]


def test_the_report_carries_the_floor_beside_the_lookups():
    opts = SimpleNamespace(rss_allowance=1 << 20, __dataclass_fields__={})
    floor = {"wake_ms": [[0.0, 1.0], [0.1, 3.0]], "echo_ms": [[0.0, 0.2], [0.1, 0.4]]}
    clients = [{"index": 0, "lookup_ms": [[0.0, 2.0]]}]
    rep = build_report(opts, 1.0, clients, {}, {}, {"attacks": {}, "baseline": True}, {}, {}, [], {}, {}, [], {},
                       floor=floor)
    assert rep["noise_floor_ms"]["echo"]["count"] == 2 and rep["noise_floor_ms"]["wake"]["max"] == 3.0
    note = next(c["note"] for c in rep["checks"] if c["name"] == "instance lookup p99")
    assert "machine floor p99" in note and "one-hop IPC" in note
    assert "machine floor" not in next(c["note"] for c in build_report(
        opts, 1.0, clients, {}, {}, {"attacks": {}, "baseline": True}, {}, {}, [], {}, {}, [], {})["checks"]
        if c["name"] == "instance lookup p99")
