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


# -- item 3: reset_cache -------------------------------------------------------------------------------
def _stored_hit(pair: ConnectorPair, eng: FakeEngine, prompt: list[int]) -> int:
    """Tokens a lookup of ``prompt`` would load now (through the scheduler side's index)."""
    m = pair.worker.manager
    keys = m.keys(prompt)[: (len(prompt) - 1) // CHUNK]
    return pair.scheduler.scheduler._lookup_index().lookup_keys(keys, None).num_tokens


@pytest.mark.parametrize("with_disk", [False, True], ids=["cpu", "cpu+disk"])
def test_reset_cache_clears_the_engines_own_tiers(connectors, tmp_path: Path, with_disk: bool) -> None:
    extra = extra_config(cpu_chunks=8, disk_dir=tmp_path / "disk", disk_chunks=8) if with_disk else extra_config(8)
    pair = connectors(extra)
    eng = FakeEngine(pair, GEOM, [], seed=5, knobs=SCRIPTED)
    prompt = tokens_of(31, 3 * CHUNK + 1)
    eng.serve(prompt)
    assert pair.worker.manager.flush(10)
    assert _stored_hit(pair, eng, prompt) == 3 * CHUNK
    assert pair.scheduler.reset_cache() is True
    assert _stored_hit(pair, eng, prompt) == 0
    st = pair.worker.manager.stats()
    assert st["cpu_chunks"] == 0 and (not with_disk or st["disk_chunks"] == 0), st
    eng.serve(prompt)  # cached again afterwards
    assert pair.worker.manager.flush(10)
    assert _stored_hit(pair, eng, prompt) == 3 * CHUNK
    assert_quiescent(pair)


def test_reset_cache_over_the_lookup_endpoint(connectors, monkeypatch) -> None:
    """vLLM's scheduler in another process than the worker: the reset goes over the lookup socket."""
    from kvtier.integrations.vllm.scheduler import KVTierScheduler
    from kvtier.storage import registry

    pair = connectors(extra_config(cpu_chunks=8))
    eng = FakeEngine(pair, GEOM, [], seed=6, knobs=SCRIPTED)
    prompt = tokens_of(32, 3 * CHUNK + 1)
    eng.serve(prompt)
    w = pair.worker.worker
    inst = pair.scheduler.scheduler.instance
    monkeypatch.setattr(registry, "get", lambda name: None)  # the manager is in "another process"
    remote = KVTierScheduler(w.config, w.namespace, "x", instance=inst)
    try:
        assert type(remote._lookup_index()).__name__ == "LookupClient"
        assert remote.reset_cache() is True
        assert pair.worker.manager.stats()["cpu_chunks"] == 0
    finally:
        remote.shutdown()
    monkeypatch.undo()
    assert _stored_hit(pair, eng, prompt) == 0


@pytest.mark.parametrize("shared", ["remote", "peer"])
def test_reset_cache_answers_false_and_keeps_everything_when_a_shared_tier_would_still_serve(
        connectors, tmp_path: Path, shared: str) -> None:
    fs = tmp_path / "shared-fs"
    fs.mkdir()
    extra = extra_config(cpu_chunks=8, remote_url=f"fs://{fs}") if shared == "remote" else \
        extra_config(cpu_chunks=8, peers=[f"shm://{tmp_path}/no-peer.sock"])
    pair = connectors(extra)
    eng = FakeEngine(pair, GEOM, [], seed=7, knobs=SCRIPTED)
    prompt = tokens_of(33, 3 * CHUNK + 1)
    eng.serve(prompt)
    assert pair.worker.manager.flush(10)
    assert pair.scheduler.reset_cache() is False
    assert _stored_hit(pair, eng, prompt) == 3 * CHUNK  # nothing cleared
    if shared == "remote":  # with reset_shared the engine may clear this model's chunks there too
        pair2 = connectors(extra_config(cpu_chunks=8, remote_url=f"fs://{fs}", reset_shared=True))
        assert _stored_hit(pair2, eng, prompt) == 3 * CHUNK  # the shared tier serves the other engine
        assert pair2.scheduler.reset_cache() is True
        assert _stored_hit(pair2, eng, prompt) == 0
        assert not list(fs.rglob("*.kvc"))
    assert_quiescent(pair)
