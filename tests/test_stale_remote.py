"""Removals a remote store makes by itself become ``"r"`` tier changes (kvtier.storage.stale_remote).

Failing inputs: a Redis that evicted (or lost on restart) chunks this instance reported stored,
or files of a shared filesystem another machine deleted, while the controller and routers kept
believing the instance holds them (they learn only from tier changes); a store that is down or
erroring taken as "absent" (the index would forget chunks the store still holds); a cold
prompt's misses flooding consumers with removals of keys never stored.
"""

from __future__ import annotations

import errno
import os
import random
import uuid
from pathlib import Path

import numpy as np
import pytest

from conftest import CHUNK, CI_REDIS, small_namespace
from kvtier.config import KVTierConfig
from kvtier.storage.manager import StorageManager
from kvtier.storage.stale_remote import StaleRemoteTracker
from kvtier.storage.tier_events import TierChange

CB = 2048
REDIS = CI_REDIS


def tokens(seed: int, n_chunks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n_chunks * CHUNK + 1)]


def store(mgr: StorageManager, toks: list[int]) -> list[bytes]:
    keys = mgr.keys(toks)
    for i, k in enumerate(keys):
        buf = mgr.open_write(k, keys[i - 1] if i else None)
        assert buf is not None
        buf[:] = np.frombuffer(k * (CB // 32), dtype=np.uint8)
        mgr.commit(k, keys[i - 1] if i else None)
    return keys


def removed(seen: list[TierChange], tier: str = "remote") -> list[bytes]:
    return [k for c in seen if c.tier == tier and c.op == "r" for k in c.keys]


def manager(remote_url: str) -> StorageManager:
    # 3 CPU slots: storing a second 3-chunk prompt pushes the first out of CPU, so its
    # lookup asks the remote store.
    cfg = KVTierConfig(chunk_size=CHUNK, cpu_capacity=3 * CB, remote_url=remote_url, remote_timeout_s=2.0)  # type: ignore[arg-type]
    return StorageManager(cfg, small_namespace())


def stored_then_pushed_out(mgr: StorageManager, seen: list[TierChange]) -> tuple[list[int], list[bytes]]:
    a = tokens(1, 3)
    ka = store(mgr, a)
    assert mgr.flush(10)
    store(mgr, tokens(2, 3))
    assert mgr.flush(10)
    assert not any(mgr.cpu.contains(k) for k in ka)
    assert mgr.lookup(a).tiers == ["remote"] * 3  # still there: nothing forgotten
    assert removed(seen) == []
    return a, ka


def test_shared_filesystem_files_deleted_elsewhere_are_reported_removed_once(tmp_path: Path) -> None:
    share = tmp_path / "share"
    mgr = manager(f"fs://{share}")
    seen: list[TierChange] = []
    mgr.subscribe(seen.append)
    try:
        a, ka = stored_then_pushed_out(mgr, seen)
        for k in ka[1:]:  # another machine cleans up two of the three chunks
            os.unlink(mgr.remote.path_of(k))  # type: ignore[union-attr]
        assert mgr.lookup(a).num_tokens == CHUNK
        assert sorted(removed(seen)) == sorted(ka[1:])
        assert mgr.stats()["remote_stale_forgotten"] == 2
        mgr.lookup(a)
        assert len(removed(seen)) == 2  # reported once, not on every lookup
        cold = tokens(3, 4)
        assert mgr.lookup(cold).num_tokens == 0
        assert len(removed(seen)) == 2  # misses of keys never stored say nothing
    finally:
        mgr.close()


def test_a_store_that_fails_is_not_taken_for_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO from a dead mount: a miss for the engine, but the chunks are not reported removed."""
    mgr = manager(f"fs://{tmp_path / 'share'}")
    seen: list[TierChange] = []
    mgr.subscribe(seen.append)
    try:
        a, ka = stored_then_pushed_out(mgr, seen)
        import kvtier.tiers.fs_tier as fs_tier

        def eio(path: object, *args: object, **kw: object) -> os.stat_result:
            raise OSError(errno.EIO, "Input/output error", str(path))

        monkeypatch.setattr(fs_tier.os, "stat", eio)
        assert mgr.lookup(a).num_tokens == 0
        assert removed(seen) == []
        monkeypatch.undo()
        assert mgr.lookup(a).tiers == ["remote"] * 3  # the store still had them
    finally:
        mgr.close()


def test_redis_keys_evicted_by_the_server_are_reported_removed(redis_url: str) -> None:
    import redis

    url = f"{redis_url}?key_prefix=kvtier-test-{uuid.uuid4().hex[:10]}:"
    mgr = manager(url)
    seen: list[TierChange] = []
    mgr.subscribe(seen.append)
    r = redis.Redis(*REDIS)
    try:
        a, ka = stored_then_pushed_out(mgr, seen)
        tier = mgr.remote
        assert tier is not None
        # The server drops the first chunk (as maxmemory eviction, TTL expiry or a restart
        # without persistence would): the whole cached prefix is gone.
        assert r.delete(tier._rkey(ka[0])) == 1  # type: ignore[attr-defined]
        assert mgr.lookup(a).num_tokens == 0
        assert removed(seen) == [ka[0]]  # only what the store answered absent
    finally:
        mgr.clear()
        mgr.close()
        r.close()


def test_unsubscribed_manager_tracks_nothing(tmp_path: Path) -> None:
    mgr = manager(f"fs://{tmp_path / 'share'}")
    seen: list[TierChange] = []
    mgr.subscribe(seen.append)
    try:
        stored_then_pushed_out(mgr, seen)
        assert mgr.reporting(mgr.remote).tracked == 6  # type: ignore[arg-type]
        mgr.unsubscribe(seen.append)
        assert mgr.reporting(mgr.remote).tracked == 0  # type: ignore[arg-type]
    finally:
        mgr.close()


def test_tracker_is_bounded_and_reports_a_key_once() -> None:
    t = StaleRemoteTracker(capacity=3)
    keys = [bytes([i]) * 32 for i in range(5)]
    t.stored(keys)
    assert len(t) == 3  # the two oldest forgotten
    assert t.missing(keys) == keys[2:]
    assert t.missing(keys) == []
    t.stored(keys[:2])
    t.removed(keys[:1])
    assert t.missing(keys) == keys[1:2]
    t.track("s", keys[:2])
    t.track("c", ())
    assert t.missing(keys) == []
    with pytest.raises(ValueError):
        StaleRemoteTracker(capacity=0)
