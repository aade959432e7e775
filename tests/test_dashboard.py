"""The dashboard's data and routes without a browser (issue 13).

Failing inputs: page numbers read from another source than ``/metrics`` (they disagree);
an unbounded hot-prefix table or history; negative rates after a counter reset; event
streams that take every HTTP slot or outlive the server; operations without the token;
a static route that reads any file.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from service_helpers import connect, short_dir, start_server, store  # noqa: F401 (fixture)

from kvtier.config import KVTierConfig
from kvtier.dashboard.history import CounterHistory, rate_series
from kvtier.dashboard.hot import HotPrefixes
from kvtier.dashboard.samples import collect_samples, parse_exposition
from kvtier.dashboard.server_view import ServerDashboard
from kvtier.service.metrics import ServerMetrics
from kvtier.service.namespace_host import NamespaceStats
from kvtier.storage.stats import LowerTierStats, ManagerStats

KEYS = [bytes([i + 1]) * 32 for i in range(6)]


def test_registry_samples_equal_the_exposition() -> None:
    tiers = (LowerTierStats("disk", write_pending=2), LowerTierStats("remote", errors=4))
    stats = [NamespaceStats(ManagerStats(cpu_chunks=3, cpu_used_bytes=300, tiers=tiers))]
    m = ServerMetrics(lambda: (1, stats), KVTierConfig(), list)
    m.lookup_hit_tokens.labels("cpu").inc(32)
    m.lookup_hit_tokens.labels("disk").inc(16)
    got = collect_samples(m.registry)
    assert got == parse_exposition(m.exposition().decode())
    assert got['kvtier_lookup_hit_tokens_total{tier="disk"}'] == 16
    assert got["kvtier_disk_write_pending"] == 2  # queue depths are /metrics series too


def test_hot_prefixes_are_bounded_and_keep_the_heavy_hitters() -> None:
    hot = HotPrefixes(capacity=8)
    for i in range(2000):
        hot.observe(b"heavy-%d" % (i % 3) if i % 2 == 0 else b"rare-%d" % i, 16, 512, {"cpu": 16})
    top = hot.top(3)
    assert len(hot.top(100)) == 8
    assert {c.head for c in top} == {b"heavy-0", b"heavy-1", b"heavy-2"}
    assert all(c.count - c.error >= 300 for c in top)  # guaranteed lower bound on the true count
    with pytest.raises(ValueError):
        HotPrefixes(0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=400), st.integers(1, 10))
def test_space_saving_never_loses_an_item_above_n_over_k(stream: list[int], k: int) -> None:
    hot = HotPrefixes(capacity=k)
    for x in stream:
        hot.observe(bytes([x]), 1, 0, {})
    kept = {c.head: c for c in hot.top(k)}
    for x in set(stream):
        true = stream.count(x)
        if true > len(stream) / k:
            assert bytes([x]) in kept
        if bytes([x]) in kept:
            c = kept[bytes([x])]
            assert c.count - c.error <= true <= c.count


def test_history_rings_are_bounded_and_rates_never_negative() -> None:
    h = CounterHistory(short_points=5, long_points=3, long_step_s=60)
    for t in range(20):
        h.add(1000.0 + t, {"lookups": 10.0 * t, "lookup_tokens": 100.0 * t, "hit:cpu": 50.0 * t})
    h.add(1020.0, {"lookups": 0.0, "lookup_tokens": 0.0, "hit:cpu": 0.0})  # a restart
    short = h.samples("short")
    assert len(short) == 5 and len(h.samples("long")) == 1
    r = rate_series(short, ["lookups", "load_bytes"], {"hit_rate:cpu": ("hit:cpu", "lookup_tokens")})
    assert r["lookups"][:3] == [10.0, 10.0, 10.0] and r["lookups"][-1] == 0.0
    assert r["hit_rate:cpu"][:3] == [0.5, 0.5, 0.5] and r["hit_rate:cpu"][-1] is None
    assert "load_bytes" not in r  # never sampled: no series rather than zeros


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_server_snapshot_agrees_with_metrics(short_dir: Path) -> None:  # noqa: F811
    with start_server(short_dir, metrics_port=0) as srv:
        c = connect(short_dir / "s.sock")
        store(c, KEYS[:3])
        for _ in range(4):
            c.lookup_keys(KEYS[:5], None)
        base = f"http://127.0.0.1:{srv.metrics_port}"
        code, body = _get(base + "/dashboard/snapshot")
        metrics = parse_exposition(_get(base + "/metrics")[1].decode())
        snap = json.loads(body)
        assert code == 200 and snap["kind"] == "server"
        for row in snap["tiers"]:
            for field, series in row["series"].items():
                assert snap["metrics"][series] == metrics[series], (row["tier"], field)
        cpu = next(r for r in snap["tiers"] if r["tier"] == "cpu")
        assert snap["metrics"][cpu["series"]["chunks"]] == 3
        assert snap["hit_rate"] == pytest.approx(3 / 5)
        hot = snap["hot"]
        assert len(hot) == 1 and hot[0]["head"] == KEYS[2].hex() and hot[0]["count"] == 4  # named by its last key
        assert hot[0]["hit_tokens"] == 3 * srv.hosts()[0].namespace.chunk_size
        assert _get(base + "/")[0] == 200
        assert b"MIT" in _get(base + "/dashboard/static/vendor/uPlot.LICENSE")[1]
        assert _get(base + "/dashboard/static/../http.py")[0] == 404
        assert _get(base + "/dashboard/static/%2e%2e/__init__.py")[0] == 404
        c.close()


def _open_stream(port: int) -> tuple[socket.socket, bytes]:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"GET /dashboard/events HTTP/1.0\r\n\r\n")
    return s, s.recv(200)


@pytest.mark.slow
def test_event_streams_are_bounded_and_end_with_the_server(short_dir: Path) -> None:  # noqa: F811
    srv = start_server(short_dir, metrics_port=0)
    try:
        opened = [_open_stream(srv.metrics_port) for _ in range(4)]
        assert all(head.startswith(b"HTTP/1.0 200") for _, head in opened)
        extra, head = _open_stream(srv.metrics_port)
        assert head.startswith(b"HTTP/1.0 200")  # a fifth viewer gets one: the client's oldest ends
        first = opened.pop(0)[0]
        while first.recv(65536):  # ends (a hang fails by timeout)
            pass
        first.close()
        opened.append((extra, head))
        assert srv._http.dashboard_streams() == 4  # still at most 4 per client: scrapes keep their slots
        assert _get(f"http://127.0.0.1:{srv.metrics_port}/metrics")[0] == 200
        s0 = opened[0][0]
        data = b""
        while data.count(b"event: snapshot") < 2:  # a snapshot per second (the first one at once)
            data += s0.recv(65536)
        frame = data.split(b"event: snapshot\ndata: ", 1)[1].split(b"\n\n", 1)[0]
        assert json.loads(frame)["kind"] == "server"
    finally:
        srv.close()
    for s, _ in opened:  # close() ended every stream: each reads to EOF (a hang fails by timeout)
        while s.recv(65536):
            pass
        s.close()


def test_no_sampler_thread_when_asked(short_dir: Path) -> None:  # noqa: F811
    m = ServerMetrics(lambda: (0, []), KVTierConfig(), list)
    d = ServerDashboard(m, sample=False)
    d.tick(now=100.0)
    m.lookups.inc(5)
    d.tick(now=101.0)
    snap = d.snapshot()
    assert snap["history"]["short"]["lookups"] == [5.0]
    d.close()
