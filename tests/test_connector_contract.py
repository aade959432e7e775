"""The connector's answers to vLLM 0.32's contract hooks (issue 23, items 4, 5 and 8), on the fake engine.

- ``kv_load_failure_policy`` is the engine's setting: kvtier never rewrites it, and says at start
  what a failed load does under it (the real-engine check of both policies, alone and inside
  MultiConnector, is tests/test_vllm_contract.py).
- ``requires_kv_delivery`` is False: kvtier is a best-effort cache.
- ``has_pending_block_frees`` is True exactly while kvtier holds the blocks of a request that
  finished (was aborted) while its async load ran.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from fake_vllm import ConnectorPair, FakeEngine, Knobs, make_connectors, make_vllm_config
from test_connector_lifecycle import GEOM, CHUNK, assert_quiescent, extra_config, tokens_of

SCRIPTED = Knobs(p_alloc_fail=0, p_preempt=0, p_abort=0, p_abort_mid_step=0, p_abort_after_failed_alloc=0,
                 p_local_hit=0, prefill_chunks=(10_000,), target_waiting=0)


@pytest.fixture
def connectors() -> Iterator[Callable[..., ConnectorPair]]:
    made: list[ConnectorPair] = []

    def make(extra: dict[str, Any]) -> ConnectorPair:
        pair = make_connectors(GEOM, extra, engine_id=f"contract-{uuid.uuid4().hex[:12]}")
        made.append(pair)
        return pair

    yield make
    for p in made:
        p.shutdown()


# -- item 4: the engine's kv_load_failure_policy -----------------------------------------------------
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_connector_leaves_the_load_failure_policy_as_set_and_says_what_it_does(policy: str, caplog) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.integrations.vllm import KVTierConnector

    cfg = make_vllm_config(GEOM, extra_config(cpu_chunks=4), f"policy-{uuid.uuid4().hex[:8]}")
    cfg.kv_transfer_config.kv_load_failure_policy = policy
    with caplog.at_level(logging.INFO, logger="kvtier"):
        conn = KVTierConnector(cfg, KVConnectorRole.SCHEDULER, None)
    try:
        assert cfg.kv_transfer_config.kv_load_failure_policy == policy  # never rewritten
        lines = [r for r in caplog.records if "kv_load_failure_policy" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in caplog.records]
        msg = lines[0].getMessage()
        assert f"kv_load_failure_policy={policy!r}" in msg
        if policy == "fail":
            assert lines[0].levelno == logging.WARNING
            assert "finishes the request with an error" in msg.split("(under")[0]
        else:
            assert lines[0].levelno == logging.INFO
            assert "recomputes" in msg.split("(under")[0]
        assert "MultiConnector" in msg
    finally:
        conn.shutdown()


# -- item 5: best-effort cache ------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["kv_both", "kv_producer"])
def test_requires_kv_delivery_is_false_for_every_role(role: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

    from kvtier.integrations.vllm import KVTierConnector

    cfg = make_vllm_config(GEOM, extra_config(cpu_chunks=4), f"delivery-{uuid.uuid4().hex[:8]}")
    cfg.kv_transfer_config.kv_role = role
    cfg.kv_transfer_config.is_kv_producer = True  # what vLLM's base class would answer (True)
    conn = KVTierConnector(cfg, KVConnectorRole.SCHEDULER, None)
    try:
        assert KVConnectorBase_V1.requires_kv_delivery.fget(conn) is True  # the inherited answer
        assert conn.requires_kv_delivery is False
    finally:
        conn.shutdown()


# -- item 8: blocks held for a load of a finished request ----------------------------------------------
def test_pending_block_frees_while_an_aborted_requests_async_load_runs(connectors, tmp_path: Path, monkeypatch) -> None:
    pair = connectors(extra_config(cpu_chunks=4, disk_dir=tmp_path / "disk", disk_chunks=8))
    m = pair.worker.manager
    w = pair.worker.worker
    eng = FakeEngine(pair, GEOM, [], seed=1, knobs=SCRIPTED)
    prompt = tokens_of(21, 3 * CHUNK + 3)
    eng.serve(prompt)
    assert m.flush(10)
    m.cpu.clear()  # only the disk tier holds the chunks: the load is asynchronous
    assert not pair.scheduler.has_pending_block_frees()
    gate = threading.Event()
    real_open = w.store.open_read_many

    def held_open(*a: Any, **kw: Any) -> Any:
        assert gate.wait(30), "the test never released the load"
        return real_open(*a, **kw)

    monkeypatch.setattr(w.store, "open_read_many", held_open)
    b = eng.submit(prompt, max_tokens=1)
    eng._limit = eng.stats.submitted
    deadline = time.monotonic() + 30
    while not eng.stats.async_loads and time.monotonic() < deadline:
        eng.step()
    assert eng.stats.async_loads == 1
    assert not pair.scheduler.has_pending_block_frees()  # a live request's load: nothing to free
    eng.abort(eng.requests[b.request_id])  # aborted mid-load: vLLM leaves its blocks to kvtier
    assert b.request_id in eng.delayed_free
    eng.step()
    assert pair.scheduler.has_pending_block_frees()  # held until the load ends
    gate.set()
    while b.request_id in eng.delayed_free and time.monotonic() < deadline:
        eng.step()
        time.sleep(0.002)
    assert b.request_id not in eng.delayed_free
    assert not pair.scheduler.has_pending_block_frees()
    assert_quiescent(pair)
