"""Mooncake tier faults on throwaway masters: a master killed and restarted mid-load, a hung
master, one that accepts and never answers, the segment owner exiting, a full store, values
larger than the reader's buffer, a corrupt value, read leases, removals reported to the controller.

Each test starts its own ``mooncake_master`` on free loopback ports (never the CI one) and
kills it in teardown. Bounded-wait checks compare each call's duration with the configured
timeout plus a generous slack: they check that no call hangs, not how fast calls are.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from conftest import free_port, wait_until
from kvtier.testing import bf16_payload
from kvtier.testing.mooncake_master import (
    MooncakeMasterProcess,
    SegmentOwnerProcess,
    SilentServer,
    mooncake_missing,
)
from kvtier.tiers.base import ChunkWrite

pytestmark = [
    pytest.mark.mooncake,
    pytest.mark.skipif(mooncake_missing() is not None, reason=mooncake_missing() or ""),
]

TIMEOUT_S = 0.5
SLACK_S = 1.5  # scheduling noise on a shared 2-core machine; a hang would be unbounded
VALUE = 1 << 20


def _tier(url: str, **kw):
    from kvtier.tiers.mooncake_tier import MooncakeTier

    opts = dict(timeout_s=TIMEOUT_S, breaker_failures=2, breaker_backoff_s=0.2, breaker_max_backoff_s=1.0,
                segment_bytes=64 << 20, setup_timeout_s=10.0)
    opts.update(kw)
    return MooncakeTier(url, **opts)


def _items(n: int, seed: int = 0, size: int = VALUE):
    return [os.urandom(32) for _ in range(n)], [bf16_payload(size, seed + i) for i in range(n)]


def _writes(keys, values, parents=None):
    parents = parents or [None] * len(keys)
    return [ChunkWrite(k, p, v) for k, p, v in zip(keys, parents, values)]


def _timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def _open(tier) -> None:
    """Wait until the tier's client is open (the first calls of a fresh tier may miss)."""
    wait_until(lambda: tier.stats()["client_open"], 30.0)


@pytest.fixture
def master():
    m = MooncakeMasterProcess(extra_args=("--client_ttl=2",))
    try:
        yield m
    finally:
        m.stop()


def test_master_listens_on_loopback_only(master):
    addrs = master.listening()
    assert addrs and all(a == "127.0.0.1" for a, _ in addrs), addrs


@pytest.mark.slow  # a master killed and restarted: ~10 s on 2 cores
def test_master_killed_mid_load_then_restarted(master):
    tier = _tier(master.url)
    try:
        _open(tier)
        keys, values = _items(4)
        assert all(tier.put_many(_writes(keys, values)))
        outs = [np.zeros_like(v) for v in values]
        durations: list[float] = []
        results: list[list[bool]] = []
        stop = threading.Event()

        def workload() -> None:
            while not stop.is_set():
                r, dt = _timed(tier.get_many_into, list(zip(keys, outs)))
                _, dt2 = _timed(tier.put_many, _writes(keys[:1], values[:1]))
                results.append(r)
                durations.append(max(dt, dt2))

        t = threading.Thread(target=workload)
        t.start()
        wait_until(lambda: len(results) >= 3, 30.0)
        master.kill()
        n_at_kill = len(results)
        wait_until(lambda: tier.stats()["breaker"] == "open", 30.0)
        wait_until(lambda: len(results) >= n_at_kill + 10, 30.0)
        master.start()  # restarted, empty
        wait_until(lambda: tier.put_many(_writes(keys, values)) == [True] * 4, 30.0)
        stop.set()
        t.join()
        # The grace a started transfer gets applies only after the master answered.
        bound = TIMEOUT_S + tier.options.transfer_grace_s + SLACK_S
        assert max(durations) < bound, f"a call took {max(durations):.2f} s"
        assert all(r == [True] * 4 for r in results[:3])
        assert all(r == [False] * 4 for r in results[n_at_kill + 1 : n_at_kill + 10])
        assert tier.get_many_into(list(zip(keys, outs))) == [True] * 4
        assert all(np.array_equal(o, v) for o, v in zip(outs, values))
        s = tier.stats()
        assert s["breaker_trips"] >= 1 and s["skipped_calls"] > 0 and s["errors"] >= 1
        assert s["breaker"] == "closed" and s["get_corrupt"] == 0
    finally:
        tier.close()


@pytest.mark.slow
def test_restarted_master_answers_absent(master):
    """A master restart loses every key: existence is answered (not a failure) and absent."""
    tier = _tier(master.url)
    try:
        _open(tier)
        keys, values = _items(3)
        assert all(tier.put_many(_writes(keys, values)))
        master.kill()
        master.start()
        wait_until(lambda: tier.contains_many_known(keys) == ([False] * 3, [True] * 3), 30.0)
        before = tier.stats()
        assert tier.get_many_into([(k, np.zeros(VALUE, np.uint8)) for k in keys]) == [False] * 3
        after = tier.stats()
        assert after["get_misses"] - before["get_misses"] == 3 and after["get_corrupt"] == 0
    finally:
        tier.close()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["paused", "silent"])
def test_master_that_never_answers_never_stalls_a_call(master, how):
    """A master that accepts connections and answers nothing: every call returns a miss
    within timeout_s (plus slack), also opening the tier and closing it."""
    silent = SilentServer() if how == "silent" else None
    url = silent.url if silent else master.url
    t0 = time.monotonic()
    tier = _tier(url)
    try:
        if silent is None:
            _open(tier)
            keys, values = _items(2)
            assert all(tier.put_many(_writes(keys, values)))
            master.pause()
        else:
            keys, values = _items(2)
            assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S  # opening does not wait for the master
        outs = [np.zeros_like(v) for v in values]
        for _ in range(3):
            for op, args, miss in [
                (tier.contains_many, (keys,), [False, False]),
                (tier.get_many_into, (list(zip(keys, outs)),), [False, False]),
                (tier.put_many, (_writes(keys, values),), [False, False]),
                (tier.delete_many, (keys,), 0),
                (tier.clear, (), 0),
            ]:
                out, dt = _timed(op, *args)
                assert out == miss, op.__name__
                assert dt < TIMEOUT_S + SLACK_S, f"{op.__name__} waited {dt:.2f} s"
        assert tier.check_store()  # reports the master as not answering
        s = tier.stats()
        assert s["put_failed"] >= 6 and s["get_hits"] == 0
        if silent is not None:
            assert silent.accepted >= 1 and not s["client_open"]
    finally:
        _, dt = _timed(tier.close)
        assert dt < TIMEOUT_S + SLACK_S
        if silent is not None:
            silent.stop()
        else:
            master.resume()


@pytest.mark.slow
def test_segment_owner_exits(master):
    """The chunks live in another process's segment; when it exits they are gone: misses,
    answered absent once the master drops the segment, and writes go on in a new owner."""
    owner = SegmentOwnerProcess(master.address, 64 << 20)
    tier = _tier(master.url, segment_bytes=0)
    try:
        _open(tier)
        keys, values = _items(3)
        assert all(tier.put_many(_writes(keys, values)))
        outs = [np.zeros_like(v) for v in values]
        assert tier.get_many_into(list(zip(keys, outs))) == [True] * 3
        owner.kill()
        for _ in range(3):
            got, dt = _timed(tier.get_many_into, list(zip(keys, outs)))
            assert got == [False] * 3 and dt < TIMEOUT_S + tier.options.transfer_grace_s + SLACK_S
        # The master unmounts the dead owner's segment after client_ttl (2 s here).
        wait_until(lambda: tier.contains_many_known(keys) == ([False] * 3, [True] * 3), 60.0)
        assert tier.stats()["get_corrupt"] == 0
        with SegmentOwnerProcess(master.address, 64 << 20):
            wait_until(lambda: tier.put_many(_writes(keys, values)) == [True] * 3, 30.0)
            assert tier.get_many_into(list(zip(keys, outs))) == [True] * 3
            assert all(np.array_equal(o, v) for o, v in zip(outs, values))
    finally:
        tier.close()
        owner.stop()


@pytest.mark.slow
def test_full_store_drops_writes_without_opening_the_breaker(master):
    tier = _tier(master.url, segment_bytes=16 << 20, breaker_failures=1)
    try:
        _open(tier)
        keys, values = _items(32)
        out = tier.put_many(_writes(keys, values))  # 32 MiB never fit in 16 MiB
        assert not all(out)
        assert tier.put(os.urandom(32), bf16_payload(20 << 20, 1)) is False  # larger than the pool: -200 alone
        s = tier.stats()
        assert s["put_failed"] == out.count(False) + 1 and s["errors"] == 0
        assert s["breaker"] == "closed"  # "no room" (-200) is an answer, not a dead master
        found = tier.contains_many(keys)
        assert all(f <= o for f, o in zip(found, out))  # nothing not written is reported present
        dst = [np.zeros_like(v) for v in values]
        got = tier.get_many_into(list(zip(keys, dst)))
        for g, o, v in zip(got, dst, values):
            assert not g or np.array_equal(o, v)
    finally:
        tier.close()


@pytest.mark.slow
def test_values_larger_than_the_readers_buffer_are_misses(master):
    """A stored value larger than the destination, and one above max_value_bytes: misses,
    never an exception or a write past the buffer; a sound record of another size is kept."""
    tier = _tier(master.url, max_value_bytes=3 << 20)
    try:
        _open(tier)
        (small, big, huge), values = _items(3)
        assert tier.put(small, values[0])
        assert tier.put(big, bf16_payload(2 * VALUE, 7))
        assert tier.put(huge, bf16_payload(4 * VALUE, 8))  # writes are not bounded by the read bound
        guard = np.full(3 * VALUE, 0xAB, np.uint8)
        out = guard[VALUE : 2 * VALUE]  # a buffer with neighbours that must stay untouched
        for key in (big, huge):
            ok, dt = _timed(tier.get_into, key, out)
            assert ok is False and dt < TIMEOUT_S + SLACK_S
        assert (guard[:VALUE] == 0xAB).all() and (guard[2 * VALUE :] == 0xAB).all()
        assert tier.contains_many([big, huge]) == [True, True]  # kept: a reader of that size may use them
        s = tier.stats()
        assert s["get_corrupt"] == 0 and s["oversize_skipped"] == 1  # the huge one was not even read
        assert tier.get_into(small, out) and np.array_equal(out, values[0])
    finally:
        tier.close()


def _raw_client(master):
    """A plain Mooncake client (no segment) to read and write values behind the tier's back."""
    from kvtier.tiers.mooncake_calls import set_client_environment

    set_client_environment("127.0.0.1")
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.address) == 0
    return store


@pytest.mark.slow
@pytest.mark.parametrize("where", ["body", "header"])
def test_corrupt_value_is_a_miss_and_removed(master, where):
    tier = _tier(master.url)
    raw = _raw_client(master)
    try:
        _open(tier)
        (key,), (value,) = _items(1)
        assert tier.put(key, value)
        mk = tier.mooncake_key(key)
        data = bytearray(raw.get(mk))
        assert len(data) == 4096 + VALUE
        data[4096 + VALUE // 2 if where == "body" else 40] ^= 0x10  # one flipped bit
        raw.remove(mk, True)
        assert raw.put(mk, bytes(data)) == 0
        out = np.zeros(VALUE, np.uint8)
        assert tier.get_into(key, out) is False
        s = tier.stats()
        assert s["get_corrupt"] == 1 and s["get_hits"] == 0
        assert tier.contains_many([key]) == [False]  # removed, so nobody reads it again
        assert tier.put(key, value) and tier.get_into(key, out) and np.array_equal(out, value)
    finally:
        raw.close()
        tier.close()


@pytest.mark.slow
def test_reads_take_leases_that_deletes_override(master):
    """Mooncake leases a key for 10 s on every read and refuses plain removal inside it:
    the tier's deletes and clear work anyway; a write of a key being read keeps the record
    its reader reads (the same chunk), and replaces a key nobody reads."""
    tier = _tier(master.url)
    try:
        _open(tier)
        keys, values = _items(4)
        assert all(tier.put_many(_writes(keys[:3], values[:3])))
        assert tier.contains_many(keys[:3]) == [True] * 3  # leases taken
        assert tier.get_into(keys[0], np.zeros(VALUE, np.uint8))
        assert tier.delete_many(keys[:1]) == 1
        new = bf16_payload(VALUE, 99)
        assert tier.put(keys[1], new)  # counted stored: the leased record holds this chunk
        out = np.zeros(VALUE, np.uint8)
        assert tier.get_into(keys[1], out) and np.array_equal(out, values[1])  # not yanked from its reader
        assert tier.put(keys[3], values[3]) and tier.put(keys[3], new)  # nobody reads it: replaced
        assert tier.get_into(keys[3], out) and np.array_equal(out, new)
        assert tier.clear() == 3
        assert tier.contains_many(keys) == [False] * 4
    finally:
        tier.close()


@pytest.mark.slow
def test_storage_manager_registers_cpu_memory_and_reports_store_removals(master):
    """Through the storage manager: the CPU tier's memory is registered with the client, and
    chunks the store lost (a master restart) are reported removed to listeners (the controller)."""
    from conftest import CHUNK, small_namespace
    from kvtier.config import KVTierConfig
    from kvtier.storage.manager import StorageManager

    cb = 2048
    cfg = KVTierConfig(chunk_size=CHUNK, cpu_capacity=3 * cb, remote_url=master.url + "?segment_bytes=16MiB",
                       remote_timeout_s=2.0)  # type: ignore[arg-type]
    mgr = StorageManager(cfg, small_namespace())
    seen = []
    mgr.subscribe(seen.append)
    try:
        tier = mgr.remote
        assert tier is not None and tier.name == "mooncake"
        _open(tier)
        import random

        rng = random.Random(1)
        toks = [rng.randrange(50_000) for _ in range(3 * CHUNK + 1)]
        keys = mgr.keys(toks)
        for i, k in enumerate(keys):
            buf = mgr.open_write(k, keys[i - 1] if i else None)
            assert buf is not None
            buf[:] = np.frombuffer(k * (cb // 32), dtype=np.uint8)
            mgr.commit(k, keys[i - 1] if i else None)
        assert mgr.flush(20)
        assert tier._registered, "the CPU tier's memory was not registered"
        assert tier.contains_many(keys) == [True] * 3
        mgr.cpu.clear()
        assert mgr.lookup(toks).num_tokens == 3 * CHUNK  # served by the remote tier
        master.kill()
        master.start()
        wait_until(lambda: tier.contains_many_known(keys)[1] == [True] * 3, 30.0)
        mgr.cpu.clear()
        assert mgr.lookup(toks).num_tokens == 0
        gone = {k for c in seen if c.tier == "remote" and c.op == "r" for k in c.keys}
        assert keys[0] in gone
    finally:
        mgr.close()


@pytest.mark.slow
def test_bench_remote_measures_the_tier_and_the_raw_client_side_by_side(master):
    """``kvtier bench remote --url mooncake://``: both ratios, from samples of both sides."""
    from kvtier.bench import remote_mooncake

    r = remote_mooncake.measure(master.url, num_chunks=2, reps=1)
    for name in ("mooncake_put_ratio", "mooncake_get_ratio", "put_gbps", "raw_put_gbps", "get_gbps", "raw_get_gbps"):
        assert r[name] > 0, name
    assert len(r["put_samples_s"]["kvtier"]) == len(r["put_samples_s"]["raw"]) == 1


def test_bench_remote_refuses_a_mooncake_url_without_a_master():
    from kvtier.bench.common import BenchUsageError
    from kvtier.bench.remote import run_remote

    with pytest.raises(BenchUsageError, match="no Mooncake master"):
        run_remote(f"mooncake://127.0.0.1:{free_port()}")
    with pytest.raises(BenchUsageError, match="segmnt"):
        run_remote("mooncake://127.0.0.1:1?segmnt=1")
