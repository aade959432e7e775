"""KVTierConnector lifecycle under stress: leases and references never leak, loads are exact.

Drives the real connector (a SCHEDULER-role and a WORKER-role instance in one
process; the scheduler finds the worker's manager through the registry) with the
fake engine of ``fake_vllm``: thousands of requests over a shared prompt set, with
random aborts (before allocation, after allocation, mid-prefill, mid-step),
preemptions, allocation failures, local prefix hits, and a CPU tier of a few
chunks (some runs with a disk tier). Every load is checked block by block
against the deterministic KV pattern of its tokens (see ``fake_vllm``); at the
end no lease, pin or reference is left and the connectors track no request.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from fake_vllm import ConnectorPair, FakeEngine, Geometry, Knobs, make_connectors
from kvtier.tiers.disk import HEADER_BYTES

GEOM = Geometry(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, num_blocks=48)
CHUNK = 32  # tokens: two engine blocks
CHUNK_BYTES = CHUNK * GEOM.token_bytes  # 2,048
DISK_CHUNK_BYTES = HEADER_BYTES + CHUNK_BYTES
MODEL_ID = "fake/tiny-model@lifecycle-test"

#: Containers on a connector that hold no per-request state (besides lists of KV views).
NOT_REQUEST_STATE = {"_layers", "_kv"}


def prompt_set(seed: int) -> tuple[list[tuple[list[int], str | None]], list[float]]:
    """Prompts in families sharing long prefixes (so lookups really hit), with Zipf-like weights.

    Includes prompts of exactly a multiple of the chunk size, prompts shorter than
    one chunk, and the same tokens under another tenant's cache salt.
    """
    rng = random.Random(seed)
    prompts: list[tuple[list[int], str | None]] = []
    for fam in range(8):
        prefix = [rng.randrange(1, 30_000) for _ in range(rng.randint(20, 100))]
        for v in range(5):
            if v == 0:
                length = -(-len(prefix) // CHUNK) * CHUNK + CHUNK  # an exact multiple of the chunk size
                tokens = prefix + [rng.randrange(1, 30_000) for _ in range(length - len(prefix))]
            else:
                tokens = prefix + [rng.randrange(1, 30_000) for _ in range(rng.randint(1, 80))]
            prompts.append((tokens, None))
            if fam < 2:
                prompts.append((list(tokens), "tenant-b"))
    prompts.append(([rng.randrange(1, 30_000) for _ in range(CHUNK - 5)], None))  # shorter than a chunk
    weights = [1.0 / (i + 1) ** 0.8 for i in range(len(prompts))]
    rng.shuffle(weights)
    return prompts, weights


def extra_config(cpu_chunks: int, disk_dir: Path | None = None, disk_chunks: int = 0, **kw: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` for the tiny geometry: tier sizes in chunks."""
    out: dict[str, Any] = dict(
        chunk_size=CHUNK, cpu_capacity=cpu_chunks * CHUNK_BYTES, model_id=MODEL_ID, lease_ttl_s=3600.0
    )
    if disk_dir is not None:
        out.update(disk_path=str(disk_dir), disk_capacity=disk_chunks * DISK_CHUNK_BYTES)
    out.update(kw)
    return out


@pytest.fixture
def connectors() -> Iterator[Callable[..., ConnectorPair]]:
    """Make connector pairs with unique engine ids; shut them all down afterwards."""
    made: list[ConnectorPair] = []

    def make(extra: dict[str, Any], kv_layout: str = "stacked") -> ConnectorPair:
        pair = make_connectors(GEOM, extra, engine_id=f"lifecycle-{uuid.uuid4().hex[:12]}", kv_layout=kv_layout)
        made.append(pair)
        return pair

    yield make
    for p in made:
        p.shutdown()


def request_state(conn: Any) -> dict[str, Any]:
    """Non-empty containers of a connector, other than known non-request state."""
    out = {}
    for name, value in vars(conn).items():
        if name in NOT_REQUEST_STATE:
            continue
        if isinstance(value, list) and all(isinstance(v, np.ndarray) for v in value):
            continue  # views of the engine's KV
        if isinstance(value, (dict, set, list, deque)) and len(value):
            out[name] = value
    return out


def assert_quiescent(pair: ConnectorPair) -> dict[str, int | float]:
    """No lease, pin, reference or tracked request is left; returns the manager's stats."""
    m = pair.worker.manager
    assert m is not None
    assert m.flush(30), "write-behind did not drain"
    st = m.stats()
    assert st["leases"] == 0, st
    assert st["pinned_chunks"] == 0, st
    assert st["referenced_chunks"] == 0, st
    assert st["leases_expired"] == 0, "a lease was ended by its TTL, not by the request's lifecycle"
    sched = pair.scheduler.scheduler
    left = request_state(sched)
    if set(left) == {"_unsettled"} and not any(is_async for _, is_async in left["_unsettled"].values()):
        # A request aborted between steps after its sync load ran is settled by the engine's next
        # output (with async scheduling that output may still carry its failures); the run ended
        # first. Deliver the empty output of an idle step, as vLLM's next step would.
        from vllm.v1.outputs import KVConnectorOutput

        sched.update_connector_output(KVConnectorOutput())
    assert request_state(sched) == {}
    assert request_state(pair.worker.worker) == {}
    pair.scheduler.check_invariants()
    return st


# -- stress ------------------------------------------------------------------------------------------


def run_stress(pair: ConnectorPair, seed: int, num_requests: int, knobs: Knobs | None = None) -> FakeEngine:
    prompts, weights = prompt_set(seed)
    eng = FakeEngine(pair, GEOM, prompts, seed=seed, knobs=knobs, weights=weights)
    eng.run(num_requests, max_steps=num_requests * 20)
    return eng


def check_stress_coverage(eng: FakeEngine) -> None:
    """The run exercised what it claims to (so a passing run means something)."""
    s = eng.stats
    assert s.finished > s.submitted // 2
    assert s.aborted_waiting_no_lookup and s.aborted_holding_a_hit and s.aborted_running
    assert s.aborted_mid_step and s.preemptions and s.alloc_failures
    assert s.loads > 100 and s.loaded_blocks_verified > 500, s
    assert s.local_hit_tokens > 0


@pytest.mark.slow  # 10k requests: ~15 s on 2 cores
def test_stress_cpu_tier_10k_requests(connectors) -> None:
    pair = connectors(extra_config(cpu_chunks=6))
    eng = run_stress(pair, seed=11, num_requests=10_000)
    st = assert_quiescent(pair)
    check_stress_coverage(eng)
    assert pair.scheduler.scheduler.ledger.totals()["hit_tokens_cpu"] > 0 and st["cpu_evicted_chunks"] > 0
    assert pair.scheduler.scheduler.ledger.load_failures_total == 0 and eng.stats.error_blocks == 0  # nothing was lost: every promise kept


@pytest.mark.slow
@pytest.mark.parametrize("kv_layout", ["padded", "separate"])
def test_stress_other_kv_layouts(connectors, kv_layout: str) -> None:
    """Layers at uneven offsets of one storage, or in separate allocations (per-layer copies)."""
    pair = connectors(extra_config(cpu_chunks=6), kv_layout=kv_layout)
    eng = run_stress(pair, seed=16, num_requests=2_000)
    assert_quiescent(pair)
    assert eng.stats.loaded_blocks_verified > 500


@pytest.mark.slow  # over 5 s on 2 cores: out of the fast loop
def test_stress_cpu_and_disk_tiers(connectors, tmp_path: Path) -> None:
    pair = connectors(extra_config(cpu_chunks=4, disk_dir=tmp_path / "disk", disk_chunks=12))
    eng = run_stress(pair, seed=12, num_requests=4_000)
    st = assert_quiescent(pair)
    check_stress_coverage(eng)
    assert pair.scheduler.scheduler.ledger.totals()["hit_tokens_disk"] > 0 and st["disk_evicted_chunks"] > 0 and st["promoted_chunks"] > 0
    assert eng.stats.async_loads > 0 and eng.stats.aborted_waiting_async_load > 0


def lose_chunks(pair: ConnectorPair, seed: int, p: float) -> Callable[[FakeEngine], None]:
    """A ``before_execute`` hook: with probability ``p`` per step, one chunk that a load planned
    in this step will read is deleted from every tier behind the manager's back (its lease
    ignored), so that load must fail and report."""
    m = pair.worker.manager
    rng = random.Random(seed)

    def hook(eng: FakeEngine) -> None:
        if not eng.load_window or rng.random() >= p:
            return
        rid = rng.choice(sorted(eng.load_window))
        r = eng.requests.get(rid)
        if r is None:
            return
        first, end = eng.load_window[rid]
        keys = m.keys(r.prompt_token_ids, r.cache_salt)[first // CHUNK : end // CHUNK]
        key = rng.choice(keys)
        m.cpu.delete(key)
        if m.disk is not None:
            m.disk.delete(key)

    return hook


@pytest.mark.slow
@pytest.mark.parametrize(
    "context_dependent",
    [False, True],
    ids=["context-free-kv", "context-dependent-kv"],
)
def test_stress_with_chunks_lost_between_lookup_and_load(connectors, context_dependent: bool) -> None:
    """Chunks vanish behind the manager's back: every load is exact or reported, nothing leaks.

    With context-free KV this checks reporting and lifetimes alone; with
    context-dependent KV it also catches KV computed over a failed load being stored.
    """
    pair = connectors(extra_config(cpu_chunks=32))
    prompts, weights = prompt_set(13)
    knobs = Knobs(context_dependent=context_dependent)
    eng = FakeEngine(pair, GEOM, prompts, seed=13, knobs=knobs, weights=weights)
    eng.before_execute = lose_chunks(pair, seed=13, p=0.3)
    eng.run(3_000, max_steps=60_000)
    st = assert_quiescent(pair)
    assert eng.stats.loaded_blocks_verified > 500
    assert pair.scheduler.scheduler.ledger.load_failures_total >= 5 and eng.stats.error_blocks >= 10 and eng.stats.rewinds >= 5, eng.stats


@pytest.mark.slow
def test_stress_cpu_and_disk_tiers_keeps_every_promise(connectors, tmp_path: Path) -> None:
    """Nothing is deleted behind the manager's back here, so every leased chunk must load.

    (Only loads of requests still alive count: a request aborted mid-load ends its
    lease, and its load may then miss harmlessly.)
    """
    pair = connectors(extra_config(cpu_chunks=4, disk_dir=tmp_path / "disk", disk_chunks=12))
    eng = run_stress(pair, seed=15, num_requests=2_000)
    assert_quiescent(pair)
    assert eng.stats.error_blocks == 0 and eng.stats.rewinds == 0, eng.stats


# -- scripted scenarios ----------------------------------------------------------------------------------

#: No randomness: whole prompts in one step, no aborts, preemptions, allocation failures or local hits.
SCRIPTED = Knobs(
    p_alloc_fail=0,
    p_preempt=0,
    p_abort=0,
    p_abort_mid_step=0,
    p_local_hit=0,
    prefill_chunks=(10_000,),
    target_waiting=0,
)


def tokens_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(n)]


def fill_tiers(pair: ConnectorPair, seed: int, num_chunks: int) -> int:
    """Store ``num_chunks`` chunks of unrelated prompts through the manager (eviction pressure).

    Waits for write-behind after each store, so its CPU references never block the
    next one. Returns how many were stored.
    """
    m = pair.worker.manager
    stored = 0
    for key in m.keys(tokens_of(seed, num_chunks * CHUNK)):
        buf = m.open_write(key, None)
        if buf is not None:
            buf[:] = key[0]
            m.commit(key, None)
            assert m.flush(10)
            stored += 1
    return stored


def when_loading(eng: FakeEngine, req_id: str, action: Callable[[], None], every_step: bool = False) -> None:
    """Run ``action`` after the step planning ``req_id``'s load was built, before the worker runs it
    (and, with ``every_step``, in every later step until that load is over)."""
    state = {"done": False}

    def hook(e: FakeEngine) -> None:
        if req_id in e.load_window and (every_step or not state["done"]):
            state["done"] = True
            action()

    eng.before_execute = hook


def the_load(eng: FakeEngine, req_id: str):
    loads = [rec for rec in eng.load_log if rec.req_id == req_id]
    assert len(loads) == 1, loads
    return loads[0]


@pytest.mark.parametrize("with_disk", [False, True], ids=["cpu", "cpu+disk"])
def test_lookup_promise_is_kept_under_eviction_pressure(connectors, tmp_path: Path, with_disk: bool) -> None:
    """Between the lookup and the load, other prompts flood every tier: the leased chunks survive.

    (Flooding *while* an asynchronous load runs can still fail it: see
    test_concurrency.test_leased_disk_chunk_loads_when_cpu_slots_are_all_pinned.)
    """
    if with_disk:
        pair = connectors(extra_config(cpu_chunks=4, disk_dir=tmp_path / "disk", disk_chunks=8))
    else:
        pair = connectors(extra_config(cpu_chunks=6))
    m = pair.worker.manager
    eng = FakeEngine(pair, GEOM, [], seed=1, knobs=SCRIPTED)
    prompt = tokens_of(7, 3 * CHUNK + 3)
    eng.serve(prompt)  # computes and stores chunks 0..2
    if with_disk:
        assert m.flush(10)
        m.cpu.clear()  # only the disk tier holds them now: the load is asynchronous
    b = eng.submit(prompt, max_tokens=1)
    flooded = []

    def flood() -> None:
        flooded.append(fill_tiers(pair, seed=100, num_chunks=20))

    when_loading(eng, b.request_id, flood)
    eng._limit = eng.stats.submitted
    # Steps until the request finishes: an asynchronous (disk) load can take many fast fake
    # steps on a loaded machine, so the bound is time (a hang guard), not a step count.
    deadline = time.monotonic() + 60
    while b.request_id in eng.requests and time.monotonic() < deadline:
        eng.step()
        time.sleep(0.005)
    assert b.request_id not in eng.requests
    assert sum(flooded) >= 20, flooded  # the tiers really were flooded
    assert m.stats()["cpu_evicted_chunks"] >= 10
    rec = the_load(eng, b.request_id)
    assert (rec.first, rec.end) == (0, 3 * CHUNK) and rec.is_async == with_disk
    assert rec.reported == set(), "a leased chunk was lost between lookup and load"
    st = assert_quiescent(pair)
    assert pair.scheduler.scheduler.ledger.load_failures_total == 0


def test_chunk_deleted_behind_the_managers_back_reports_exactly_the_unfilled_blocks(connectors) -> None:
    pair = connectors(extra_config(cpu_chunks=16))
    m = pair.worker.manager
    eng = FakeEngine(pair, GEOM, [], seed=2, knobs=SCRIPTED)
    prompt = tokens_of(8, 4 * CHUNK + 5)
    keys = m.keys(prompt)
    eng.serve(prompt)
    b = eng.submit(prompt, max_tokens=1)
    eng.force_local_blocks[b.request_id] = 1  # vLLM holds block 0: the load starts mid-chunk (offset 1)
    # chunk 2 vanishes (with its child: a tier never keeps a chunk whose parent it dropped)
    when_loading(eng, b.request_id, lambda: [m.cpu.delete(k) for k in reversed(keys[2:])])
    eng._limit = eng.stats.submitted
    while b.request_id in eng.requests:
        eng.step()
    rec = the_load(eng, b.request_id)
    assert (rec.first, rec.end) == (GEOM.block_size, 4 * CHUNK)
    bpc = CHUNK // GEOM.block_size
    lost = rec.block_ids[2 * bpc - 1 : 3 * bpc - 1]  # chunk 2's blocks (the window starts at block 1)
    filled = rec.block_ids[: 2 * bpc - 1]
    # every unreported block was checked to hold its exact KV (FakeEngine); here: the lost
    # chunk's blocks are all reported, and nothing before them is.
    assert set(lost) <= rec.reported
    assert not rec.reported & set(filled)
    assert eng.stats.rewinds == 1
    st = assert_quiescent(pair)
    assert pair.scheduler.scheduler.ledger.load_failures_total == 1


def test_corrupt_disk_chunk_reports_exactly_the_unfilled_blocks(connectors, tmp_path: Path) -> None:
    pair = connectors(extra_config(cpu_chunks=8, disk_dir=tmp_path / "disk", disk_chunks=8))
    m = pair.worker.manager
    eng = FakeEngine(pair, GEOM, [], seed=3, knobs=SCRIPTED)
    prompt = tokens_of(9, 4 * CHUNK + 5)
    keys = m.keys(prompt)
    eng.serve(prompt)
    assert m.flush(10)
    m.cpu.clear()
    path = m.disk.file_of(keys[1])
    with open(path, "r+b") as f:  # flip one payload byte: the checksum no longer matches
        f.seek(HEADER_BYTES + 100)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    b = eng.serve(prompt)
    rec = the_load(eng, b.request_id)
    assert rec.is_async and (rec.first, rec.end) == (0, 4 * CHUNK)
    bpc = CHUNK // GEOM.block_size
    assert set(rec.block_ids[bpc : 2 * bpc]) <= rec.reported
    assert not rec.reported & set(rec.block_ids[:bpc])
    st = assert_quiescent(pair)
    # One failed load reaches the engine; the disk may count the corrupt file more than once when a
    # promotion read races the load's read before the file is dropped (seen once in a fast loop).
    assert pair.scheduler.scheduler.ledger.load_failures_total == 1 and st["disk_corrupt_reads"] >= 1


def test_failed_sync_load_does_not_store_chunks_computed_over_the_gap(connectors) -> None:
    pair = connectors(extra_config(cpu_chunks=16))
    m = pair.worker.manager
    eng = FakeEngine(pair, GEOM, [], seed=4, knobs=SCRIPTED)
    prompt = tokens_of(10, 4 * CHUNK + 10)
    keys = m.keys(prompt)
    eng.serve(prompt[: 2 * CHUNK + 5])  # stores chunks 0 and 1
    b = eng.submit(prompt, max_tokens=1)  # hits chunks 0-1, computes chunks 2-3 in the same step
    when_loading(eng, b.request_id, lambda: m.cpu.delete(keys[1]))
    eng._limit = eng.stats.submitted
    while b.request_id in eng.requests:
        eng.step()
    assert the_load(eng, b.request_id).reported  # the failure was reported ...
    eng.serve(prompt)  # ... chunk 1 is computed and stored again by the next request
    eng.serve(prompt)  # this one hits chunks 0-3: chunks 2-3 must hold right KV (FakeEngine checks)
    assert_quiescent(pair)


@pytest.mark.parametrize("wait_s", [0.0, 5.0], ids=["no-wait", "wait"])
def test_idle_step_waits_for_the_async_load_it_is_waiting_on(connectors, tmp_path: Path, monkeypatch, wait_s) -> None:
    """A request waiting for an async (disk) load is the engine's only work: the idle step blocks
    (bounded) until the load ends and reports it in that same step, instead of spinning steps
    that hold the GIL the loader needs (PD decode and P2P TTFT: issue 11). Without the wait, the
    first idle step reports nothing."""
    pair = connectors(extra_config(cpu_chunks=4, disk_dir=tmp_path / "disk", disk_chunks=8))
    w = pair.worker.worker
    # The bound is generous (the wait ends when the load does), so a slow machine cannot fail it.
    monkeypatch.setattr(w, "IDLE_WAIT_S", wait_s)
    m = pair.worker.manager
    eng = FakeEngine(pair, GEOM, [], seed=1, knobs=SCRIPTED)
    prompt = tokens_of(8, 3 * CHUNK + 3)
    eng.serve(prompt)
    assert m.flush(10)
    m.cpu.clear()  # only the disk tier holds the chunks: the load is asynchronous
    real_open = w.store.open_read_many

    def slow_open(*a: Any, **kw: Any) -> Any:
        time.sleep(0.05)  # a load that takes 50 ms: many fake steps without the wait
        return real_open(*a, **kw)

    monkeypatch.setattr(w.store, "open_read_many", slow_open)
    b = eng.submit(prompt, max_tokens=1)
    steps = 0  # steps from the one that planned the async load to the one that saw it end
    deadline = time.monotonic() + 30
    while not eng.stats.async_loads and time.monotonic() < deadline:
        eng.step()
    while b.request_id not in eng.finished_recving and not any(
            rec.req_id == b.request_id for rec in eng.load_log) and time.monotonic() < deadline:
        eng.step()
        steps += 1
    while b.request_id in eng.requests and time.monotonic() < deadline:
        eng.step()
    assert b.request_id not in eng.requests
    rec = the_load(eng, b.request_id)
    assert rec.is_async and rec.reported == set()
    if wait_s == 0.0:
        assert steps >= 3, steps
    else:
        assert steps <= 1, steps
    assert_quiescent(pair)
