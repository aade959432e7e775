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

from conftest import free_port
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
from service_helpers import start_server, wait_until

GEOM = Geometry(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, num_blocks=64)
CHUNK = 32
CHUNK_BYTES = CHUNK * GEOM.token_bytes
BS = GEOM.block_size


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


def decode(side: Side, r: FakeRequest, timeout_s: float = 20.0, sync: bool = False) -> tuple[int, set[int]]:
    """Decoder lookup + load as vLLM drives it: (tokens promised, blocks reported as load errors).

    ``sync``: the load is expected synchronous (the step that schedules the request runs
    it, then computes the last prompt token); else asynchronous (WAITING_FOR_REMOTE_KVS).
    """
    ext, is_async = side.sched.get_num_new_matched_tokens(r, 0)
    if not ext:
        return 0, set()
    assert is_async is not sync, f"expected a {'sync' if sync else 'async'} load"
    n = len(r.prompt_token_ids)
    if sync:
        assert ext == n - 1, "a sync PD load leaves the last prompt token to the engine"
        blocks = side.alloc(r.request_id, n)
        side.sched.update_state_after_alloc(r, FakeKVCacheBlocks(blocks), ext)
        tracker = side.sched.scheduler._trackers[r.request_id]
        so = FakeSchedulerOutput([NewRequestData(r.request_id, r.prompt_token_ids, (blocks,), ext)],
                                 CachedRequestData(), {r.request_id: 1}, 1, set(), set(), False)
        _, _, errors = side.step(so, forward=(r, n - 1, n))
        assert not tracker.pd_confirmed, "confirmed before the step's output"
        side.sched.update_connector_output(KVConnectorOutput(invalid_block_ids=errors))
        assert tracker.pd_confirmed, "the step that loaded a PD leg confirms it with its output"
        return ext, errors
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


#: Decoder ``pd_sync_load_bytes``: 0 = always async; None = the default (these small loads are sync).
MODES = {"async": {"pd_sync_load_bytes": 0}, "sync": {}}


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("length", [5 * CHUNK + 21, 4 * CHUNK, 13, CHUNK + 1])
def test_decoder_gets_the_whole_prompt_and_prefiller_frees_on_confirm(cluster, length: int, mode: str) -> None:
    pre, dec = cluster("prefill", free_port()), cluster("decode", **MODES[mode])
    prompt = tokens_of(length, length)
    held, params = pre.prefill(req("p-1", prompt, {"do_remote_decode": True}))
    assert held and params is not None and params["do_remote_prefill"]
    assert params["remote_request_id"] == "p-1" and params["remote_block_ids"] == pre.blocks["p-1"]
    assert RemotePrefill.parse(params) is not None
    d = req("d-1", prompt, params)
    ext, errors = decode(dec, d, sync=mode == "sync")
    loaded = length - 1 if mode == "sync" else length  # either way vLLM computes only the last prompt token
    assert ext == loaded and not errors
    rec = dec.sched.scheduler.ledger.get("d-1")
    assert rec is not None and rec.kvtier_hit_tokens == loaded  # a partial last block counts its tokens only
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


def test_idle_prefiller_waits_for_a_confirm_instead_of_spinning(cluster) -> None:
    """An idle step of a prefiller holding a finished request blocks (bounded) on its confirm socket;
    a step with work, or with no finished hold, never waits; the wait ends when a confirm arrives."""
    pre = cluster("prefill", free_port())
    pd = pre.worker.worker.pd
    waits: list[float] = []
    real_wait = pd.wait_for_confirm
    pd.wait_for_confirm = lambda t: (waits.append(t), real_wait(t))[1]
    _, params = pre.prefill(req("p-1", tokens_of(9, 2 * CHUNK + 3), {"do_remote_decode": True}))
    assert not waits, "the prefill's own step has work"
    pre.step(finished={"p-1"})  # vLLM reports it finished: this step records it, waits for nothing yet
    assert not waits
    pre.step()
    assert waits == [pre.worker.worker.IDLE_WAIT_S], "an idle step with a finished hold waits for its confirm"
    dec = cluster("decode")
    dec.sched.scheduler.pd.sender.send(RemotePrefill.parse(params))
    t0 = time.monotonic()
    real_wait(60.0)  # returns once the confirm is readable, long before its bound
    assert time.monotonic() - t0 < 30.0
    waits.clear()
    assert "p-1" in pre.step()[0] and not pd.held  # (its wait returned at once: the confirm was there)
    pre.step()
    assert len(waits) == 1, "no hold left: the next idle step does not wait"


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
    pre, dec = cluster("prefill", free_port()), cluster("decode", **MODES["async"])
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


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
def test_decoder_reports_unreadable_chunks_for_recompute(cluster, mode: str) -> None:
    pre, dec = cluster("prefill", free_port()), cluster("decode", **MODES[mode])
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
    ext, errors = decode(dec, d, sync=mode == "sync")
    blocks = dec.blocks["d-1"]
    assert ext == len(prompt) - (mode == "sync") and errors == set(blocks[4:])  # recomputed from token 2 * CHUNK
    assert np.array_equal(dec.kv(d, 0, 2 * CHUNK), expected_kv(prompt, None, GEOM)[: 2 * CHUNK])
    wait_sending(pre, "p-1")


def test_unreachable_prefiller_confirm_does_not_block(cluster) -> None:
    dec = cluster("decode")
    params = {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_request_id": "p-x",
              "remote_host": "127.0.0.1", "remote_port": free_port(), "remote_block_ids": [1]}
    ext, _ = decode(dec, req("d-1", tokens_of(8, 2 * CHUNK + 1), params))
    assert ext == 0  # nothing stored: the decoder computes the prompt


def test_sync_loads_stay_within_the_step_budget(cluster) -> None:
    """PD loads of one step beyond ``pd_sync_load_bytes`` go async; the budget is per step."""
    pre, dec = cluster("prefill", free_port()), cluster("decode", pd_sync_load_bytes=3 * CHUNK_BYTES)
    prompts = {i: tokens_of(40 + i, 2 * CHUNK + 5) for i in range(4)}  # 3 chunks to load each
    params = {i: pre.prefill(req(f"p-{i}", p, {"do_remote_decode": True}))[1] for i, p in prompts.items()}
    looked = [dec.sched.get_num_new_matched_tokens(req(f"d-{i}", prompts[i], params[i]), 0) for i in (0, 1)]
    assert looked == [(2 * CHUNK + 4, False), (2 * CHUNK + 5, True)], "the second load of the step is async"
    dec.step()  # a new step: the budget is free again (the async load runs meanwhile)
    assert dec.sched.get_num_new_matched_tokens(req("d-2", prompts[2], params[2]), 0) == (2 * CHUNK + 4, False)
    long_prompt = tokens_of(50, 3 * CHUNK + 5)
    _, lp = pre.prefill(req("p-long", long_prompt, {"do_remote_decode": True}))
    dec.step()  # a load of 4 chunks never fits the budget
    assert dec.sched.get_num_new_matched_tokens(req("d-long", long_prompt, lp), 0) == (3 * CHUNK + 5, True)


def test_sync_decision_needs_every_chunk_in_memory() -> None:
    """``PDScheduler.decode_hit``: sync only when each chunk past the engine's hit is in the CPU tier."""
    from types import SimpleNamespace

    from kvtier.integrations.vllm.pd_scheduler import PDScheduler
    from kvtier.storage.types import LookupResult

    hasher = SimpleNamespace(chunk_size=CHUNK)
    pd = PDScheduler(PDSettings("decode"), "e", hasher, 2, CHUNK_BYTES)  # type: ignore[arg-type]
    tr = SimpleNamespace(tokens=list(range(3 * CHUNK + 7)))
    keys = [bytes([i]) * 32 for i in range(4)]
    hit = 4 * CHUNK
    assert pd.decode_hit(tr, LookupResult(hit, keys, ["cpu"] * 4), 0) == (LookupResult(3 * CHUNK + 6, keys, ["cpu"] * 4), True)
    tiers = ["cpu", "disk", "cpu", "cpu"]
    assert pd.decode_hit(tr, LookupResult(hit, keys, tiers), 0) == (LookupResult(3 * CHUNK + 7, keys, tiers), False)
    # the engine already holds chunks 0-1: only chunks 2-3 are loaded, both in memory
    assert pd.decode_hit(tr, LookupResult(hit, keys, tiers), 2 * CHUNK)[1] is True
    off = PDScheduler(PDSettings("decode", sync_load_bytes=0), "e", hasher, 2, CHUNK_BYTES)  # type: ignore[arg-type]
    assert off.decode_hit(tr, LookupResult(hit, keys, ["cpu"] * 4), 0)[1] is False


def test_settings_and_keys() -> None:
    extra = {"pd_role": "prefill", "pd_port": 5601, "pd_lease_s": 2, "chunk_size": 32, "pd_sync_load_bytes": 1024}
    s = PDSettings.pop_from(extra)
    assert (s.role, s.port, s.lease_s, s.sync_load_bytes) == ("prefill", 5601, 2.0, 1024)
    assert extra == {"chunk_size": 32}
    assert PDSettings.pop_from({}).sync_load_bytes == 128 << 20
    with pytest.raises(ValueError):
        PDSettings.pop_from({"pd_sync_load_bytes": -1})
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


def test_an_lmcache_pd_config_gives_the_connector_its_role(tmp_path: Path) -> None:
    """LMCache's enable_pd + pd_role (receiver) is the decoder role; the connector's own pd_role wins."""
    f = tmp_path / "lmcache-decoder.yaml"
    f.write_text("chunk_size: 32\nlocal_cpu: true\nmax_local_cpu_size: 0.001\nenable_pd: true\npd_role: receiver\n"
                 "pd_peer_host: localhost\npd_peer_init_port: 7300\n")
    base = dict(model_id="fake/pd-lmcache", lmcache_config_file=str(f), lease_ttl_s=3600.0)
    pair = make_connectors(GEOM, base, engine_id=f"pd-lmc-{uuid.uuid4().hex[:8]}")
    try:
        assert pair.scheduler.pd.role == "decode" and pair.worker.pd.role == "decode"
    finally:
        pair.shutdown()
    own = make_connectors(GEOM, dict(base, pd_role="off"), engine_id=f"pd-lmc-{uuid.uuid4().hex[:8]}")
    try:
        assert own.scheduler.pd.role == "off"
    finally:
        own.shutdown()


def test_a_scribbled_server_chunk_is_reported_for_recompute_never_loaded(cluster: Any) -> None:
    """Server mode, the worker's load path: the client checks each chunk as it copies it; a chunk
    another client overwrote in shared memory fails, its blocks and every later one are reported."""
    from kvtier.integrations.vllm.types import ChunkCopy, TransferSpec

    side = cluster("off")
    w = side.pair.worker.worker  # the KVTierWorker
    store = w.store
    assert store.verify == "client"
    bpc = CHUNK // GEOM.block_size
    keys = [bytes([i]) * 32 for i in (1, 2, 3)]
    parent = None
    for k in keys:  # three chunks of known bytes
        buf = store.open_write(k, parent)
        buf[:] = np.frombuffer(k * (len(buf) // 32), dtype=np.uint8)
        store.commit(k, parent)
        parent = k
    store.flush(10.0)
    host = cluster.server.hosts()[0]
    wait_until(lambda: host.manager.cpu.contains(keys[2]), what="commits")
    h = host.manager.open_read(keys[1])
    slot = host.pool.slot_of(h.buffer)
    h.close()
    host.pool.view(slot)[:] = 0xEE  # any client's mapping could do this
    blocks = [tuple(range(i * bpc, (i + 1) * bpc)) for i in range(3)]
    spec = TransferSpec("r-scribbled", [ChunkCopy(k, b, 0, p) for k, b, p in zip(keys, blocks, [None, *keys[:2]])])
    assert w._load_request(spec) is False
    assert w.get_block_ids_with_load_errors() == set(blocks[1] + blocks[2])  # from the scribbled chunk on
    assert store.counters.corrupt_loads == 1
    wait_until(lambda: host.sums.corrupt == 1, what="the server confirms the report")
