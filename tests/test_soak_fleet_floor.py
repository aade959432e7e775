"""The soak's machine-floor probe: it measures wake-up and one-hop IPC latency, and the report shows them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from kvtier.bench.soak_fleet_floor import ECHO_TIMEOUT_S, measure
from kvtier.bench.soak_fleet_report import build_report


def test_the_probe_samples_both_floors():
    out = measure(0.3)
    assert len(out["wake_ms"]) >= 5 and len(out["echo_ms"]) == len(out["wake_ms"])
    assert all(ms >= 0 for _, ms in out["wake_ms"])
    assert all(0 < ms < ECHO_TIMEOUT_S * 1e3 for _, ms in out["echo_ms"]) and out["stopped_early"] is None
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


def _probe(tmp_path, seconds: str, go=None, out=None):
    go = go or tmp_path / "go"
    out = out or tmp_path / "floor.json"
    return subprocess.Popen([sys.executable, "-m", "kvtier.bench.soak_fleet_floor", "--seconds", seconds, "--go",
                             str(go), "--out", str(out)], stderr=subprocess.PIPE, text=True), out


def _child_of(pid: int) -> int:
    from conftest import wait_until

    kids: list[int] = []

    def found() -> bool:
        kids[:] = [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
        return bool(kids)

    wait_until(found, 30, what="the echo child")
    return kids[0]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL])
def test_a_stopped_or_killed_echo_child_ends_the_probe_with_a_reason(tmp_path, sig):
    """A stopped child used to hang the probe in waitpid; a killed one added a fake 5 s sample."""
    (tmp_path / "go").write_text("go")
    p, out = _probe(tmp_path, "30")
    child = _child_of(p.pid)
    time.sleep(0.3)
    os.kill(child, sig)
    assert p.wait(timeout=30) == 0
    data = json.loads(out.read_text())
    assert data["stopped_early"] and data["echo_ms"]
    assert max(ms for _, ms in data["echo_ms"]) < ECHO_TIMEOUT_S * 1e3  # no made-up sample


@pytest.mark.parametrize("seconds", ["0", "-1", "nan", "inf"])
def test_bad_seconds_are_refused_before_measuring(tmp_path, seconds):
    (tmp_path / "go").write_text("go")
    p, out = _probe(tmp_path, seconds)
    assert p.wait(timeout=30) == 2 and "--seconds" in p.stderr.read() and not out.exists()


def test_an_unwritable_out_or_a_directory_go_is_refused(tmp_path):
    (tmp_path / "go").write_text("go")
    p, _ = _probe(tmp_path, "0.2", out=tmp_path / "no" / "such" / "floor.json")
    assert p.wait(timeout=30) == 2 and "--out" in p.stderr.read()
    (tmp_path / "godir").mkdir()
    from kvtier.bench import soak_fleet_floor

    old = soak_fleet_floor.GO_WAIT_S
    soak_fleet_floor.GO_WAIT_S = 0.3
    try:  # a directory is not the go file: nothing is measured
        assert soak_fleet_floor.main(["--seconds", "0.2", "--go", str(tmp_path / "godir"),
                                      "--out", str(tmp_path / "f.json")]) == 2
    finally:
        soak_fleet_floor.GO_WAIT_S = old
    assert not (tmp_path / "f.json").exists()
