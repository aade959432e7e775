"""Metrics an operator can build a dashboard on (issue 14, item 14).

Failing inputs: no counter of tokens looked up (no token hit rate); capacities read 0 until
the first engine registers; no remote series (puts failed, errors, breaker state per node);
no ``process_*`` or build info; byte counters named with the unit in the middle.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("prometheus_client")

from service_helpers import connect, store, short_dir, start_server  # noqa: F401 (fixture)

from kvtier import __version__
from kvtier.config import KVTierConfig
from kvtier.service.metrics import ServerMetrics
from kvtier.service.namespace_host import NamespaceStats
from kvtier.storage.stats import LowerTierStats, ManagerStats

KEYS = [bytes([i + 1]) * 32 for i in range(4)]


def _values(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and line[0] != "#"}


class _FakeRemote:
    """A lower tier's ``stats()`` with per-node breaker states, as the Redis tier reports them."""

    def __init__(self, breakers: dict[str, str]):
        self._breakers = breakers

    def stats(self) -> dict[str, Any]:
        return {"puts": 5, "breakers": self._breakers}


def test_capacities_are_exported_before_any_engine_registers(tmp_path: Path) -> None:
    cfg = KVTierConfig(cpu_capacity="64MiB", disk_path=tmp_path, disk_capacity="1GiB")
    m = ServerMetrics(lambda: (0, []), cfg, list)
    v = _values(m.exposition().decode())
    assert v["kvtier_cpu_capacity_bytes"] == 64 << 20
    assert v["kvtier_disk_capacity_bytes"] == 1 << 30
    assert v["kvtier_namespaces"] == 0


def test_remote_series_process_and_build_info() -> None:
    remote = LowerTierStats("remote", put_failed=3, errors=7, bytes_written=100, skipped_calls=2)
    stats = [NamespaceStats(ManagerStats(tiers=(remote,)))]
    tiers = [_FakeRemote({"10.0.0.5:7000": "open", "10.0.0.6:7000": "closed"}), _FakeRemote({"standalone": "half-open"})]
    m = ServerMetrics(lambda: (1, stats), KVTierConfig(), lambda: tiers)  # type: ignore[arg-type,return-value]
    text = m.exposition().decode()
    v = _values(text)
    assert v["kvtier_remote_put_failed_chunks_total"] == 3
    assert v["kvtier_remote_errors_total"] == 7
    assert v["kvtier_remote_written_bytes_total"] == 100
    assert v["kvtier_remote_skipped_calls_total"] == 2
    assert v['kvtier_remote_breaker_open{node="10.0.0.5:7000"}'] == 1
    assert v['kvtier_remote_breaker_open{node="10.0.0.6:7000"}'] == 0
    assert v['kvtier_remote_breaker_open{node="standalone"}'] == 1  # half-open: still missing
    assert any(name.startswith("process_") for name in v)  # ProcessCollector on the private registry
    assert 'kvtier_build_info{python="' in text and f'version="{__version__}"' in text


def test_byte_counters_end_with_the_unit() -> None:
    text = ServerMetrics(lambda: (0, []), KVTierConfig(), list).exposition().decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
    with_bytes = {n.removesuffix("_created") for n in names if "bytes" in n}
    assert {"kvtier_committed_bytes_total", "kvtier_served_bytes_total"} <= with_bytes
    assert not {"kvtier_bytes_in_total", "kvtier_bytes_out_total"} & names
    assert all(n.endswith(("_bytes", "_bytes_total")) for n in with_bytes), with_bytes


def test_lookup_tokens_give_a_token_hit_rate(short_dir: Path) -> None:  # noqa: F811
    """Two chunks stored, three looked up: hit tokens / looked-up tokens = 2/3."""
    with start_server(short_dir, metrics_port=0) as srv:
        a = connect(short_dir / "s.sock")
        store(a, KEYS[:2])
        a.lookup_keys(KEYS[:3], "r")
        text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
        v = _values(text)
        # One family per name (Prometheus refuses a second HELP/TYPE for a name; a dict hides it).
        helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")]
        assert len(helps) == len(set(helps)), sorted({h for h in helps if helps.count(h) > 1})
        samples = [line.rsplit(" ", 1)[0] for line in text.splitlines() if line and line[0] != "#"]
        assert len(samples) == len(set(samples)), sorted({x for x in samples if samples.count(x) > 1})
        cs = srv.hosts()[0].namespace.chunk_size
        assert v["kvtier_lookup_tokens_total"] == 3 * cs
        assert v['kvtier_lookup_hit_tokens_total{tier="cpu"}'] == 2 * cs
        assert v["kvtier_cpu_capacity_bytes"] == int(srv.config.cpu_capacity)
        a.close()


def test_a_requests_repeated_lookups_count_its_hit_once(short_dir: Path) -> None:  # noqa: F811
    """Issue 23, item 11: vLLM repeats a lookup after each failed block allocation (same request id,
    its lease still live). Three failed allocations and one load: the request's 3-chunk hit is
    counted once (it was counted 4 times). After its load ends the lease, a new request is a new
    count; a repeat that finds more adds only the new chunks."""
    with start_server(short_dir, metrics_port=0) as srv:
        a = connect(short_dir / "s.sock")
        cs = srv.hosts()[0].namespace.chunk_size

        def counters() -> tuple[float, float]:
            text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
            v = _values(text)
            return v['kvtier_lookup_hit_tokens_total{tier="cpu"}'], v["kvtier_lookup_tokens_total"]

        store(a, KEYS[:3])
        for _ in range(4):  # the first lookup, then three after failed allocations
            assert a.lookup_keys(KEYS, "req-1").num_tokens == 3 * cs
        assert counters() == (3 * cs, 4 * cs)
        a.release("req-1")  # the load ended the lease
        a.lookup_keys(KEYS, "req-1")  # e.g. preempted and looked up again: a new attempt
        assert counters() == (6 * cs, 8 * cs)
        a.release("req-1")
        a.lookup_keys(KEYS[:1], "req-2")
        store(a, KEYS[3:])
        assert a.lookup_keys(KEYS, "req-2").num_tokens == 4 * cs  # its repeat finds 3 more chunks
        assert counters() == (10 * cs, 9 * cs)
        st = srv.hosts()[0].manager.stats()
        assert st["lookup_hit_tokens"] == 10 * cs  # the manager's own count, the same mechanism
        a.close()
