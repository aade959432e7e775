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
    doc = build_report(rounds, ["disk"], {"disk": ("disk", "storage", False)})
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


def test_the_judged_baseline_is_the_same_work_one_and_the_plain_ratio_is_reported() -> None:
    kv = {"bytes": GB, "put_s": [0.5], "get_s": [0.25]}
    base = {"bytes": GB, "file_put_s": [0.4], "file_get_s": [0.2], "file_xxh3_put_s": [0.5], "file_xxh3_get_s": [0.25]}
    doc = build_report([{"kvtier": {"disk": kv}, "lmcache": {}, "baseline": base}], ["disk"],
                       {"disk": ("disk", "storage", False)})
    assert doc["disk_get_kvtier_vs_baseline"] == pytest.approx(0.8)  # plain read, no checksum: information
    assert doc["disk_get_kvtier_vs_same_work"] == pytest.approx(1.0)
    assert doc["disk_get_same_work_baseline_gbps"] == pytest.approx(4.0)
    checks = {c["name"]: c for c in doc["checks"]}
    judged = checks["disk_get vs file_xxh3 (same work)"]
    assert judged["passed"] and "vs plain 0.80x" in judged["note"]
    assert doc["min_ratio_vs_same_work"] == pytest.approx(1.0) and doc["all_targets_met"] is True
    assert "xxh3-64 verified" in doc["sides"]["disk"]["kvtier"] and "no checksum" in doc["sides"]["disk"]["lmcache"]
    slow = dict(kv, get_s=[0.3])  # 0.83x of the same work: missed
    doc = build_report([{"kvtier": {"disk": slow}, "lmcache": {}, "baseline": base}], ["disk"],
                       {"disk": ("disk", "storage", False)})
    assert doc["disk_get_kvtier_vs_same_work"] == pytest.approx(0.25 / 0.3) and doc["all_targets_met"] is False


def test_every_figure_group_has_a_same_work_baseline_the_child_measures() -> None:
    from kvtier.bench.peers_report import BASELINE_OF, SAME_WORK_BASELINE_OF

    assert set(SAME_WORK_BASELINE_OF) == set(BASELINE_OF)
    src = (Path(__file__).resolve().parents[1] / "kvtier" / "bench" / "peers_baseline.py").read_text()
    for names in SAME_WORK_BASELINE_OF.values():
        for name in names:
            assert f'"{name}_put"' in src and f'"{name}_get"' in src, name


def test_checksummed_plain_files_move_the_same_bytes(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (300_001, 4096)]
    paths = [str(tmp_path / f"f{i}") for i in range(len(bufs))]
    plain_files_put(paths, bufs, 2, False, step=65536, verify=True)
    outs = [np.zeros_like(b) for b in bufs]
    plain_files_get(paths, outs, 2, False, verify=True)
    assert all(np.array_equal(b, o) for b, o in zip(bufs, outs))
