"""PD disaggregation protocol (kvtier/integrations/vllm/pd*.py) with two fake engines and a kvtier server.

A prefiller and a decoder (each a SCHEDULER- and a WORKER-role KVTierConnector over
fake paged KV, see ``fake_vllm``) share one in-process ``kvtier server``. The steps
follow vLLM's call order by hand; every check reads real state: the decoder's KV
blocks against the deterministic KV pattern, the prefiller's held and freed blocks
through ``finished_sending``, and the server's leases.
"""

from __future__ import annotations

import random
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from vllm.v1.outputs import KVConnectorOutput

from fake_vllm import (
    GARBAGE,
    CachedRequestData,
    ConnectorPair,
    FakeKVCacheBlocks,
    FakeRequest,
    FakeSchedulerOutput,
    Geometry,
    NewRequestData,
    expected_kv,
    make_connectors,
)
from kvtier.integrations.vllm.pd import PDSettings, RemotePrefill, partial_key
from service_helpers import start_server

GEOM = Geometry(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, num_blocks=64)
CHUNK = 32
CHUNK_BYTES = CHUNK * GEOM.token_bytes
BS = GEOM.block_size


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tokens_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(n)]


class Side:
    """One fake engine: a connector pair, a block allocator and the hand-driven vLLM steps."""

    def __init__(self, pair: ConnectorPair):
        self.pair = pair
        self.sched = pair.scheduler
        self.worker = pair.worker
        self.free = list(range(GEOM.num_blocks))
        self.blocks: dict[str, list[int]] = {}

    def alloc(self, rid: str, num_tokens: int) -> list[int]:
        got = [self.free.pop() for _ in range(-(-num_tokens // BS))]
        for layer in self.pair.layers:
            layer[got] = GARBAGE
        self.blocks[rid] = got
        return got

    def release_blocks(self, rid: str) -> None:
        self.free.extend(self.blocks.pop(rid))

    def step(self, so: FakeSchedulerOutput | None = None, forward: tuple[FakeRequest, int, int] | None = None,
             finished: set[str] = frozenset()) -> tuple[set[str], set[str], set[int]]:
        """build meta -> worker (loads, forward, saves) -> get_finished: (sending, recving, load errors)."""
        so = so or FakeSchedulerOutput([], CachedRequestData(), {}, 0, set(), set(finished), False)
        meta = self.sched.build_connector_meta(so)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        if forward is not None:
            r, start, end = forward
            self.write(r, start, end)
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(set(finished))
        errors = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        self.sched.check_invariants()
        return set(sending or ()), set(recving or ()), set(errors)

    def kv(self, r: FakeRequest, start: int, end: int) -> np.ndarray:
        ids = np.asarray(self.blocks[r.request_id])
        pos = np.arange(start, end)
        return np.stack([layer[ids[pos // BS], :, pos % BS, :] for layer in self.pair.layers], axis=1)

    def write(self, r: FakeRequest, start: int, end: int) -> None:
        ids = np.asarray(self.blocks[r.request_id])
        pos = np.arange(start, end)
        exp = expected_kv(r.prompt_token_ids, r.cache_salt, GEOM)[start:end]
        for i, layer in enumerate(self.pair.layers):
            layer[ids[pos // BS], :, pos % BS, :] = exp[:, i]

    def prefill(self, r: FakeRequest) -> tuple[bool, dict[str, Any] | None]:
        """Schedule, compute and finish a max_tokens=1 prefill leg; ``request_finished``'s reply."""
        ext, _ = self.sched.get_num_new_matched_tokens(r, 0)
        assert not ext
        blocks = self.alloc(r.request_id, len(r.prompt_token_ids))
        self.sched.update_state_after_alloc(r, FakeKVCacheBlocks(blocks), 0)
        n = len(r.prompt_token_ids)
        so = FakeSchedulerOutput([NewRequestData(r.request_id, r.prompt_token_ids, (blocks,), 0)],
                                 CachedRequestData(), {r.request_id: n}, n, set(), set(), False)
        self.step(so, forward=(r, 0, n))
        r.status = "FINISHED_LENGTH_CAPPED"
        return self.sched.request_finished(r, list(blocks))


@pytest.fixture
def cluster() -> Iterator[Any]:
    d = Path(tempfile.mkdtemp(prefix="kvpd-", dir="/tmp"))
    made: list[ConnectorPair] = []

    def make(role: str, port: int | None = None, **extra: Any) -> Side:
        cfg: dict[str, Any] = dict(chunk_size=CHUNK, model_id="fake/pd-test", server=f"unix://{d / 's.sock'}",
                                   server_timeout_s=5.0, pd_role=role, lease_ttl_s=3600.0)
        if port is not None:
            cfg["pd_port"] = port
        cfg.update(extra)
        pair = make_connectors(GEOM, cfg, engine_id=f"pd-{role}-{uuid.uuid4().hex[:8]}")
        made.append(pair)
        return Side(pair)

    try:
        with start_server(d, cpu_chunks=64) as server:
            make.server = server  # type: ignore[attr-defined]
            yield make
            for p in made:
                p.shutdown()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def req(rid: str, tokens: list[int], params: dict[str, Any] | None) -> FakeRequest:
    return FakeRequest(rid, list(tokens), None, [7], 1, kv_transfer_params=params)


def wait_sending(side: Side, rid: str, timeout_s: float = 20.0) -> None:
    """Step ``side`` (vLLM reported ``rid`` finished) until ``rid`` is in finished_sending (hang guard)."""
    deadline = time.monotonic() + timeout_s
    first = True
    while time.monotonic() < deadline:
        sending, _, _ = side.step(finished={rid} if first else set())
        first = False
        if rid in sending:
            return
        time.sleep(0.01)
    raise AssertionError(f"{rid} never reported in finished_sending")


def decode(side: Side, r: FakeRequest, timeout_s: float = 20.0) -> tuple[int, set[int]]:
    """Decoder lookup + async load: (tokens promised, blocks reported as load errors)."""
    ext, is_async = side.sched.get_num_new_matched_tokens(r, 0)
    if not ext:
        return 0, set()
    assert is_async, "a PD decode leg loads asynchronously (WAITING_FOR_REMOTE_KVS)"
    blocks = side.alloc(r.request_id, ext)
    side.sched.update_state_after_alloc(r, FakeKVCacheBlocks(blocks), ext)
    errors: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, recving, errs = side.step()
        errors |= errs
        if r.request_id in recving:
            side.sched.update_connector_output(KVConnectorOutput(finished_recving={r.request_id},
                                                                 invalid_block_ids=errors))
            return ext, errors
        time.sleep(0.005)
    raise AssertionError("async load never finished")


@pytest.mark.parametrize("length", [5 * CHUNK + 21, 4 * CHUNK, 13])
def test_decoder_gets_the_whole_prompt_and_prefiller_frees_on_confirm(cluster, length: int) -> None:
    pre, dec = cluster("prefill", free_port()), cluster("decode")
    prompt = tokens_of(length, length)
    held, params = pre.prefill(req("p-1", prompt, {"do_remote_decode": True}))
    assert held and params is not None and params["do_remote_prefill"]
    assert params["remote_request_id"] == "p-1" and params["remote_block_ids"] == pre.blocks["p-1"]
    assert RemotePrefill.parse(params) is not None
    d = req("d-1", prompt, params)
    ext, errors = decode(dec, d)
    assert ext == length and not errors  # vLLM then recomputes only the last prompt token
    rec = dec.sched.scheduler.ledger.get("d-1")
    assert rec is not None and rec.kvtier_hit_tokens == length  # a partial last block counts its tokens only
    assert np.array_equal(dec.kv(d, 0, length), expected_kv(prompt, None, GEOM)), "decoder KV differs"
    assert pre.worker.worker.pd.held, "blocks are held until the confirm"
    wait_sending(pre, "p-1")
    assert not pre.worker.worker.pd.held and pre.worker.worker.pd.confirms == 1
    pre.release_blocks("p-1")


def test_lease_expiry_frees_without_confirm(cluster) -> None:
    pre = cluster("prefill", free_port(), pd_lease_s=30.0)
    now = [1000.0]
    pre.worker.worker.pd.clock = lambda: now[0]
    held, _ = pre.prefill(req("p-1", tokens_of(1, 3 * CHUNK + 5), {"do_remote_decode": True}))
    assert held
    sending, _, _ = pre.step(finished={"p-1"})
    assert "p-1" not in sending
    now[0] += 29.0
    assert "p-1" not in pre.step()[0]
    now[0] += 1.5
    assert "p-1" in pre.step()[0]
    assert pre.worker.worker.pd.expired == 1 and not pre.worker.worker.pd.held
    assert "p-1" not in pre.step()[0], "reported twice"


def test_prefill_aborted_after_compute_frees_at_next_step(cluster) -> None:
    pre = cluster("prefill", free_port())
    r = req("p-1", tokens_of(2, 2 * CHUNK + 3), {"do_remote_decode": True})
    pre.prefill(r)  # marks the hold; then vLLM reports it aborted (status set below, second finish call)
    # an abort that arrives before the request finished: emulate with a fresh request aborted mid-prompt
    r2 = req("p-2", tokens_of(3, 2 * CHUNK + 3), {"do_remote_decode": True})
    pre.sched.get_num_new_matched_tokens(r2, 0)
    r2.status = "FINISHED_ABORTED"
    assert pre.sched.request_finished(r2, []) == (False, None), "nothing computed: nothing held"
    # aborted after its prompt was computed: held, released at the next step without any confirm
    r3 = req("p-3", tokens_of(4, 2 * CHUNK + 3), {"do_remote_decode": True})
    pre.sched.get_num_new_matched_tokens(r3, 0)
    blocks = pre.alloc("p-3", len(r3.prompt_token_ids))
    pre.sched.update_state_after_alloc(r3, FakeKVCacheBlocks(blocks), 0)
    n = len(r3.prompt_token_ids)
    pre.step(FakeSchedulerOutput([NewRequestData("p-3", r3.prompt_token_ids, (blocks,), 0)], CachedRequestData(),
                                 {"p-3": n}, n, set(), set(), False), forward=(r3, 0, n))
    r3.status = "FINISHED_ABORTED"
    held, params = pre.sched.request_finished(r3, blocks)
    assert held and params is None
    sending, _, _ = pre.step(finished={"p-3"})
    assert "p-3" in sending and "p-3" not in pre.worker.worker.pd.held


def test_decoder_abort_mid_load_confirms(cluster) -> None:
    pre, dec = cluster("prefill", free_port()), cluster("decode")
    prompt = tokens_of(5, 3 * CHUNK + 9)
    _, params = pre.prefill(req("p-1", prompt, {"do_remote_decode": True}))
    d = req("d-1", prompt, params)
    ext, _ = dec.sched.get_num_new_matched_tokens(d, 0)
    assert ext == len(prompt)
    d.status = "FINISHED_ABORTED"
    held, _ = dec.sched.request_finished(d, [])  # aborted before its blocks were allocated
    assert not held
    wait_sending(pre, "p-1")


def test_decoder_with_missing_kv_computes_and_confirms(cluster) -> None:
    pre, dec = cluster("prefill", free_port()), cluster("decode")
    prompt = tokens_of(6, 3 * CHUNK + 9)
    _, params = pre.prefill(req("p-1", prompt, {"do_remote_decode": True}))
    other = list(prompt)
    other[0] += 1  # the decoder's prompt differs: its own keys miss, never another prompt's KV
    ext, _ = decode(dec, req("d-1", other, params))
    assert ext == 0
    wait_sending(pre, "p-1")


def test_decoder_reports_unreadable_chunks_for_recompute(cluster) -> None:
    pre, dec = cluster("prefill", free_port()), cluster("decode")
    prompt = tokens_of(7, 4 * CHUNK + 9)
    _, params = pre.prefill(req("p-1", prompt, {"do_remote_decode": True}))
    store = dec.worker.worker.store
    real = store.open_read_many

    def lose_from_chunk_2(items):  # chunks 2.. vanish between lookup and load
        handles = real(items)
        for h in handles[2:]:
            if h is not None:
                h.close()
        return handles[:2] + [None] * (len(handles) - 2)

    store.open_read_many = lose_from_chunk_2
    d = req("d-1", prompt, params)
    ext, errors = decode(dec, d)
    blocks = dec.blocks["d-1"]
    assert ext == len(prompt) and errors == set(blocks[4:])  # vLLM recomputes from token 2 * CHUNK
    assert np.array_equal(dec.kv(d, 0, 2 * CHUNK), expected_kv(prompt, None, GEOM)[: 2 * CHUNK])
    wait_sending(pre, "p-1")


def test_unreachable_prefiller_confirm_does_not_block(cluster) -> None:
    dec = cluster("decode")
    params = {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_request_id": "p-x",
              "remote_host": "127.0.0.1", "remote_port": free_port(), "remote_block_ids": [1]}
    ext, _ = decode(dec, req("d-1", tokens_of(8, 2 * CHUNK + 1), params))
    assert ext == 0  # nothing stored: the decoder computes the prompt


def test_settings_and_keys() -> None:
    extra = {"pd_role": "prefill", "pd_port": 5601, "pd_lease_s": 2, "chunk_size": 32}
    s = PDSettings.pop_from(extra)
    assert (s.role, s.port, s.lease_s) == ("prefill", 5601, 2.0) and extra == {"chunk_size": 32}
    with pytest.raises(ValueError):
        PDSettings.pop_from({"pd_role": "prefill"})
    with pytest.raises(ValueError):
        PDSettings.pop_from({"pd_role": "sideways"})
    assert partial_key(b"k" * 32, 5) != partial_key(b"k" * 32, 6)
    assert RemotePrefill.parse({"do_remote_prefill": True}) is None  # malformed: computed, not crashed


def test_prefiller_under_random_aborts_and_preemption_leaks_nothing(cluster) -> None:
    """Many prefill legs through the fake engine (aborts before/after/mid step, preemption, local
    hits), no decoder: every held request is freed by lease expiry, no block or hold is left."""
    from fake_vllm import FakeEngine, Knobs

    pre = cluster("prefill", free_port(), pd_lease_s=0.02)
    rng = random.Random(3)
    params = {"kv_transfer_params": {"do_remote_decode": True}}
    prompts = [(tokens_of(100 + i, rng.randint(5, 5 * CHUNK)), None, params) for i in range(12)]
    eng = FakeEngine(pre.pair, GEOM, prompts, seed=5, knobs=Knobs(p_abort=0.08, p_preempt=0.05))
    stats = eng.run(num_requests=60, max_steps=20_000)  # asserts: no leaked engine block
    assert stats.finished + stats.aborted_running > 0
    pd = pre.worker.worker.pd
    assert not pd.held and pd.expired > 0 and not eng.delayed_free
