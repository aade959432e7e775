"""Smoke test of ``kvtier bench peers`` without LMCache: a clear skip, kvtier's figures still reported.

Tiny sizes, one round; no speed is asserted (targets live in the command).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.bench.peers import PeerSizes, lmcache_available, run_peers_bench
from kvtier.bench.peers_report import build_report
from kvtier.cli import app


def test_peers_without_lmcache_skips_it_and_reports_kvtier(tmp_path: Path) -> None:
    lines: list[str] = []
    doc = run_peers_bench(
        lmcache_python=tmp_path / "no-venv" / "bin" / "python", rounds=1, sizes=PeerSizes.tiny(),
        work_dir=tmp_path, log=lines.append,
    )
    assert "LMCache environment not found" in doc["lmcache_skipped"]
    assert any("LMCache skipped" in ln for ln in lines)
    for fig in ("cpu_put", "cpu_get", "disk_put", "disk_get"):
        assert doc[f"{fig}_kvtier_gbps"] > 0, fig
        assert doc[f"{fig}_baseline_gbps"] > 0, fig
        assert doc[f"{fig}_kvtier_vs_baseline"] > 0, fig
        assert doc[f"{fig}_lmcache_gbps"] is None and doc[f"{fig}_ratio_vs_lmcache"] is None
    assert doc["min_ratio_vs_lmcache"] is None
    assert not [e for e in doc["errors"] if "redis" not in e]  # Redis may be down on a dev machine
    assert not list(tmp_path.glob("bench-peers-*"))  # the work directory is removed


def test_cli_reports_the_skip_and_writes_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtier.bench.peers as peers

    monkeypatch.setattr(peers, "PeerSizes", PeerSizes.tiny)  # the CLI's default sizes -> tiny
    out = tmp_path / "peers.json"
    res = CliRunner().invoke(app, ["bench", "peers", "--lmcache-python", str(tmp_path / "nope"), "--rounds", "1",
                                   "--json", str(out)])
    assert "LMCache skipped" in res.output
    doc = json.loads(out.read_text())
    assert doc["rounds"] == 1 and doc["lmcache_skipped"] and doc["cpu_put_kvtier_gbps"] > 0


def test_ratios_and_spread_from_raw_rounds() -> None:
    def side(put: float, get: float) -> dict:
        return {"bytes": 1_000_000_000, "put_s": [put], "get_s": [get]}

    rounds = [
        {"kvtier": {"disk": side(0.5, 0.1)}, "lmcache": {"disk": {"bytes": 1_000_000_000,
                                                                   "backend_direct": {"put_s": [1.0], "get_s": [0.1]}}},
         "baseline": {"bytes": 1_000_000_000, "file_put_s": [0.5], "file_get_s": [0.05]}},
        {"kvtier": {"disk": side(0.25, 0.1)}, "lmcache": {"disk": {"bytes": 1_000_000_000,
                                                                    "backend_direct": {"put_s": [1.0], "get_s": [0.2]}}},
         "baseline": {"bytes": 1_000_000_000, "file_put_s": [0.5], "file_get_s": [0.1]}},
    ]
    doc = build_report(rounds, ["disk"], {"disk": ("disk", "backend_direct", False)})
    assert doc["disk_put_ratio_vs_lmcache"] == pytest.approx(3.0)  # median of 2x and 4x
    assert doc["disk_put_ratio_vs_lmcache_spread"] == pytest.approx([2.0, 4.0])
    assert doc["disk_get_ratio_vs_lmcache"] == pytest.approx(1.5)
    assert doc["disk_get_kvtier_vs_baseline_spread"] == pytest.approx([0.5, 1.0])
    assert doc["min_ratio_vs_lmcache"] == pytest.approx(1.5)
    assert doc["all_targets_met"] is False  # disk get vs the baseline: 0.75 < 0.9


def test_lmcache_available_names_what_is_missing(tmp_path: Path) -> None:
    assert "script not found" in lmcache_available(tmp_path / "py", tmp_path / "missing.py")
    script = tmp_path / "s.py"
    script.write_text("")
    assert "does not exist" in lmcache_available(tmp_path / "py", script)


def test_only_runs_the_named_figure_groups(tmp_path: Path) -> None:
    from kvtier.bench.common import BenchUsageError

    doc = run_peers_bench(lmcache_python=tmp_path / "nope", rounds=1, sizes=PeerSizes.tiny(), work_dir=tmp_path,
                          log=lambda _: None, only=["disk"])
    assert doc["disk_get_kvtier_gbps"] > 0 and doc["disk_get_checksummed_baseline_gbps"] > 0
    assert "cpu_put_kvtier_gbps" not in doc and set(doc["raw_rounds"][0]["kvtier"]) == {"disk"}
    assert set(doc["sides"]) == {"disk"} and "timing" in doc
    with pytest.raises(BenchUsageError, match="unknown figure groups"):
        run_peers_bench(lmcache_python=tmp_path / "nope", rounds=1, sizes=PeerSizes.tiny(), work_dir=tmp_path,
                        only=["gpu"])
