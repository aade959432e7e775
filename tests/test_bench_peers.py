"""Smoke test of ``kvtier bench peers`` without LMCache: a clear skip, kvtier's figures still reported.

Tiny sizes, one round; no speed is asserted (targets live in the command).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.bench.peers import DEFAULT_LMCACHE_PYTHON, DRIVER, PeerSizes, lmcache_available, run_peers_bench
from kvtier.bench.peers_report import build_report
from kvtier.cli import app


@pytest.mark.slow
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


@pytest.mark.slow
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

    base = {"bytes": 1_000_000_000, "file_put_s": [0.5], "file_get_s": [0.05], "file_xxh3_put_s": [0.5],
            "file_xxh3_get_s": [0.1]}
    rounds = [
        {"kvtier": {"disk": side(0.5, 0.1)}, "kvtier_unverified": {"disk": side(0.5, 0.05)},
         "lmcache": {"disk": side(1.0, 0.1)}, "baseline": base},
        {"kvtier": {"disk": side(0.25, 0.1)}, "kvtier_unverified": {"disk": side(0.25, 0.1)},
         "lmcache": {"disk": side(1.0, 0.2)}, "baseline": dict(base, file_get_s=[0.1])},
    ]
    doc = build_report(rounds, ["disk"], {"disk": ("disk", "storage", False)})
    assert doc["disk_put_ratio_vs_lmcache"] == pytest.approx(3.0)  # median of 2x and 4x
    assert doc["disk_put_ratio_vs_lmcache_spread"] == pytest.approx([2.0, 4.0])
    assert doc["disk_get_ratio_vs_lmcache"] == pytest.approx(1.5)
    assert doc["disk_get_unverified_ratio_vs_lmcache_spread"] == pytest.approx([2.0, 2.0])
    assert doc["disk_get_kvtier_vs_baseline_spread"] == pytest.approx([0.5, 1.0])
    assert doc["disk_get_kvtier_vs_same_work"] == pytest.approx(1.0)
    assert doc["disk_put_kvtier_vs_same_work_spread"] == pytest.approx([1.0, 2.0])
    assert doc["min_ratio_vs_lmcache"] == pytest.approx(1.5)
    assert doc["min_ratio_vs_lmcache_unverified"] == pytest.approx(2.0)
    assert doc["min_ratio_vs_same_work"] == pytest.approx(1.0)
    assert doc["all_targets_met"] is True  # judged: same work >= 0.9 and unverified >= 1.0 LMCache
    slow = [dict(rd, kvtier_unverified={"disk": side(1.0, 0.2)}) for rd in rounds]  # unverified 0.5x LMCache get
    doc = build_report(slow, ["disk"], {"disk": ("disk", "storage", False)})
    assert doc["min_ratio_vs_lmcache_unverified"] == pytest.approx(0.75) and doc["all_targets_met"] is False
    failed = {c["name"] for c in doc["checks"] if not c["passed"]}
    assert failed == {"disk_get (verification off) vs LMCache"}  # put: 1.0x, met


def test_lmcache_available_names_what_is_missing(tmp_path: Path) -> None:
    assert "LMCache environment not found" in lmcache_available(tmp_path / "py")
    # kvtier's own venv has torch but no LMCache: the driver's probe says so in one line
    why = lmcache_available(Path(sys.executable))
    assert "LMCache is not importable" in why and "lmcache" in why


def test_the_lmcache_driver_is_in_the_repository_and_imports_no_kvtier() -> None:
    """It runs under LMCache's interpreter, where kvtier is not installed: stdlib, torch, LMCache only."""
    import ast

    from kvtier.bench.peers import DRIVER

    assert DRIVER.is_file() and DRIVER.parent == Path(__file__).resolve().parents[1] / "kvtier" / "bench"
    tree = ast.parse(DRIVER.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
    allowed = set(sys.stdlib_module_names) | {"torch", "lmcache", "redis", "kvtier"}
    assert roots <= allowed, roots - allowed
    # the one kvtier import is the package-relative branch taken only when imported as a module
    src = DRIVER.read_text()
    assert src.count("from kvtier") == 1 and "if __package__:" in src


def test_the_lmcache_driver_runs_as_a_script_without_kvtier(tmp_path: Path) -> None:
    """By path, isolated (-I: no PYTHONPATH, no cwd): the probe answers instead of an import error."""
    out = subprocess.run([sys.executable, "-I", str(DRIVER), "--probe"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 3 and "PROBE_ERROR ModuleNotFoundError" in out.stdout and "lmcache" in out.stdout
    bad = subprocess.run([sys.executable, "-I", str(DRIVER)], capture_output=True, text=True, cwd=tmp_path,
                         timeout=60)
    assert bad.returncode == 2 and "a figure" in bad.stderr


def test_only_runs_the_named_figure_groups(tmp_path: Path) -> None:
    from kvtier.bench.common import BenchUsageError

    doc = run_peers_bench(lmcache_python=tmp_path / "nope", rounds=1, sizes=PeerSizes.tiny(), work_dir=tmp_path,
                          log=lambda _: None, only=["disk"])
    assert doc["disk_get_kvtier_gbps"] > 0 and doc["disk_get_same_work_baseline_gbps"] > 0
    assert doc["disk_get_kvtier_unverified_gbps"] > 0 and doc["raw_rounds"][0]["kvtier_unverified"]["disk"]["verify_reads"] is False
    assert "cpu_put_kvtier_gbps" not in doc and set(doc["raw_rounds"][0]["kvtier"]) == {"disk"}
    assert set(doc["sides"]) == {"disk"} and "timing" in doc
    with pytest.raises(BenchUsageError, match="unknown figure groups"):
        run_peers_bench(lmcache_python=tmp_path / "nope", rounds=1, sizes=PeerSizes.tiny(), work_dir=tmp_path,
                        only=["gpu"])


@pytest.mark.skipif(bool(lmcache_available(DEFAULT_LMCACHE_PYTHON)), reason="no LMCache environment at ~/lmc-venv")
@pytest.mark.parametrize("figure", ["cpu", "disk"])
def test_the_driver_measures_lmcache_where_it_is_installed(tmp_path: Path, figure: str) -> None:
    """End to end under LMCache's own interpreter (tiny shape): the RESULT line both sides share."""
    cmd = [str(DEFAULT_LMCACHE_PYTHON), "-I", str(DRIVER), figure, *PeerSizes.tiny().args(),
           "--disk-dir", str(tmp_path / "lmc"), "--free-bytes", "0", "--child-timeout", "120"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-2000:]
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["figure"] == figure and res["bytes"] == 2 * 2 * 512 * 3 * 64 * 2
    assert len(res["put_s"]) == len(res["get_s"]) == 1 and min(res["put_s"] + res["get_s"]) > 0
    assert res["level"] == ("engine" if figure == "cpu" else "storage") and not (tmp_path / "lmc").exists()
