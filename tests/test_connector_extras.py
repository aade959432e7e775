"""The connector keys every input that decides a request's KV, and keeps its own request accounting.

Issue 8 failing inputs, at the connector level with the fake vLLM engine (its KV
pattern depends on the adapter and the images too, so a wrong load is caught as
wrong data, not only as a wrong count):

- 2: a prompt stored under LoRA adapter A is promised to adapter B and to the
  base model (right: 0), and a same-name adapter reloaded with new weights must
  not reuse the old KV;
- 3: a 33-token prompt with an image placeholder in chunk 0 is promised 32
  tokens for another image (right: 0); prompt embeddings and unknown extra-key
  sources are refused;
- 5: a chunk reserved by another writer does not make the connector drop the
  rest of the prompt's chain.
"""

from __future__ import annotations

import logging
import random
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from conftest import payload_for
from fake_vllm import (
    ConnectorPair,
    FakeEngine,
    FakeLoRARequest,
    FakeMMFeature,
    FakePlaceholderRange,
    FakeRequest,
    Geometry,
    Knobs,
    make_connectors,
)
from kvtier.index.keys import ChunkHasher
from kvtier.storage.types import WriteSkip
from service_helpers import connect, start_server, wait_until

GEOM = Geometry(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, num_blocks=48)
CHUNK = 32
CHUNK_BYTES = CHUNK * GEOM.token_bytes
SCRIPTED = Knobs(p_alloc_fail=0, p_preempt=0, p_abort=0, p_abort_mid_step=0, p_local_hit=0,
                 prefill_chunks=(10_000,), target_waiting=0)


def tokens_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(n)]


@pytest.fixture
def engine() -> Iterator[Callable[..., tuple[ConnectorPair, FakeEngine]]]:
    made: list[ConnectorPair] = []

    def make(**extra: Any) -> tuple[ConnectorPair, FakeEngine]:
        cfg = dict(chunk_size=CHUNK, cpu_capacity=32 * CHUNK_BYTES, model_id="fake/extras-test", lease_ttl_s=3600.0)
        cfg.update(extra)
        pair = make_connectors(GEOM, cfg, engine_id=f"extras-{uuid.uuid4().hex[:12]}")
        made.append(pair)
        return pair, FakeEngine(pair, GEOM, [], seed=1, knobs=SCRIPTED)

    yield make
    for p in made:
        p.shutdown()


def promised(pair: ConnectorPair, tokens: list[int], **fields: Any) -> int:
    """Tokens the scheduler side promises for a fresh request (its lease released again)."""
    r = FakeRequest(f"probe-{uuid.uuid4().hex[:8]}", list(tokens), None, [1], 1, **fields)
    n, _ = pair.scheduler.get_num_new_matched_tokens(r, 0)
    pair.scheduler.request_finished(r, [])
    return int(n or 0)


def write_adapter(path: Path, seed: int) -> Path:
    """A LoRA adapter directory as vLLM loads it (contents random: only their identity matters here)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 4, "target_modules": ["q_proj", "v_proj"]}')
    (path / "adapter_model.safetensors").write_bytes(random.Random(seed).randbytes(4096))
    return path


def lora(name: str, path: Path, tag: str) -> FakeLoRARequest:
    return FakeLoRARequest(name, 1, str(path), weights_tag=tag)


def image(identifier: str, offset: int, length: int) -> list[FakeMMFeature]:
    return [FakeMMFeature(identifier, FakePlaceholderRange(offset, length))]


# -- failing input 2: LoRA ---------------------------------------------------------------------
def test_kv_stored_under_one_adapter_is_promised_to_no_other(engine, tmp_path: Path) -> None:
    pair, eng = engine()
    prompt = tokens_of(1, CHUNK + 1)  # 33 tokens: one full chunk
    a = lora("adapter-a", write_adapter(tmp_path / "a", 1), "A")
    b = lora("adapter-b", write_adapter(tmp_path / "b", 2), "B")
    eng.serve(prompt, lora_request=a)
    assert pair.worker.manager.flush(10)
    assert promised(pair, prompt, lora_request=a) == CHUNK  # the same adapter hits
    assert promised(pair, prompt, lora_request=b) == 0
    assert promised(pair, prompt) == 0  # the base model
    eng.serve(prompt, lora_request=b)  # served: the fake engine checks every loaded block's KV
    eng.serve(prompt)
    hit = eng.serve(prompt, lora_request=a)
    assert pair.scheduler.scheduler.ledger.get(hit.request_id).kvtier_hit_tokens == CHUNK


def test_base_model_kv_is_not_promised_to_an_adapter(engine, tmp_path: Path) -> None:
    pair, eng = engine()
    prompt = tokens_of(2, 2 * CHUNK + 1)
    eng.serve(prompt)
    assert promised(pair, prompt) == 2 * CHUNK
    assert promised(pair, prompt, lora_request=lora("a", write_adapter(tmp_path / "a", 1), "A")) == 0


def test_same_name_adapter_reloaded_with_new_weights_misses(engine, tmp_path: Path) -> None:
    pair, eng = engine()
    prompt = tokens_of(3, CHUNK + 1)
    path = write_adapter(tmp_path / "a", 1)
    eng.serve(prompt, lora_request=lora("adapter-a", path, "v1"))
    assert promised(pair, prompt, lora_request=lora("adapter-a", path, "v1")) == CHUNK
    write_adapter(path, 99)  # new weights under the same name and path
    assert promised(pair, prompt, lora_request=lora("adapter-a", path, "v2")) == 0
    eng.serve(prompt, lora_request=lora("adapter-a", path, "v2"))


def test_same_adapter_content_at_another_path_shares_kv(engine, tmp_path: Path) -> None:
    """The fingerprint is a content digest: a copy (other path, other mtime) is the same adapter."""
    pair, eng = engine()
    prompt = tokens_of(4, CHUNK + 1)
    path = write_adapter(tmp_path / "a", 1)
    eng.serve(prompt, lora_request=lora("adapter-a", path, "A"))
    copy = tmp_path / "elsewhere" / "a"
    shutil.copytree(path, copy)
    assert promised(pair, prompt, lora_request=lora("adapter-a", copy, "A")) == CHUNK


def test_unreadable_adapter_is_a_miss_and_not_stored(engine, tmp_path: Path, caplog, monkeypatch) -> None:
    from kvtier.integrations.vllm import extras

    def unreadable(files: Any) -> str:
        raise PermissionError(13, "Permission denied")

    pair, eng = engine()
    prompt = tokens_of(5, CHUNK + 1)
    a = lora("adapter-a", write_adapter(tmp_path / "a", 1), "A")
    monkeypatch.setattr(extras, "_content_digest", unreadable)
    with caplog.at_level(logging.WARNING, logger="kvtier.vllm"):
        eng.serve(prompt, lora_request=a)
        eng.serve(prompt, lora_request=a)
    assert sum("cannot be read" in r.getMessage() for r in caplog.records) == 1  # logged once
    monkeypatch.undo()
    assert pair.worker.manager.flush(10)
    assert promised(pair, prompt, lora_request=a) == 0  # nothing was stored under an unknown identity


# -- failing input 3: multimodal -------------------------------------------------------------------
def test_image_in_chunk_0_is_not_promised_for_another_image(engine) -> None:
    pair, eng = engine()
    prompt = [7] * 4 + [9] * 10 + tokens_of(6, CHUNK + 1 - 14)  # placeholder tokens 4..13 in chunk 0
    eng.serve(prompt, mm_features=image("img-x", 4, 10))
    assert promised(pair, prompt, mm_features=image("img-x", 4, 10)) == CHUNK
    assert promised(pair, prompt, mm_features=image("img-y", 4, 10)) == 0
    assert promised(pair, prompt) == 0  # the same token ids as text
    eng.serve(prompt, mm_features=image("img-y", 4, 10))


def test_image_in_a_later_chunk_keeps_the_shared_head(engine) -> None:
    pair, eng = engine()
    prompt = tokens_of(7, 3 * CHUNK + 1)
    eng.serve(prompt, mm_features=image("img-x", CHUNK + 8, 6))
    assert promised(pair, prompt, mm_features=image("img-x", CHUNK + 8, 6)) == 3 * CHUNK
    assert promised(pair, prompt, mm_features=image("img-y", CHUNK + 8, 6)) == CHUNK  # chunk 0 only
    assert promised(pair, prompt, mm_features=image("img-x", CHUNK + 9, 6)) == CHUNK  # same image, moved
    eng.serve(prompt, mm_features=image("img-y", CHUNK + 8, 6))


def test_prompt_embeddings_are_a_miss_and_never_stored(engine, caplog) -> None:
    pair, eng = engine()
    prompt = tokens_of(8, 2 * CHUNK + 1)
    with caplog.at_level(logging.WARNING, logger="kvtier.vllm"):
        eng.serve(prompt, prompt_embeds=object())
        eng.serve(prompt, prompt_embeds=object())
    assert pair.worker.manager.flush(10)
    assert promised(pair, prompt) == 0  # nothing was stored for them
    assert sum("prompt embeddings" in r.getMessage() for r in caplog.records) == 1  # logged once


def test_unknown_extra_key_source_refuses_to_start(monkeypatch) -> None:
    from vllm.v1.core import kv_cache_utils

    monkeypatch.setattr(kv_cache_utils, "_gen_new_feature_extra_hash_keys", lambda *a: [], raising=False)
    with pytest.raises(ValueError, match="_gen_new_feature_extra_hash_keys"):
        make_connectors(GEOM, dict(chunk_size=CHUNK, cpu_capacity=8 * CHUNK_BYTES, model_id="x"), "refused")


# -- failing input 5: a chunk reserved by another writer ---------------------------------------------
def test_chunk_reserved_by_another_writer_does_not_drop_the_tail(engine) -> None:
    pair, eng = engine()
    m = pair.worker.manager
    prompt = tokens_of(9, 3 * CHUNK + 1)
    keys = m.keys(prompt)
    other = m.open_write(keys[0], None)  # another engine's uncommitted reservation of the shared head
    assert other is not None
    assert m.open_write_many([keys[0]], [None]) == [WriteSkip.IN_FLIGHT]
    eng.serve(prompt)  # stores chunks 1 and 2 (chunk 0 is the other writer's)
    other[:] = 0
    m.commit(keys[0], None)
    assert m.flush(10)
    assert m.lookup_keys(keys).num_tokens == 3 * CHUNK


def test_no_room_stops_the_chain(engine) -> None:
    """The sibling: with room for one chunk only, nothing after the first unstorable chunk is kept."""
    pair, eng = engine(cpu_capacity=1 * CHUNK_BYTES)
    m = pair.worker.manager
    prompt = tokens_of(10, 3 * CHUNK + 1)
    eng.serve(prompt)
    assert m.flush(10)
    res = m.lookup_keys(m.keys(prompt))
    assert res.num_tokens <= CHUNK
    assert all(m.contains(k) is False for k in m.keys(prompt)[res.num_tokens // CHUNK + 1 :])


# -- request accounting (moved from storage into the connector) --------------------------------------
def test_accounting_separates_engine_hits_kvtier_hits_and_computed_tokens(engine) -> None:
    from kvtier.integrations.vllm import request_hits

    pair, eng = engine()
    prompt = tokens_of(11, 4 * CHUNK + 5)
    cold = eng.serve(prompt)
    assert request_hits(cold.request_id) == {
        "prompt_tokens": 133, "engine_hit_tokens": 0, "kvtier_hit_tokens": 0, "computed_tokens": 133,
        "tiers": {}, "load_failures": 0,
    }
    warm = eng.serve(prompt, local_blocks=1)  # the engine holds block 0 itself
    hits = request_hits(warm.request_id)
    assert hits is not None
    assert (hits["engine_hit_tokens"], hits["kvtier_hit_tokens"], hits["computed_tokens"]) == (16, 112, 5)
    assert hits["tiers"] == {"cpu": 112}


def test_accounting_subtracts_blocks_the_worker_reported_failed(engine) -> None:
    pair, eng = engine()
    m = pair.worker.manager
    prompt = tokens_of(12, 4 * CHUNK + 5)
    keys = m.keys(prompt)
    eng.serve(prompt)
    r = eng.submit(prompt, max_tokens=1)
    eng.force_local_blocks[r.request_id] = 0

    def lose_tail(e: FakeEngine) -> None:  # chunks 2 and 3 vanish between lookup and load
        if r.request_id in e.load_window:
            for k in reversed(keys[2:]):
                m.cpu.delete(k)
            e.before_execute = None

    eng.before_execute = lose_tail
    eng._limit = eng.stats.submitted
    while r.request_id in eng.requests or r.request_id in eng.delayed_free:
        eng.step()
    rec = pair.scheduler.scheduler.ledger.get(r.request_id)
    assert rec is not None and rec.load_failures == 1
    assert (rec.kvtier_hit_tokens, rec.tiers) == (2 * CHUNK, {"cpu": 2 * CHUNK})
    assert rec.computed_tokens == 133 - 2 * CHUNK


def test_chunk_reserved_by_another_engine_on_the_server_does_not_drop_the_tail(engine) -> None:
    """Failing input 5 through ``kvtier server``: engine A holds an uncommitted reservation of the
    shared head; engine B (the connector) stores head + 2 unique chunks; a third client finds 3 of 3."""
    d = Path(tempfile.mkdtemp(prefix="kvtc-", dir="/tmp"))  # short: Unix socket paths are limited
    try:
        with start_server(d, cpu_chunks=32):
            pair, eng = engine(server=f"unix://{d / 's.sock'}")
            ns = pair.worker.namespace
            a = connect(d / "s.sock", ns, client_id="engine-a", sync_commit=True)
            third = connect(d / "s.sock", ns, client_id="engine-c")
            prompt = tokens_of(13, 3 * CHUNK + 1)
            keys = ChunkHasher(ns).keys(prompt)
            (slot,) = a.open_write_many([keys[0]], [None])
            assert isinstance(slot, np.ndarray)
            eng.serve(prompt)  # engine B: chunk 0 is IN_FLIGHT (A's), chunks 1 and 2 are B's to store
            slot[:] = payload_for(keys[0], a.chunk_bytes)
            a.commit(keys[0], None)
            wait_until(lambda: third.lookup_keys(keys).num_tokens == 3 * CHUNK, 10, "3 of 3 chunks found")
            a.close()
            third.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_ledger_is_bounded_and_finds_vllm_internal_ids() -> None:
    from kvtier.integrations.vllm.accounting import RequestLedger

    led = RequestLedger(max_records=3)
    for i in range(5):
        led.on_lookup(f"r{i}-abcdefgh", 100, 10)
    assert len(led) == 3 and led.get("r0") is None and led.get("r1") is None
    led.on_load_planned("r4-abcdefgh", "disk", 64)
    led.on_load_failed("r4-abcdefgh", {"disk": 32})
    rec = led.get("r4")  # the id given to vLLM; vLLM appends "-<8 characters>"
    assert rec is not None and (rec.kvtier_hit_tokens, rec.tiers, rec.load_failures) == (32, {"disk": 32}, 1)
    assert rec.computed_tokens == 100 - 10 - 32
    assert led.totals() == {"hit_tokens_disk": 32, "load_failures": 1}


def test_check_invariants_catches_a_planned_load_without_a_lease(engine) -> None:
    pair, eng = engine()
    prompt = tokens_of(14, 2 * CHUNK + 1)
    eng.serve(prompt)
    r = eng.submit(prompt, max_tokens=1)
    eng.force_local_blocks[r.request_id] = 0
    sched = pair.scheduler.scheduler
    n, _ = pair.scheduler.get_num_new_matched_tokens(r, 0)
    assert n == 2 * CHUNK and sched._trackers[r.request_id].lease_held
    pair.scheduler.check_invariants()
    sched._trackers[r.request_id].lease_held = False  # a lease lost while a hit is still to load
    sched._trackers[r.request_id].pending_load = object()  # type: ignore[assignment]
    with pytest.raises(AssertionError, match="without a lease"):
        pair.scheduler.check_invariants()
    sched._trackers[r.request_id].pending_load = None
    pair.scheduler.request_finished(r, [])
    eng.requests.pop(r.request_id)
    eng.waiting.remove(r)
    assert r.request_id not in sched._trackers


def test_multimodal_item_without_a_content_hash_is_refused(engine) -> None:
    pair, eng = engine()
    prompt = tokens_of(15, CHUNK + 1)
    eng.serve(prompt, mm_features=image("", 4, 10))
    assert pair.worker.manager.flush(10)
    assert promised(pair, prompt) == 0 and promised(pair, prompt, mm_features=image("x", 4, 10)) == 0


def test_stress_with_adapters_and_images_never_loads_another_requests_kv(engine, tmp_path: Path) -> None:
    """Thousands of requests over the same token prompts under two adapters, the base model and
    two images, with aborts, preemptions and a small CPU tier: every load is checked block by block
    against the KV of its own adapter and image (fake_vllm), so any sharing across them fails."""
    pair, _ = engine(cpu_capacity=12 * CHUNK_BYTES)
    rng = random.Random(21)
    a = lora("adapter-a", write_adapter(tmp_path / "a", 1), "A")
    b = lora("adapter-b", write_adapter(tmp_path / "b", 2), "B")
    prompts: list[tuple[Any, ...]] = []
    for fam in range(4):
        tokens = [rng.randrange(1, 30_000) for _ in range(rng.randint(40, 120))]
        for extra in ({}, {"lora_request": a}, {"lora_request": b}, {"mm_features": image("img-x", 3, 20)},
                      {"mm_features": image("img-y", 3, 20)}, {"mm_features": image("img-x", CHUNK + 2, 8)}):
            prompts.append((tokens, None, extra))
    eng = FakeEngine(pair, GEOM, prompts, seed=21)
    eng.run(1_500, max_steps=30_000)
    assert eng.stats.loads > 50 and eng.stats.loaded_blocks_verified > 200, eng.stats
    m = pair.worker.manager
    assert m.flush(10)
    st = m.stats()
    assert st["leases"] == 0 and st["pinned_chunks"] == 0 and st["referenced_chunks"] == 0
    pair.scheduler.check_invariants()


def test_load_failures_survive_the_lookup_that_follows_a_failed_load() -> None:
    """A failed async load rewinds the request to no computed tokens and vLLM looks it up again:
    the failure stays on its record while the hit counts are those of the new attempt."""
    from kvtier.integrations.vllm.accounting import RequestLedger

    led = RequestLedger()
    led.on_lookup("r", 300, 0)
    led.on_load_planned("r", "remote", 256)
    led.on_load_failed("r", {"remote": 256})
    led.on_lookup("r", 300, 0)  # looked up again after the rewind: nothing found this time
    rec = led.get("r")
    assert rec is not None and (rec.kvtier_hit_tokens, rec.load_failures, rec.computed_tokens) == (0, 1, 300)


# -- kv_role gates save and load (issue 14, item 15) -------------------------------------------------
def _fill(m: Any, keys: list[bytes]) -> None:
    """Store ``keys`` as a chain straight into the manager (as another engine would have)."""
    for i, k in enumerate(keys):
        buf = m.open_write(k, keys[i - 1] if i else None)
        assert buf is not None
        buf[:] = 0
        m.commit(k, keys[i - 1] if i else None)


def test_kv_producer_stores_but_never_reports_hits(engine) -> None:
    pair, eng = engine(kv_role="kv_producer")
    m = pair.worker.manager
    prompt = tokens_of(21, 3 * CHUNK + 1)
    eng.serve(prompt)
    assert m.flush(10)
    assert m.lookup_keys(m.keys(prompt)[:3]).num_tokens == 3 * CHUNK  # stored
    assert promised(pair, prompt) == 0  # but a producer does not load


def test_kv_consumer_loads_but_never_stores(engine) -> None:
    pair, eng = engine(kv_role="kv_consumer")
    m = pair.worker.manager
    prompt = tokens_of(22, 3 * CHUNK + 1)
    eng.serve(prompt)
    assert m.flush(10)
    assert m.lookup_keys(m.keys(prompt)[:3]).num_tokens == 0  # nothing stored
    _fill(m, m.keys(prompt)[:3])
    assert promised(pair, prompt) == 3 * CHUNK  # what its tiers hold is loaded


def test_vllm_kv_role_reaches_the_config() -> None:
    """vLLM's own kv_transfer_config.kv_role is what gates kvtier (no separate setting needed)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from fake_vllm import make_vllm_config
    from kvtier.integrations.vllm import KVTierConnector

    cfg = make_vllm_config(GEOM, dict(chunk_size=CHUNK, cpu_capacity=32 * CHUNK_BYTES, model_id="fake/role"), "role")
    cfg.kv_transfer_config.kv_role = "kv_consumer"
    conn = KVTierConnector(cfg, KVConnectorRole.SCHEDULER, None)
    try:
        assert conn.config.kv_role == "kv_consumer" and not conn.config.should_save and conn.config.should_load
    finally:
        conn.shutdown()
