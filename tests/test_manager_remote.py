"""StorageManager with a remote tier: lookup, promotion, write-behind, prefetch, stats, clear.

Most tests use the shared-filesystem tier (``fs://``: no server needed) or an
in-memory tier whose calls can be blocked or failed; the Redis tests start a
throwaway ``redis-server`` and skip when it is not installed.
"""

from __future__ import annotations

import random
import time
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pytest

from conftest import CHUNK, payload_for, small_namespace
from kvtier.config import ConfigError, KVTierConfig, load_config
from kvtier.storage.lower_tiers import chunk_spec, open_storage_tiers
from kvtier.storage.manager import StorageManager
from kvtier.storage.types import WriteSkip
from kvtier.testing.memory_tier import MemoryStore, MemoryTier
from kvtier.tiers.base import ChunkWrite, LowerTier

CB = 2048


def prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(num_tokens)]


def store(mgr: StorageManager, tokens: Sequence[int], flush_each: bool = False) -> list[bytes]:
    """Store every full chunk of ``tokens`` as the connector does (open_write, fill, commit).

    ``flush_each``: wait for write-behind after each chunk (so queued writes do not
    hold the CPU slots a tiny tier needs for the next chunk).
    """
    keys = mgr.keys(tokens)
    for i, k in enumerate(keys):
        buf = mgr.open_write(k, keys[i - 1] if i else None)
        if buf is None:
            continue
        buf[:] = payload_for(k, CB)
        mgr.commit(k, keys[i - 1] if i else None)
        if flush_each:
            assert mgr.flush(10)
    return keys


def fill(mem: MemoryTier, keys: Sequence[bytes]) -> None:
    """Store ``keys``' payloads in ``mem`` directly (as another engine's write-behind would have)."""
    assert all(mem.put_many([ChunkWrite(k, None, payload_for(k, CB)) for k in keys]))


@pytest.fixture
def managers():
    made: list[StorageManager] = []

    def make(config: KVTierConfig, remote: LowerTier | None = None) -> StorageManager:
        ns = small_namespace()
        if remote is None:
            m = StorageManager(config, ns)
        else:  # a test tier in place of the configured remote (same wiring otherwise)
            local = config.model_copy(update={"remote_url": None})
            m = StorageManager(config, ns, lower=lambda pinned: [*open_storage_tiers(local, ns, pinned), remote])
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


@pytest.fixture
def fs_url(tmp_path: Path) -> str:
    root = tmp_path / "remote"
    root.mkdir()
    return f"fs://{root}"


def remote_only(make_config: Callable[..., KVTierConfig], url: str, **kw: Any) -> KVTierConfig:
    return make_config(cpu_chunks=kw.pop("cpu_chunks", 16), remote_url=url, **kw)


# -- config ---------------------------------------------------------------------------
def test_remote_config_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="remote_url"):
        load_config({"remote_url": "nosuch://x"}, environ={})
    with pytest.raises(ConfigError, match="remote_codec"):
        load_config({"remote_codec": "gzip"}, environ={})
    cfg = load_config(environ={"KVTIER_REMOTE_URL": "redis://u:hunter2@127.0.0.1:1/0", "KVTIER_REMOTE_TTL_S": "60"})
    assert cfg.remote_ttl_s == 60 and "hunter2" not in cfg.describe()
    assert load_config(environ={"KVTIER_REMOTE_URL": ""}).remote_url is None


def test_chunk_spec_matches_chunk_bytes() -> None:
    ns = small_namespace()
    spec = chunk_spec(ns)
    assert spec.dtype == "float16" and spec.shape == (2, 2, 1, 16, 16)
    spec.check(ns.chunk_bytes)


# -- lookup and load --------------------------------------------------------------------
def test_lookup_finds_remote_chunks_in_one_call(managers, make_config, fs_url) -> None:
    tokens = prompt(1, 5 * CHUNK + 3)
    a = managers(remote_only(make_config, fs_url))
    keys = store(a, tokens)
    assert a.flush(10)
    assert a.stats()["remote_put_ok"] == 5
    mem = MemoryTier()
    # A second engine (fresh CPU tier) on the same store sees every chunk as "remote".
    b = managers(remote_only(make_config, fs_url))
    res = b.lookup(tokens)
    assert res.num_tokens == 5 * CHUNK and res.tiers == ["remote"] * 5 and res.keys == keys
    # Exactly one batched existence call for all of them.
    c = managers(remote_only(make_config, fs_url), remote=mem)
    fill(mem, keys[:3])
    mem.calls.clear()
    res = c.lookup(tokens)
    assert res.tiers == ["remote"] * 3
    assert mem.calls.get("contains_many") == 1 and "get_many_into" not in mem.calls


def test_lookup_mixes_local_and_remote_and_keeps_faster_label(managers, make_config, fs_url) -> None:
    tokens = prompt(2, 4 * CHUNK + 1)
    mem = MemoryTier()
    m = managers(remote_only(make_config, fs_url), remote=mem)
    keys = m.keys(tokens)
    fill(mem, keys)
    for i in (0, 2):  # chunks 0 and 2 also in CPU
        buf = m.open_write(keys[i], None)
        buf[:] = payload_for(keys[i], CB)
        m.commit(keys[i], None)
    res = m.lookup(tokens)
    assert res.tiers == ["cpu", "remote", "cpu", "remote"]


def test_open_read_promotes_remote_chunk_into_cpu(managers, make_config, fs_url) -> None:
    tokens = prompt(3, 3 * CHUNK + 1)
    a = managers(remote_only(make_config, fs_url))
    keys = store(a, tokens)
    a.flush(10)
    b = managers(remote_only(make_config, fs_url))
    for i, k in enumerate(keys):
        h = b.open_read(k, keys[i - 1] if i else None)
        assert h is not None and h.source == "remote"
        with h:
            assert np.array_equal(h.buffer, payload_for(k, CB))
    assert b.lookup(tokens).tiers == ["cpu"] * 3
    s = b.stats()
    assert s["promoted_chunks_remote"] == 3 and s["referenced_chunks"] == 0


def test_open_read_many_uses_one_batched_get(managers, make_config, fs_url) -> None:
    mem = MemoryTier()
    m = managers(remote_only(make_config, fs_url), remote=mem)
    keys = m.keys(prompt(4, 4 * CHUNK))
    fill(mem, keys[:3])
    mem.calls.clear()
    handles = m.open_read_many([(k, None) for k in keys])
    assert [h.source if h else None for h in handles] == ["remote", "remote", "remote", None]
    assert mem.calls.get("get_many_into") == 1
    for h in handles:
        if h is not None:
            h.close()
    assert m.stats()["referenced_chunks"] == 0


def test_failed_remote_get_is_a_miss_and_leaves_nothing(managers, make_config, fs_url) -> None:
    """contains said yes, the get fails (store restarted empty): a miss, no slot, no stale existence."""
    mem = MemoryTier()
    m = managers(remote_only(make_config, fs_url), remote=mem)
    keys = m.keys(prompt(5, 2 * CHUNK + 1))
    fill(mem, keys)
    assert m.lookup_keys(keys).tiers == ["remote", "remote"]
    mem.store.clear(mem.namespace)  # restarted empty between lookup and load
    assert m.open_read(keys[0]) is None
    s = m.stats()
    assert s["remote_promote_failures"] == 1 and s["cpu_chunks"] == 0 and s["referenced_chunks"] == 0
    assert m.lookup_keys(keys).num_tokens == 0


def test_failing_remote_is_a_miss_never_an_exception(managers, make_config, fs_url) -> None:
    mem = MemoryTier()
    m = managers(remote_only(make_config, fs_url), remote=mem)
    tokens = prompt(6, 3 * CHUNK + 1)
    keys = m.keys(tokens)
    fill(mem, keys)
    mem.fail = True
    assert m.lookup(tokens).num_tokens == 0
    assert m.open_read(keys[0]) is None
    store(m, tokens)  # writes are dropped by the tier, the CPU copy serves
    assert m.flush(10)
    assert m.lookup(tokens).tiers == ["cpu"] * 3
    assert m.stats()["remote_breakers_open"] == 1
    assert m.stats()["referenced_chunks"] == 0


def test_disk_read_failure_falls_back_to_remote(managers, make_config, fs_url) -> None:
    mem = MemoryTier()
    m = managers(make_config(cpu_chunks=4, disk_chunks=8, remote_url=fs_url), remote=mem)
    keys = store(m, prompt(7, 4 * CHUNK))
    assert m.flush(10)
    assert mem.contains_many(keys) == [True] * 4
    assert m.cpu.delete(keys[-1])  # as if evicted from CPU (a leaf: the CPU tier is prefix-closed)
    keys = keys[::-1]
    path = m.disk.file_of(keys[0])  # and its disk copy broken
    path.write_bytes(b"garbage")
    h = m.open_read(keys[0])
    assert h is not None and h.source == "remote"
    with h:
        assert np.array_equal(h.buffer, payload_for(keys[0], CB))


# -- write-behind ---------------------------------------------------------------------------
def test_commit_never_waits_for_the_remote_and_drops_when_full(managers, make_config, fs_url) -> None:
    mem = MemoryTier()
    m = managers(remote_only(make_config, fs_url, cpu_chunks=32, remote_write_queue=2), remote=mem)
    mem.gate.clear()  # the remote store hangs
    keys = store(m, prompt(8, 12 * CHUNK))  # returns although nothing can be written
    s = m.stats()
    # 1 batch in flight (up to REMOTE_WRITE_BATCH items taken) + 2 waiting; the rest dropped.
    assert s["remote_dropped_writes"] > 0
    assert s["remote_queued_chunks"] + s["remote_dropped_writes"] == 12
    assert not m.flush(0.2)
    mem.gate.set()
    assert m.flush(10)
    held = mem.contains_many(keys)
    assert sum(held) == m.stats()["remote_queued_chunks"]
    assert m.stats()["referenced_chunks"] == 0  # every queued reference released


def test_every_committed_chunk_reaches_disk_and_remote(managers, make_config, fs_url) -> None:
    m = managers(make_config(cpu_chunks=16, disk_chunks=16, remote_url=fs_url))
    keys = store(m, prompt(9, 6 * CHUNK))
    assert m.flush(10)
    s = m.stats()
    assert s["disk_written_chunks"] == 6 and s["remote_put_ok"] == 6 and s["remote_write_pending"] == 0
    assert m.remote.contains_many(keys) == [True] * 6


# -- prefetch ----------------------------------------------------------------------------------
def test_prefetch_promotes_remote_chunks(managers, make_config, fs_url) -> None:
    tokens = prompt(10, 5 * CHUNK + 1)
    a = managers(remote_only(make_config, fs_url))
    store(a, tokens)
    a.flush(10)
    b = managers(remote_only(make_config, fs_url))
    assert b.prefetch(tokens) == 5
    assert b.flush(10)
    res = b.lookup(tokens)
    assert res.tiers == ["cpu"] * 5
    s = b.stats()
    assert s["prefetch_promoted_chunks"] == 5 and s["referenced_chunks"] == 0
    assert b.prefetch(tokens) == 0  # everything already in CPU


def test_prefetch_promotes_disk_chunks_and_stops_at_a_gap(managers, make_config, tmp_path) -> None:
    tokens = prompt(11, 6 * CHUNK + 1)
    cfg = make_config(cpu_chunks=2, disk_chunks=16)
    m = managers(cfg)
    keys = store(m, tokens, flush_each=True)
    assert m.lookup(tokens).tiers == ["disk"] * 4 + ["cpu"] * 2
    m.disk.delete_many([keys[2]])  # a gap: chunks after it are unreachable
    assert m.prefetch(tokens) == 2  # chunks 0, 1 (on disk); the walk stops at 2
    assert m.flush(10)
    s = m.stats()
    assert s["prefetch_promoted_chunks"] == 2
    assert m.cpu.contains(keys[0]) and m.cpu.contains(keys[1])


def test_prefetch_does_not_block_on_a_hung_remote(managers, make_config, fs_url) -> None:
    mem = MemoryTier()
    m = managers(remote_only(make_config, fs_url), remote=mem)
    tokens = prompt(12, 3 * CHUNK + 1)
    fill(mem, m.keys(tokens))
    mem.gate.clear()
    assert m.prefetch(tokens) == 3  # returns at once
    mem.gate.set()
    assert m.flush(10)
    assert m.stats()["prefetch_promoted_chunks"] == 3


# -- admin -------------------------------------------------------------------------------------
def test_clear_and_close_reach_the_remote(managers, make_config, fs_url) -> None:
    m = managers(remote_only(make_config, fs_url))
    tokens = prompt(13, 3 * CHUNK + 1)
    keys = store(m, tokens)
    m.flush(10)
    out = m.clear()
    assert out["remote"] == 3 and out["cpu"] == 3
    assert m.remote.contains_many(keys) == [False] * 3
    store(m, tokens)
    remote = m.remote
    m.close()
    assert remote.stats()["put_ok"] == 6  # close flushed write-behind first
    assert remote.contains_many(keys) == [False] * 3  # closed tier: misses
    m.close()  # idempotent


# -- real Redis ----------------------------------------------------------------------------------
@pytest.fixture
def redis_server():
    from kvtier.testing.redis_server import RedisServerProcess, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    server = RedisServerProcess()
    yield server
    server.stop()


def test_redis_remote_tier_end_to_end(managers, make_config, redis_server) -> None:
    url = redis_server.url
    tokens = prompt(14, 4 * CHUNK + 1)
    a = managers(remote_only(make_config, url, remote_timeout_s=0.5, remote_codec="shuffle-zstd"))
    keys = store(a, tokens)
    assert a.flush(10)
    b = managers(remote_only(make_config, url, remote_timeout_s=0.5))
    assert b.lookup(tokens).tiers == ["remote"] * 4
    handles = b.open_read_many([(k, None) for k in keys])
    for k, h in zip(keys, handles):
        assert h is not None and h.source == "remote"
        with h:
            assert np.array_equal(h.buffer, payload_for(k, CB))
    # Restarted empty: lookups miss, nothing raises; a dead server too.
    redis_server.kill()
    redis_server.start()
    c = managers(remote_only(make_config, url, remote_timeout_s=0.5))
    assert c.lookup(tokens).num_tokens == 0
    redis_server.kill()
    assert c.lookup(tokens).num_tokens == 0 and c.open_read(keys[0]) is None
    assert c.stats()["remote_errors"] >= 1


# -- one promotion path ---------------------------------------------------------------------------
def test_remote_hit_is_promoted_and_written_behind_to_disk(managers, make_config) -> None:
    """Lower tier -> CPU slot -> commit -> write-behind to the faster lower tiers that lack it."""
    mem = MemoryTier()
    m = managers(make_config(cpu_chunks=8, disk_chunks=8, remote_url="fs:///unused"), remote=mem)
    assert [t.kind for t in m.lower] == ["disk", "remote"]
    tokens = prompt(20, 3 * CHUNK + 1)
    keys = m.keys(tokens)
    fill(mem, keys)
    assert m.lookup(tokens).tiers == ["remote"] * 3
    handles = m.open_read_many([(k, keys[i - 1] if i else None) for i, k in enumerate(keys)])
    assert [h.source for h in handles] == ["remote"] * 3
    for h in handles:
        h.close()
    assert m.flush(10)
    assert m.disk.contains_many(keys) == [True] * 3  # the remote hits reached disk too
    assert mem.stats()["puts"] == 3  # and were not written back to the tier they came from
    assert m.cpu.clear() == 3
    assert m.lookup(tokens).tiers == ["disk"] * 3
    s = m.stats()
    assert s["promoted_chunks_remote"] == 3 and s["disk_written_chunks"] == 3 and s["referenced_chunks"] == 0
    m.check_invariants()


# -- shared Redis: namespaces and TTLs (issue 8, failing inputs 4 and 6) -----------------------------
@pytest.fixture
def shared_redis_url(redis_url: str) -> str:
    import uuid

    return f"{redis_url}?key_prefix=kvtier-test-{uuid.uuid4().hex[:10]}:"


def test_clear_removes_only_this_namespace_in_a_shared_redis(make_config, shared_redis_url) -> None:
    """Two models on one Redis each store N chunks; clearing one removes exactly N (was 2N: every
    key under the shared prefix) and the other model's chunks still load."""
    cfg = remote_only(make_config, shared_redis_url, remote_timeout_s=2.0)
    a = StorageManager(cfg, small_namespace(model="test/model-a"))
    b = StorageManager(cfg, small_namespace(model="test/model-b"))
    c = None
    try:
        tokens = prompt(21, 6 * CHUNK + 1)
        ka, kb = store(a, tokens), store(b, tokens)
        assert set(ka).isdisjoint(kb) and len(ka) == 6
        assert a.flush(10) and b.flush(10)
        out = a.clear()
        assert out["remote"] == 6 and out["cpu"] == 6
        assert a.lookup(tokens).num_tokens == 0
        c = StorageManager(cfg, small_namespace(model="test/model-b"))  # fresh CPU: remote only
        assert c.lookup(tokens).tiers == ["remote"] * 6
        for i, h in enumerate(c.open_read_many([(k, None) for k in kb])):
            assert h is not None and h.source in ("remote", "cpu")
            with h:
                assert np.array_equal(h.buffer, payload_for(kb[i], CB))
        assert b.clear()["remote"] == 6
    finally:
        for m in (a, b, c):
            if m is not None:
                m.close()


@pytest.mark.slow
def test_remote_ttl_keeps_hot_heads_alive(make_config, shared_redis_url) -> None:
    """A hot head (served from CPU, shared by later prompts) must not expire in Redis before
    its tails: writes refresh the parent's TTL, lookups refresh the whole hit chain."""
    ttl = 1.5
    cfg = remote_only(make_config, shared_redis_url + f"&ttl_s={ttl}", remote_timeout_s=2.0)
    m = StorageManager(cfg, small_namespace(model="test/model-ttl"))
    probe = None
    try:
        head = prompt(22, CHUNK)
        x = head + prompt(23, CHUNK)
        y = head + prompt(24, CHUNK)
        kx = store(m, x)
        assert m.flush(10)
        time.sleep(0.9 * ttl)
        ky = store(m, y)  # head is PRESENT (CPU): only y's tail is written, with head as parent
        assert ky[0] == kx[0]
        assert m.flush(10)
        time.sleep(0.6 * ttl)  # past the head's first expiry
        probe = StorageManager(cfg, small_namespace(model="test/model-ttl"))
        assert probe.lookup(y + [1]).tiers == ["remote"] * 2  # head and y's tail
        # Lookups (hits served from CPU) refresh the chain in Redis too.
        for _ in range(3):
            time.sleep(0.4 * ttl)
            assert m.lookup(y + [1]).tiers == ["cpu", "cpu"]
            assert m.flush(10)
        assert probe.lookup(y + [1]).tiers == ["remote"] * 2
    finally:
        for mgr in (m, probe):
            if mgr is not None:
                mgr.clear()
                mgr.close()


class _LocalMemoryTier(MemoryTier):
    """A plug-in tier on this machine that is not the disk tier: ``local`` says so, not its kind."""

    local = True


@pytest.mark.parametrize("local", [False, True])
def test_locality_follows_the_tiers_local_capability_not_its_kind(managers, make_config, fs_url, local) -> None:
    mem = _LocalMemoryTier() if local else MemoryTier()
    m = managers(remote_only(make_config, fs_url), remote=mem)
    keys = m.keys(prompt(9, 2 * CHUNK + 1))
    fill(mem, keys)
    mem.calls.clear()
    # where/contains ask local tiers only (no network round trip for a remote one)
    assert m.where(keys[0]) == ("remote" if local else None)
    assert ("contains_many" in mem.calls) is local
    # a chunk a local tier holds is not stored again; a remote-only one is (an idempotent overwrite)
    assert (m.open_write_many(keys[:1], [None])[0] is WriteSkip.PRESENT) is local


def test_a_plug_in_tier_of_kind_disk_stays_local_without_saying_so() -> None:
    class PluginDisk(MemoryTier):
        kind = "disk"

    class PluginRemoteDisk(MemoryTier):
        kind = "disk"
        local = False  # an explicit choice wins

    assert PluginDisk.local and not PluginRemoteDisk.local and not MemoryTier.local
