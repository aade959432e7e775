"""``kvtier bench peers``' buffered-disk baseline is the faster plain loop of each round.

The baseline child measures plain files written/read with one call per file
(``file``) and in steps (``file_steps``); the report divides kvtier's figure by
the faster of the two in each round, so a plain loop that beats the one-call
baseline also raises the bar. The stepped loops must move the same bytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.bench.peers_baseline import plain_files_get, plain_files_put
from kvtier.bench.peers_report import build_report

GB = 1_000_000_000


def test_disk_baseline_is_the_faster_plain_loop_of_each_round() -> None:
    kv = {"bytes": GB, "put_s": [0.5], "get_s": [0.2]}
    rounds = [
        {"kvtier": {"disk": kv}, "lmcache": {},  # one call per file faster for put, steps for get
         "baseline": {"bytes": GB, "file_put_s": [0.5], "file_get_s": [0.4], "file_steps_put_s": [1.0],
                      "file_steps_get_s": [0.1]}},
        {"kvtier": {"disk": kv}, "lmcache": {},  # steps not measured: the one-call figure counts
         "baseline": {"bytes": GB, "file_put_s": [0.25], "file_get_s": [0.2]}},
    ]
    doc = build_report(rounds, ["disk"], {"disk": ("disk", "backend_direct", False)})
    assert doc["disk_get_kvtier_vs_baseline_spread"] == pytest.approx([0.5, 1.0])  # 0.1 s best in round 1
    assert doc["disk_put_kvtier_vs_baseline_spread"] == pytest.approx([0.5, 1.0])
    assert doc["disk_get_baseline_gbps"] == pytest.approx(7.5)  # median of 10 and 5 GB/s


@pytest.mark.parametrize("step", [0, 4096, 100_000])
def test_stepped_plain_files_move_the_same_bytes(tmp_path: Path, step: int) -> None:
    rng = np.random.default_rng(3)
    bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (300_001, 4096, 1)]
    paths = [str(tmp_path / f"f{i}") for i in range(len(bufs))]
    plain_files_put(paths, bufs, 2, False, step=step)
    outs = [np.zeros_like(b) for b in bufs]
    plain_files_get(paths, outs, 2, False, step=step)
    for b, o, p in zip(bufs, outs, paths):
        assert np.array_equal(b, o) and Path(p).stat().st_size == len(b)


def test_buffered_disk_target_is_the_plain_baseline_and_the_checksummed_ratio_is_reported() -> None:
    kv = {"bytes": GB, "put_s": [0.5], "get_s": [0.25]}
    base = {"bytes": GB, "file_put_s": [0.4], "file_get_s": [0.2], "file_xxh3_put_s": [0.5], "file_xxh3_get_s": [0.25]}
    doc = build_report([{"kvtier": {"disk": kv}, "lmcache": {}, "baseline": base}], ["disk"],
                       {"disk": ("disk", "backend_direct", False)})
    assert doc["disk_get_kvtier_vs_baseline"] == pytest.approx(0.8)  # plain read, no checksum
    assert doc["disk_get_kvtier_vs_checksummed_baseline"] == pytest.approx(1.0)
    assert doc["disk_get_checksummed_baseline_gbps"] == pytest.approx(4.0)
    checks = {c["name"]: c for c in doc["checks"]}
    judged = checks["disk_get vs file/file_steps baseline"]
    assert not judged["passed"] and "file_xxh3 (same reads + xxh3) 1.00x" in judged["note"]
    assert doc["min_kvtier_vs_target_baseline"] == pytest.approx(0.8) and doc["all_targets_met"] is False
    assert "xxh3-64 verified" in doc["sides"]["disk"]["kvtier"] and "no checksum" in doc["sides"]["disk"]["lmcache"]
    fast = dict(kv, get_s=[0.2], put_s=[0.4])  # kvtier as fast as the plain files: met
    doc = build_report([{"kvtier": {"disk": fast}, "lmcache": {}, "baseline": base}], ["disk"],
                       {"disk": ("disk", "backend_direct", False)})
    assert doc["disk_get_kvtier_vs_baseline"] == pytest.approx(1.0) and doc["all_targets_met"] is True


def test_checksummed_plain_files_move_the_same_bytes(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (300_001, 4096)]
    paths = [str(tmp_path / f"f{i}") for i in range(len(bufs))]
    plain_files_put(paths, bufs, 2, False, step=65536, verify=True)
    outs = [np.zeros_like(b) for b in bufs]
    plain_files_get(paths, outs, 2, False, verify=True)
    assert all(np.array_equal(b, o) for b, o in zip(bufs, outs))
