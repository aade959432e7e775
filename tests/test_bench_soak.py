"""``kvtier bench soak``: a short run with 2 clients (shape of the report, every attack really ran).

The latency/RSS targets are not asserted here (a shared, noisy machine); the
run itself is the check that the soak starts, attacks, measures and cleans up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench.soak import SoakOptions, soak_main
from kvtier.bench.soak_hostile import ATTACKS
from kvtier.bench.soak_report import summarise_clients


def _soak_dirs() -> set[str]:
    return {n for n in os.listdir("/tmp") if n.startswith("kvsoak-")}


@pytest.mark.slow  # a real soak, ~13 s on 2 cores
def test_short_soak_reports_every_figure_and_every_attack(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    before = _soak_dirs()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "soak", "--minutes", "0.15", "--clients", "2",
         "--restart-every", "3", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["passed"] is (proc.returncode == 0)
    assert {c["name"] for c in rep["checks"]} >= {
        "lookup p99, well-behaved clients", "lookup p99, worst client", "calls refused, well-behaved clients", "server RSS max vs bound",
    }
    per = rep["clients"]["per_client"]
    assert [c["index"] for c in per] == [0, 1]
    for c in per:
        assert c["error"] == "" and c["lookups"] > 0, c
        for k in ("lookup_p50_ms", "lookup_p99_ms", "lookup_max_ms", "hit_rate", "refused"):
            assert isinstance(c[k], (int, float)), k
        assert c["corrupt_loads"] == 0
    ov = rep["clients"]["overall"]
    assert ov["lookups"] == sum(c["lookups"] for c in per)
    assert 0 < ov["hit_rate"] < 1  # shared system prompts hit; new turns miss
    assert ov["restarts"] > 0  # clients re-registered while the hostile client attacked
    server = rep["server"]
    assert server["rss_max_bytes"] > 0 and server["rss_bound_bytes"] == rep["targets"]["rss_bound_bytes"]
    assert len(server["rss_samples_bytes"]) >= 5 and server["metrics_scrapes"] >= 5
    assert isinstance(server["rss_growth_pct"], float) and isinstance(server["holds_left"], (int, float))
    assert server["exit_code"] == 0 and server["socket_removed"]
    assert any(k.startswith("kvtier_") for k in server["final_metrics"])
    assert server["log"]["lines"] > 0 and server["log"]["bytes"] > 0
    hostile = rep["hostile"]
    assert set(hostile) == set(ATTACKS)
    for name, tally in hostile.items():
        assert tally["runs"] > 0 and tally["actions"] > 0, (name, tally)
        # An attack cut short by the server (refused, hung up, timed out) is an outcome; anything else is a bug here.
        assert {k for k in tally["outcomes"] if k.startswith("raised_")} <= {"raised_closed", "raised_timeout"}, tally
    assert hostile["hoard"]["outcomes"].get("reservation_held", 0) > 0
    assert "skipped_no_tcp" not in hostile["wrong_token"]["outcomes"]
    assert _soak_dirs() <= before  # temp dir (socket, logs, token) removed


@pytest.mark.parametrize(
    "args, flag",
    [
        ((10.0, 0, 20.0, "64MiB", "128MiB"), "--clients"),
        ((0.0, 2, 20.0, "64MiB", "128MiB"), "--minutes"),
        ((1.0, 2, 0.0, "64MiB", "128MiB"), "--rate"),
        ((1.0, 2, 20.0, "10XB", "128MiB"), "--cpu-capacity"),
        ((1.0, 2, 20.0, "1MiB", "128MiB"), "--cpu-capacity"),
        ((1.0, 2, 20.0, "64MiB", "-1"), "--rss-allowance"),
        ((1.0, 2, 20.0, "64MiB", "128MiB", True, None, -1.0), "--restart-every"),
    ],
)
def test_usage_errors_exit_2_naming_the_flag(args: tuple, flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    full = (*args, True, None) if len(args) == 5 else args
    assert soak_main(*full) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err


def test_summary_counts_every_unserved_call_as_refused() -> None:
    ok = {"index": 0, "lookup_ms": [1.0] * 99 + [50.0], "lookup_tokens": 100, "hit_tokens": 25, "counters": {}}
    bad = {"index": 1, "lookup_ms": [2.0], "lookup_tokens": 100, "hit_tokens": 75,
           "counters": {"timeouts": 1, "error_replies": 2, "lost_stores": 5}, "restart_failures": 1}
    summary, every = summarise_clients([ok, bad])
    assert len(every) == 101
    assert summary["per_client"][0]["refused"] == 0 and summary["per_client"][1]["refused"] == 4
    assert summary["overall"]["refused"] == 4 and summary["overall"]["hit_rate"] == 0.5
    assert summary["per_client"][0]["lookup_max_ms"] == 50.0
    assert SoakOptions().problems() == []
