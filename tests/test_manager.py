"""StorageManager: lookup semantics, leases under eviction pressure, write-behind, promotion, counters."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pytest

from conftest import CHUNK, payload_for, small_namespace
from kvtier.config import KVTierConfig
from kvtier.storage.handles import CpuReadHandle
from kvtier.storage.manager import StorageManager
from kvtier.transfer.assembly import open_manager
from kvtier.storage.types import ReadHandle, WriteSkip
from kvtier.tiers.disk import HEADER_BYTES, SUFFIX

CB = 2048
MakeConfig = Callable[..., KVTierConfig]


def prompt(seed: int, num_tokens: int) -> list[int]:
    """Token ids; prompts with the same seed share their prefix."""
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(num_tokens)]


def store(mgr: StorageManager, tokens: Sequence[int], salt: str | None = None, only: set[int] | None = None) -> list[bytes]:
    """Store the full chunks of ``tokens`` the way a connector does (chunks ``only``, if given)."""
    keys = mgr.keys(tokens, salt)
    for i, k in enumerate(keys):
        if only is not None and i not in only:
            continue
        buf = mgr.open_write(k, None)
        if buf is None:
            continue
        buf[:] = payload_for(k, CB)
        mgr.commit(k, None)
    mgr.touch_chain(keys)
    return keys


def load_ok(mgr: StorageManager, key: bytes) -> str | None:
    """Open, verify and close ``key``; returns the source tier or None on a miss."""
    h = mgr.open_read(key)
    if h is None:
        return None
    with h:
        assert np.array_equal(h.buffer, payload_for(key, CB))
        return h.source


@pytest.fixture
def managers():
    made: list[StorageManager] = []

    def make(config: KVTierConfig) -> StorageManager:
        m = StorageManager(config, small_namespace())
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


# -- lookup ---------------------------------------------------------------------------


def test_lookup_never_reports_the_whole_prompt(make_config: MakeConfig, managers) -> None:
    mgr = managers(make_config(cpu_chunks=8))
    tokens = prompt(1, 3 * CHUNK)
    keys = store(mgr, tokens)
    assert len(keys) == 3 and all(mgr.contains(k) for k in keys)
    assert mgr.lookup(tokens).num_tokens == 2 * CHUNK  # exactly k chunks -> k-1
    assert mgr.lookup(tokens, keys=keys).num_tokens == 2 * CHUNK  # also with precomputed keys
    assert mgr.lookup(tokens + [5]).num_tokens == 3 * CHUNK
    assert mgr.lookup(tokens[:CHUNK]).num_tokens == 0  # one chunk exactly
    assert mgr.lookup(tokens[: CHUNK - 1]).num_tokens == 0  # shorter than a chunk
    assert mgr.lookup([]).num_tokens == 0
    r = mgr.lookup(tokens[: 2 * CHUNK + 7])
    assert r.num_tokens == 2 * CHUNK and r.keys == keys[:2] and r.tiers == ["cpu", "cpu"]


def test_longest_prefix_stops_at_a_gap(make_config: MakeConfig, managers) -> None:
    mgr = managers(make_config(cpu_chunks=8))
    tokens = prompt(2, 5 * CHUNK + 1)
    keys = store(mgr, tokens, only={0, 1, 3, 4})
    assert mgr.contains(keys[3]) and not mgr.contains(keys[2])
    r = mgr.lookup(tokens)
    assert r.num_tokens == 2 * CHUNK and r.keys == keys[:2]
    assert mgr.lookup(prompt(99, 5 * CHUNK + 1)).num_tokens == 0  # another prompt


def test_salt_and_divergence_are_misses(make_config: MakeConfig, managers) -> None:
    mgr = managers(make_config(cpu_chunks=8))
    tokens = prompt(3, 4 * CHUNK)
    store(mgr, tokens)
    assert mgr.lookup(tokens, cache_salt="tenant-b").num_tokens == 0
    forked = tokens[: 2 * CHUNK] + prompt(4, 2 * CHUNK)
    assert mgr.lookup(forked).num_tokens == 2 * CHUNK
    salted = store(mgr, tokens, salt="tenant-b")
    assert set(salted).isdisjoint(mgr.keys(tokens))
    assert mgr.lookup(tokens + [1], cache_salt="tenant-b").num_tokens == 4 * CHUNK


def test_chain_tail_is_evicted_before_its_head(make_config: MakeConfig, managers) -> None:
    mgr = managers(make_config(cpu_chunks=4))
    a = prompt(5, 4 * CHUNK)
    keys = store(mgr, a)
    store(mgr, prompt(6, CHUNK))  # one eviction
    assert not mgr.contains(keys[3]) and all(mgr.contains(k) for k in keys[:3])
    assert mgr.lookup(a + [1]).num_tokens == 3 * CHUNK


# -- leases ---------------------------------------------------------------------------


def test_lease_pins_survive_eviction_pressure(make_config: MakeConfig, managers) -> None:
    mgr = managers(make_config(cpu_chunks=4))
    a = prompt(10, 3 * CHUNK)
    keys = store(mgr, a)
    r = mgr.lookup(a + [1], lease_owner="req-a")
    assert r.num_tokens == 3 * CHUNK
    assert mgr.stats()["leases"] == 1 and mgr.stats()["pinned_chunks"] == 3
    for seed in range(100, 110):  # ten more chunks through a tier with one free slot
        store(mgr, prompt(seed, CHUNK))
    s = mgr.stats()
    assert s["cpu_evicted_chunks"] >= 9 and s["cpu_used_bytes"] <= s["cpu_capacity_bytes"]
    for k in keys:
        assert load_ok(mgr, k) == "cpu"
    mgr.release("req-a")
    assert mgr.stats()["leases"] == 0 and mgr.stats()["pinned_chunks"] == 0
    for seed in range(200, 204):
        store(mgr, prompt(seed, CHUNK))
    assert not any(mgr.contains(k) for k in keys)  # unpinned, they go


def test_everything_leased_skips_stores(make_config: MakeConfig, managers) -> None:
    mgr = managers(make_config(cpu_chunks=2))
    a = prompt(11, 2 * CHUNK)
    keys = store(mgr, a)
    mgr.lookup(a + [1], lease_owner="r")
    other = mgr.keys(prompt(12, CHUNK))[0]
    assert mgr.open_write(other, None) is None
    assert mgr.stats()["store_skipped"] == 1
    assert all(mgr.contains(k) for k in keys)
    mgr.release("r")
    assert mgr.open_write(other, None) is not None
    mgr.abort(other)
    assert not mgr.contains(other)


def test_release_and_replace_leases(make_config: MakeConfig, managers) -> None:
    mgr = managers(make_config(cpu_chunks=8))
    a, b = prompt(20, 2 * CHUNK), prompt(21, 3 * CHUNK)
    ka, kb = store(mgr, a), store(mgr, b)
    mgr.lookup(a)  # no owner: no lease
    assert mgr.stats()["leases"] == 0
    mgr.lookup(prompt(22, 3 * CHUNK), lease_owner="r1")  # no hit: nothing to lease
    assert mgr.stats()["leases"] == 0
    mgr.lookup(a + [1], lease_owner="r1")
    mgr.lookup(b + [1], lease_owner="r2")
    assert mgr.stats()["leases"] == 2 and mgr.stats()["pinned_chunks"] == 5
    mgr.lookup(b + [1], lease_owner="r1")  # r1 asks again, for b: replaces its lease
    assert mgr.stats()["leases"] == 2 and mgr.stats()["pinned_chunks"] == 3
    assert not any(mgr.leases.is_pinned(k) for k in ka)
    mgr.release("r1")
    assert all(mgr.leases.is_pinned(k) for k in kb)
    mgr.release("r2")
    mgr.release("r2")  # releasing twice is harmless
    assert mgr.stats()["leases"] == 0 and mgr.stats()["pinned_chunks"] == 0


# -- write-behind, promotion, restart --------------------------------------------------


def test_write_behind_reaches_disk_after_flush(make_config: MakeConfig, managers) -> None:
    cfg = make_config(cpu_chunks=8, disk_chunks=16)
    mgr = managers(cfg)
    keys = store(mgr, prompt(30, 4 * CHUNK))
    assert mgr.flush(30)
    assert mgr.disk is not None
    for k in keys:
        assert mgr.disk.contains(k)
        f = Path(cfg.disk_path) / k.hex()[:2] / (k.hex() + SUFFIX)
        assert f.stat().st_size == HEADER_BYTES + CB
    s = mgr.stats()
    assert s["disk_written_chunks"] == 4 and s["disk_chunks"] == 4
    assert s["referenced_chunks"] == 0  # write-behind dropped its references


def test_open_read_promotes_disk_hits(make_config: MakeConfig, managers) -> None:
    mgr = managers(make_config(cpu_chunks=8, disk_chunks=16))
    tokens = prompt(31, 3 * CHUNK)
    keys = store(mgr, tokens)
    mgr.flush(30)
    assert mgr.cpu.clear() == 3
    r = mgr.lookup(tokens + [1], lease_owner="r")
    assert r.num_tokens == 3 * CHUNK and r.tiers == ["disk"] * 3
    for k in keys:
        assert mgr.where(k) == "disk"
        assert load_ok(mgr, k) == "disk"
        assert mgr.where(k) == "cpu"
        assert load_ok(mgr, k) == "cpu"
    mgr.release("r")
    s = mgr.stats()
    assert s["promoted_chunks"] == 3 and s["referenced_chunks"] == 0 and s["cpu_chunks"] == 3


def test_restart_serves_from_disk(make_config: MakeConfig, tmp_path: Path) -> None:
    cfg = make_config(cpu_chunks=8, disk_chunks=16)
    tokens = prompt(32, 4 * CHUNK + 3)
    first = StorageManager(cfg, small_namespace())
    keys = store(first, tokens)
    first.close()  # flushes write-behind and releases the directory
    second = StorageManager(cfg, small_namespace())
    try:
        r = second.lookup(tokens)
        assert r.num_tokens == 4 * CHUNK and r.tiers == ["disk"] * 4
        assert all(load_ok(second, k) == "disk" for k in keys)
        assert second.open_write(keys[0], None) is None  # already stored: nothing rewritten
        second.flush(30)
        assert second.stats()["disk_written_chunks"] == 0
    finally:
        second.close()


def test_corrupt_disk_chunk_is_a_miss_on_open_read(make_config: MakeConfig, managers) -> None:
    cfg = make_config(cpu_chunks=8, disk_chunks=16)
    mgr = managers(cfg)
    keys = store(mgr, prompt(33, 2 * CHUNK))
    mgr.flush(30)
    mgr.cpu.clear()
    f = Path(cfg.disk_path) / keys[1].hex()[:2] / (keys[1].hex() + SUFFIX)
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    assert mgr.open_read(keys[1]) is None
    assert mgr.where(keys[1]) is None
    s = mgr.stats()
    assert s["cpu_chunks"] == 0 and s["referenced_chunks"] == 0 and s["disk_corrupt_reads"] == 1
    assert load_ok(mgr, keys[0]) == "disk"


def test_open_read_and_open_write_edge_cases(make_config: MakeConfig, managers) -> None:
    mgr = managers(make_config(cpu_chunks=4, disk_chunks=8))
    keys = store(mgr, prompt(34, 2 * CHUNK))
    assert mgr.open_read(b"\x00" * 32) is None
    assert mgr.open_write(keys[0], None) is None  # in CPU
    mgr.flush(30)
    mgr.cpu.clear()
    assert mgr.open_write(keys[0], None) is None  # on disk only
    h = mgr.open_read(keys[0])
    assert isinstance(h, CpuReadHandle) and h.source == "disk"
    h.close()
    h.close()  # idempotent
    assert mgr.stats()["referenced_chunks"] == 0


def test_clear_empties_every_tier(make_config: MakeConfig, managers) -> None:
    mgr = managers(make_config(cpu_chunks=8, disk_chunks=16))
    tokens = prompt(35, 3 * CHUNK)
    store(mgr, tokens)  # no flush: write-behind may still hold the CPU chunks
    out = mgr.clear()
    assert out == {"cpu": 3, "disk": 3}
    assert mgr.lookup(tokens + [1]).num_tokens == 0
    s = mgr.stats()
    assert s["cpu_chunks"] == 0 and s["disk_chunks"] == 0 and s["disk_used_bytes"] == 0


# -- counters --------------------------------------------------------------------------


def test_counters(make_config: MakeConfig, managers) -> None:
    mgr = managers(make_config(cpu_chunks=3))
    a = prompt(40, 3 * CHUNK)
    store(mgr, a)
    s = mgr.stats()
    assert s["stored_chunks"] == 3 and s["stored_bytes"] == 3 * CB and s["lookups"] == 0
    mgr.lookup(a + [1])
    mgr.lookup(a[:10])
    s = mgr.stats()
    assert s["lookups"] == 2 and s["lookup_tokens"] == 3 * CHUNK + 1 + 10
    assert not hasattr(mgr, "record_load") and "loaded_chunks" not in s  # request accounting: the connector's
    store(mgr, prompt(41, 2 * CHUNK))
    s = mgr.stats()
    assert s["stored_chunks"] == 5 and s["cpu_evicted_chunks"] == 2 and s["cpu_evicted_bytes"] == 2 * CB
    store(mgr, prompt(41, 2 * CHUNK))  # already stored: not counted again
    assert mgr.stats()["stored_chunks"] == 5


def test_namespace_must_match_config(make_config: MakeConfig) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        StorageManager(make_config(chunk_size=64), small_namespace())


# -- random sequences leave nothing behind ------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_random_sequences_leave_no_leases_or_references(make_config: MakeConfig, managers, seed: int) -> None:
    rng = random.Random(seed)
    mgr = managers(make_config(cpu_chunks=6, disk_chunks=10))
    # prompts share prefixes: family f, length in chunks n, plus a tail
    prompts = [prompt(f, n * CHUNK + t) for f in range(3) for n in (1, 2, 4) for t in (0, 5)]
    owners = [f"req-{i}" for i in range(4)]
    leased: dict[str, list[bytes]] = {}
    handles: list[ReadHandle] = []
    for _ in range(150):
        op = rng.random()
        tokens = rng.choice(prompts)
        owner = rng.choice(owners)
        if op < 0.3:
            store(mgr, tokens, salt=rng.choice([None, "s"]))
        elif op < 0.55:
            r = mgr.lookup(tokens, lease_owner=owner)
            assert r.num_tokens <= max(0, len(tokens) - 1)
            leased[owner] = r.keys
        elif op < 0.75 and leased.get(owner):
            h = mgr.open_read(rng.choice(leased[owner]))
            if h is not None:
                handles.append(h)
        elif op < 0.9:
            mgr.release(owner)
            leased.pop(owner, None)
        elif handles:
            handles.pop(rng.randrange(len(handles))).close()
        # a leased chunk stays in some tier until its lease ends
        for keys in leased.values():
            assert all(mgr.contains(k) for k in keys)
        s = mgr.stats()
        assert s["cpu_used_bytes"] <= s["cpu_capacity_bytes"]
        assert s["disk_used_bytes"] <= s["disk_capacity_bytes"]
        mgr.check_invariants()
    for h in handles:
        h.close()
    for o in owners:
        mgr.release(o)
    assert mgr.flush(30)
    s = mgr.stats()
    assert s["leases"] == 0 and s["pinned_chunks"] == 0 and s["referenced_chunks"] == 0


# -- open_write_many: why a key gets no buffer (issue 8, failing input 5) -------------------


def test_open_write_many_says_why(make_config: MakeConfig, managers) -> None:
    """A chunk reserved by another writer is IN_FLIGHT, not a reason to drop the chain.

    Engine A holds an uncommitted reservation of a shared head; engine B stores
    head + 2 unique chunks: B gets IN_FLIGHT for the head and buffers for the
    rest; once A commits, a third client finds all 3 chunks.
    """
    mgr = managers(make_config(cpu_chunks=8, disk_chunks=16))
    tokens = prompt(50, 3 * CHUNK + 1)
    head, u1, u2 = mgr.keys(tokens)
    a_buf = mgr.open_write(head, None)  # engine A: reserved, not committed
    assert a_buf is not None
    got = mgr.open_write_many([head, u1, u2], [None, head, u1])  # engine B
    assert got[0] is WriteSkip.IN_FLIGHT
    assert isinstance(got[1], np.ndarray) and isinstance(got[2], np.ndarray)
    for key, parent, buf in ((u1, head, got[1]), (u2, u1, got[2])):
        buf[:] = payload_for(key, CB)
        mgr.commit(key, parent)
    a_buf[:] = payload_for(head, CB)
    mgr.commit(head, None)
    r = mgr.lookup(tokens)
    assert r.num_tokens == 3 * CHUNK and r.keys == [head, u1, u2]
    # now PRESENT, in CPU and (after write-behind) on disk only
    assert mgr.open_write_many([head, u1], [None, head]) == [WriteSkip.PRESENT, WriteSkip.PRESENT]
    assert mgr.flush(30)
    mgr.cpu.clear()
    assert mgr.open_write_many([head], [None]) == [WriteSkip.PRESENT]
    mgr.check_invariants()


def test_open_write_many_no_room(make_config: MakeConfig, managers) -> None:
    mgr = managers(make_config(cpu_chunks=2))
    a = prompt(51, 2 * CHUNK)
    store(mgr, a)
    mgr.lookup(a + [1], lease_owner="r")  # both slots leased
    (other,) = mgr.keys(prompt(52, CHUNK))
    assert mgr.open_write_many([other], [None]) == [WriteSkip.NO_ROOM]
    assert mgr.stats()["store_skipped"] == 1
    mgr.release("r")
    (buf,) = mgr.open_write_many([other], [None])
    assert isinstance(buf, np.ndarray)
    mgr.abort(other)
    mgr.check_invariants()


def test_lower_tier_views(make_config: MakeConfig, managers) -> None:
    mgr = managers(make_config(cpu_chunks=2, disk_chunks=4))
    assert [t.kind for t in mgr.lower] == ["disk"] and mgr.disk is mgr.lower[0] and mgr.remote is None
    with pytest.raises(AttributeError):
        mgr.disk = None  # type: ignore[misc]
    plain = managers(make_config(cpu_chunks=2))
    assert plain.lower == [] and plain.disk is None and plain.remote is None
    assert plain.clear() == {"cpu": 0}



def test_storing_a_chain_one_chunk_per_step_never_orphans_it(make_config: MakeConfig, managers) -> None:
    """Issue 8, failing input 4 (CPU part): a connector stores a prompt's chunks in separate
    steps; making room for chunk i+1 must not evict chunk i (its parent), whatever the capacity."""
    for cpu_chunks in (1, 2, 3):
        mgr = managers(make_config(cpu_chunks=cpu_chunks))
        tokens = prompt(70 + cpu_chunks, 5 * CHUNK + 1)
        keys = mgr.keys(tokens)
        for i, k in enumerate(keys):
            parent = keys[i - 1] if i else None
            (buf,) = mgr.open_write_many([k], [parent])  # one chunk per engine step
            if not isinstance(buf, np.ndarray):
                assert buf is WriteSkip.NO_ROOM
                break
            buf[:] = payload_for(k, CB)
            mgr.commit(k, parent)
            mgr.check_invariants()
        held = [mgr.contains(k) for k in keys]
        assert held == [True] * cpu_chunks + [False] * (len(keys) - cpu_chunks), held
        assert mgr.lookup(tokens).num_tokens == cpu_chunks * CHUNK
    with pytest.raises(ValueError, match="parents"):
        mgr.open_write_many(keys[:2], [None])


def _memfds() -> int:
    import os

    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "memfd:kvtier-cpu" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


def test_close_frees_a_shared_cpu_tier_at_once_not_at_the_next_gc(tmp_path: Path) -> None:
    """An shm:// peer listener puts the CPU tier in a shared segment (a memfd and its mapping). close()
    must give both back then, though the manager sits in reference cycles: stop 32's hostile trial
    saw the mapping (and the CPU tier's whole capacity) live on until gc.collect()."""
    import gc

    gc.collect()
    gc.disable()  # no collection may do close()'s work for it
    try:
        before = _memfds()
        cfg = KVTierConfig(chunk_size=CHUNK, cpu_capacity=64 * small_namespace().chunk_bytes,
                           peer_listen=f"shm://{tmp_path}/peer.sock")
        mgr = open_manager(cfg, small_namespace())
        assert mgr.cpu_segment is not None and _memfds() > before
        store(mgr, prompt(1, 4 * CHUNK))
        keys = mgr.lookup(prompt(1, 4 * CHUNK)).keys
        assert keys
        mgr.close()
        assert _memfds() == before
        with pytest.raises(IndexError):
            mgr.cpu.pool.view(0)  # nothing reads freed memory
        # Every call after close is a miss, never an error from freed memory (the hostile trial's input).
        assert mgr.lookup(prompt(1, 4 * CHUNK)).num_tokens == 0
        assert mgr.open_read(keys[0]) is None and mgr.open_read_many([(k, None) for k in keys]) == [None] * len(keys)
        assert mgr.open_write(b"k" * 32, None) is None
        assert mgr.open_write_many([b"k" * 32], [None]) == [WriteSkip.NO_ROOM]
    finally:
        gc.enable()
