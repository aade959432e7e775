"""InstanceOps: every operation against every tier kind (cpu, disk, fs, redis), checked in the tier's real state."""

from __future__ import annotations

import os
import random
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from conftest import CHUNK, CI_REDIS, require_redis, small_namespace
from kvtier.config import KVTierConfig
from kvtier.serde.record import HEADER_BYTES, decode_header
from kvtier.storage.instance_ops import InstanceOps, OpError
from kvtier.storage.manager import StorageManager

CB = 2048
REDIS = CI_REDIS


def payload(key: bytes) -> np.ndarray:
    """A float16-valued payload (normal values, so lossy codecs have something to quantize)."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.standard_normal(CB // 2).astype(np.float16).view(np.uint8).copy()


def prompt(seed: int, n_chunks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n_chunks * CHUNK)]


def store(mgr: StorageManager, seed: int, n_chunks: int) -> list[bytes]:
    keys = mgr.keys(prompt(seed, n_chunks))
    for i, k in enumerate(keys):
        buf = mgr.open_write(k, keys[i - 1] if i else None)
        if buf is None:
            continue
        buf[:] = payload(k)
        mgr.commit(k, keys[i - 1] if i else None)
    assert mgr.flush(10)
    return keys


class Env:
    """A manager with cpu + disk + a remote tier (fs or redis), and raw views of the remote store."""

    def __init__(self, mgr: StorageManager, remote_kind: str, redis_prefix: bytes | None = None):
        self.mgr = mgr
        self.ops = InstanceOps(mgr)
        self.remote_kind = remote_kind
        self.redis_prefix = redis_prefix

    def raw_remote_keys(self) -> set[bytes]:
        """Chunk keys in the remote store, listed without the tier's own code."""
        tier = self.mgr.remote
        assert tier is not None
        if self.remote_kind == "fs":
            return {bytes.fromhex(p.name[: -len(".kvc")]) for p in tier.dir.glob("??/*.kvc")}  # type: ignore[attr-defined]
        import redis

        r = redis.Redis(*REDIS)
        try:
            prefix = tier.namespace_prefix  # type: ignore[attr-defined]
            return {bytes.fromhex(k[len(prefix):].decode()) for k in r.scan_iter(match=prefix + b"*")}
        finally:
            r.close()

    def held(self, tier: str, keys: list[bytes]) -> list[bool]:
        """Real residency: the CPU index, the disk index, the remote store listing."""
        if tier == "cpu":
            return [self.mgr.cpu.contains(k) for k in keys]
        if tier == "disk":
            assert self.mgr.disk is not None
            return [k in self.mgr.disk._index.entries for k in keys]  # type: ignore[attr-defined]
        raw = self.raw_remote_keys()
        return [k in raw for k in keys]

    def load(self, tier: str, key: bytes) -> np.ndarray | None:
        if tier == "cpu":
            buf = self.mgr.cpu.acquire(key)
            if buf is None:
                return None
            try:
                return buf.copy()
            finally:
                self.mgr.cpu.release(key)
        t = self.mgr.disk if tier == "disk" else self.mgr.remote
        out = np.empty(CB, dtype=np.uint8)
        return out if t is not None and t.get_into(key, out) else None


@pytest.fixture(params=["fs", "redis"])
def env(request, tmp_path: Path) -> Iterator[Env]:
    kind = request.param
    fields: dict[str, object] = dict(
        chunk_size=CHUNK, cpu_capacity=16 * CB, disk_path=tmp_path / "disk",
        disk_capacity=16 * (HEADER_BYTES + CB),
    )
    prefix = None
    if kind == "fs":
        fields["remote_url"] = f"fs://{tmp_path / 'share'}"
    else:
        host, port = require_redis()
        prefix = f"kvt-ops-{uuid.uuid4().hex[:12]}:"
        fields["remote_url"] = f"redis://{host}:{port}/0?key_prefix={prefix}"
    mgr = StorageManager(KVTierConfig(**fields), small_namespace())  # type: ignore[arg-type]
    e = Env(mgr, kind, prefix.encode() if prefix else None)
    try:
        yield e
    finally:
        mgr.clear()
        mgr.close()


TIERS = ["cpu", "disk", "remote"]


# -- snapshot ---------------------------------------------------------------------------


def test_snapshot_lists_every_tier(env: Env) -> None:
    a = store(env.mgr, 1, 3)
    b = store(env.mgr, 2, 2)
    snap = env.ops.snapshot()
    assert set(snap) == {"cpu", "disk", "remote"}
    assert {k for k, _ in snap["cpu"]} == set(a + b) == {k for k, _ in env.mgr.cpu.resident()}
    assert dict(snap["cpu"]) == {a[0]: None, a[1]: a[0], a[2]: a[1], b[0]: None, b[1]: b[0]}
    assert dict(snap["disk"]) == dict(snap["cpu"])
    assert {k for k, _ in snap["remote"]} == env.raw_remote_keys() == set(a + b)
    if env.remote_kind == "fs":
        assert dict(snap["remote"]) == dict(snap["cpu"])  # parents from the record headers
    else:
        assert all(p is None for _, p in snap["remote"])


# -- clear / delete ------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
def test_clear_one_tier_empties_it_only(env: Env, tier: str) -> None:
    keys = store(env.mgr, 3, 4)
    res = env.ops.clear(tier)
    assert res["chunks"] == 4 and res["bytes"] >= 4 * CB
    assert env.held(tier, keys) == [False] * 4
    others = [t for t in TIERS if t != tier]
    for t in others:
        assert env.held(t, keys) == [True] * 4, t
    if tier == "cpu":
        assert len(env.mgr.cpu) == 0 and env.mgr.cpu.used_bytes == 0
    elif tier == "disk":
        st = env.mgr.disk.stats()  # type: ignore[union-attr]
        assert st["chunks"] == 0 and st["used_bytes"] == 0 and env.mgr.disk.used_bytes == 0  # type: ignore[union-attr]
        assert not list(Path(env.mgr.disk.path).glob("??/*.kvc"))  # type: ignore[union-attr]
    else:
        assert env.raw_remote_keys() == set()
        assert list(env.mgr.remote.scan_keys()) == []  # type: ignore[union-attr]


def test_clear_all(env: Env) -> None:
    keys = store(env.mgr, 4, 3)
    res = env.ops.clear(None)
    assert res["chunks"] == 9
    for t in TIERS:
        assert env.held(t, keys) == [False] * 3
    stats = env.mgr.stats()
    assert stats["cpu_chunks"] == 0 and stats["disk_chunks"] == 0 and stats["disk_used_bytes"] == 0
    assert env.ops.snapshot() == {"cpu": [], "disk": [], "remote": []}


@pytest.mark.parametrize("tier", TIERS)
def test_delete_takes_descendants_in_prefix_closed_tiers(env: Env, tier: str) -> None:
    keys = store(env.mgr, 5, 4)
    res = env.ops.delete([keys[1]], tier)
    if tier in ("cpu", "disk"):
        assert res["chunks"] == 3
        assert env.held(tier, keys) == [True, False, False, False]
    else:
        assert res["chunks"] == 1
        assert env.held(tier, keys) == [True, False, True, True]
    for t in TIERS:
        if t != tier:
            assert env.held(t, keys) == [True] * 4
    if tier == "disk":
        env.mgr.disk.check_invariants()  # type: ignore[union-attr]
        assert env.mgr.disk.used_bytes == HEADER_BYTES + CB  # type: ignore[union-attr]
    if tier == "cpu":
        env.mgr.check_invariants()


def test_delete_everywhere(env: Env) -> None:
    keys = store(env.mgr, 6, 2)
    env.ops.delete(keys, None)
    for t in TIERS:
        assert env.held(t, keys) == [False, False]


# -- pins ----------------------------------------------------------------------------------


def test_pin_survives_an_eviction_storm_in_cpu_and_disk(tmp_path: Path) -> None:
    cfg = KVTierConfig(
        chunk_size=CHUNK, cpu_capacity=8 * CB, disk_path=tmp_path / "d", disk_capacity=8 * (HEADER_BYTES + CB)
    )  # type: ignore[arg-type]
    mgr = StorageManager(cfg, small_namespace())
    ops = InstanceOps(mgr)
    try:
        pinned = store(mgr, 10, 3)
        assert ops.pin(pinned, "sys", None) == {"pinned": 3}
        assert set(ops.pinned_keys()) == set(pinned)
        with pytest.raises(OpError, match="keys: pins would cover 5 chunks"):
            ops.pin(store(mgr, 11, 2), "more", 60.0)  # 3 + 2 > 8 // 2
        for seed in range(100, 116):  # 16 chunks: 2x the CPU and 2x the disk capacity
            store(mgr, seed, 1)
        assert mgr.disk.evicted_chunks >= 8 and mgr.cpu.evicted_chunks >= 8  # type: ignore[union-attr]
        for k in pinned:
            assert mgr.cpu.contains(k) and mgr.disk.contains(k)  # type: ignore[union-attr]
            h = mgr.open_read(k)
            assert h is not None and h.source == "cpu"
            with h:
                assert np.array_equal(h.buffer, payload(k))
            out = np.empty(CB, dtype=np.uint8)
            assert mgr.disk.get_into(k, out) and np.array_equal(out, payload(k))  # type: ignore[union-attr]
        assert ops.unpin("sys") == {"unpinned": 3}
        assert ops.pinned_keys() == []
        for seed in range(200, 216):
            store(mgr, seed, 1)
        for k in pinned:
            assert not mgr.cpu.contains(k) and not mgr.disk.contains(k)  # type: ignore[union-attr]
        mgr.check_invariants()
    finally:
        mgr.close()


def test_pin_ttl_expires(env: Env) -> None:
    keys = store(env.mgr, 12, 2)
    env.ops.pin(keys, "short", 0.01)
    assert env.mgr.leases.is_pinned(keys[0])
    import time

    time.sleep(0.05)
    env.mgr.leases.reap()
    assert not env.mgr.leases.is_pinned(keys[0]) and env.ops.pinned_keys() == []
    with pytest.raises(OpError, match="ttl_s"):
        env.ops.pin(keys, "bad", -1.0)
    with pytest.raises(OpError, match="pin_id"):
        env.ops.pin(keys, "", None)


# -- moves ---------------------------------------------------------------------------------


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("src,dst", [(s, d) for s in TIERS for d in TIERS if s != d])
def test_move_local(env: Env, src: str, dst: str, copy: bool) -> None:
    keys = store(env.mgr, 20, 3)
    env.ops.delete(keys, dst)
    assert env.held(dst, keys) == [False] * 3
    res = env.ops.move_local(keys, None, src, dst, copy)
    assert res["moved"] == 3 and res["bytes"] == 3 * CB
    assert env.held(dst, keys) == [True] * 3
    assert env.held(src, keys) == [True if copy else False] * 3
    for k in keys:
        got = env.load(dst, k)
        assert got is not None and np.array_equal(got, payload(k))
    if "cpu" not in (src, dst):  # the CPU copy made on the way is not left behind... unless it was there
        assert env.held("cpu", keys) == [True] * 3  # store() put them there before the move
    env.mgr.check_invariants()


def test_move_through_cpu_leaves_no_cpu_copy(env: Env) -> None:
    keys = store(env.mgr, 21, 2)
    env.ops.clear("cpu")
    env.ops.move_local(keys, None, "disk", "remote", copy=False)
    assert env.held("cpu", keys) == [False, False]
    assert env.held("remote", keys) == [True, True] and env.held("disk", keys) == [False, False]


# -- export / import -----------------------------------------------------------------------


def test_export_then_import(env: Env) -> None:
    keys = store(env.mgr, 30, 3)
    env.ops.delete(keys, "remote")
    assert env.ops.export(keys, None, "remote") == {"exported": 3}
    assert env.held("remote", keys) == [True] * 3
    env.ops.clear("cpu")
    env.ops.clear("disk")
    assert env.ops.import_(keys, None, "disk") == {"imported": 3}
    assert env.held("disk", keys) == [True] * 3
    for k in keys:
        got = env.load("disk", k)
        assert got is not None and np.array_equal(got, payload(k))
    env.ops.clear("disk")
    assert env.ops.import_(keys, None, "cpu") == {"imported": 3}
    assert env.held("cpu", keys) == [True] * 3
    for k in keys:
        got = env.load("cpu", k)
        assert got is not None and np.array_equal(got, payload(k))
    with pytest.raises(OpError, match="dst"):
        env.ops.import_(keys, None, "remote")
    with pytest.raises(OpError, match="tier"):
        env.ops.export(keys, None, "cpu")


# -- compress --------------------------------------------------------------------------------


def remote_codec_of(env: Env, key: bytes) -> str:
    """The codec name stored with ``key``'s remote value (read from the store directly)."""
    tier = env.mgr.remote
    if env.remote_kind == "fs":
        with open(tier.path_of(key), "rb") as f:  # type: ignore[union-attr]
            return decode_header(f.read(HEADER_BYTES)).codec
    import redis

    r = redis.Redis(*REDIS)
    try:
        raw = r.get(tier.redis_key(key))  # type: ignore[union-attr]
    finally:
        r.close()
    assert raw is not None
    return raw[8:24].rstrip(b"\x00").decode()


def test_compress_lossless_lossy_and_back(env: Env) -> None:
    keys = store(env.mgr, 40, 3)
    res = env.ops.compress(keys, "remote", "shuffle-zstd")
    assert res["chunks"] == 3 and res["lossless"] is True and res["max_abs_error"] == 0.0
    assert all(remote_codec_of(env, k) == "shuffle-zstd" for k in keys)
    assert res["bytes_after"] == sum(env.mgr.remote.stored_sizes(keys))  # type: ignore[union-attr]
    for k in keys:
        got = env.load("remote", k)
        assert got is not None and np.array_equal(got, payload(k))  # bit-exact
    res = env.ops.compress(keys, "remote", "int8")
    assert res["chunks"] == 3 and res["lossless"] is False
    assert 0.0 < res["max_abs_error"] < 0.5
    assert res["bytes_after"] < res["bytes_before"]
    assert all(remote_codec_of(env, k) == "int8" for k in keys)
    worst = 0.0
    for k in keys:
        got = env.load("remote", k)
        assert got is not None
        d = np.abs(got.view(np.float16).astype(np.float64) - payload(k).view(np.float16).astype(np.float64))
        worst = max(worst, float(d.max()))
    assert worst == pytest.approx(res["max_abs_error"])
    res = env.ops.decompress(keys, "remote")
    assert res["chunks"] == 3 and res["lossless"] is True
    assert all(remote_codec_of(env, k) == "raw" for k in keys)
    assert env.held("remote", keys) == [True] * 3


def test_compress_refuses_what_a_tier_cannot_store(env: Env) -> None:
    keys = store(env.mgr, 41, 2)
    with pytest.raises(OpError, match=r"codec: .*disk tier stores raw records only; codec 'int8'"):
        env.ops.compress(keys, "disk", "int8")
    assert env.ops.compress(keys, "disk", "raw")["chunks"] == 2  # a no-op rewrite
    with pytest.raises(OpError, match="codec: unknown codec 'zip'"):
        env.ops.compress(keys, "remote", "zip")
    with pytest.raises(OpError, match="tier"):
        env.ops.compress(keys, "cpu", "raw")
    for k in keys:
        got = env.load("disk", k)
        assert got is not None and np.array_equal(got, payload(k))


# -- verify / health ----------------------------------------------------------------------------


def test_verify_finds_missing_and_corrupt(env: Env) -> None:
    keys = store(env.mgr, 50, 3)
    absent = os.urandom(32)
    for t in TIERS:
        res = env.ops.verify(keys + [absent], t)
        assert (res["verified"], res["missing"], res["corrupt"]) == (3, 1, 0), t
    path = env.mgr.disk.file_of(keys[2])  # type: ignore[union-attr]
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    res = env.ops.verify(keys, "disk")
    assert (res["verified"], res["missing"], res["corrupt"]) == (2, 0, 1)
    assert env.held("disk", keys) == [True, True, False]  # the tier dropped the corrupt record
    res = env.ops.verify(keys + [absent], None)
    assert (res["verified"], res["missing"], res["corrupt"]) == (3, 1, 0)  # other tiers still hold it


def test_health_reports_tier_state(env: Env) -> None:
    store(env.mgr, 60, 3)
    h = env.ops.health(probe=True)
    assert set(h) == {"cpu", "disk", "remote"}
    assert h["cpu"]["chunks"] == len(env.mgr.cpu) == 3 and h["cpu"]["used_bytes"] == 3 * CB
    assert h["disk"]["chunks"] == 3 and h["disk"]["used_bytes"] == env.mgr.disk.used_bytes  # type: ignore[union-attr]
    assert h["disk"]["capacity_bytes"] == 16 * (HEADER_BYTES + CB) and h["disk"]["breaker"] == "n/a"
    assert h["remote"]["reachable"] is True
    assert h["remote"]["breaker"] == ("n/a" if env.remote_kind == "fs" else "closed")
    for v in h.values():
        assert set(v) >= {"reachable", "read_errors", "write_errors", "breaker", "queue_depth", "used_bytes",
                          "capacity_bytes", "chunks"}
        assert v["queue_depth"] == 0


def test_health_of_an_unreachable_redis(tmp_path: Path) -> None:
    cfg = KVTierConfig(chunk_size=CHUNK, cpu_capacity=4 * CB, remote_url="redis://127.0.0.1:1/0?timeout_s=0.2")  # type: ignore[arg-type]
    mgr = StorageManager(cfg, small_namespace())
    try:
        h = InstanceOps(mgr).health(probe=True)
        assert h["remote"]["reachable"] is False
    finally:
        mgr.close()


# -- bad input ------------------------------------------------------------------------------------


def test_bad_input_names_the_field(env: Env) -> None:
    keys = store(env.mgr, 70, 2)
    ops = env.ops
    with pytest.raises(OpError, match="tier: unknown tier 'tape'"):
        ops.clear("tape")
    with pytest.raises(OpError, match="tier: this instance has no 'peer' tier"):
        ops.delete(keys, "peer")
    with pytest.raises(OpError, match=r"keys\[1\]: key must be 32 bytes, got 3"):
        ops.delete([keys[0], b"abc"], "cpu")
    with pytest.raises(OpError, match="keys: expected a list"):
        ops.verify(b"x" * 32, None)
    with pytest.raises(OpError, match="parents: 1 parents for 2 keys"):
        ops.move_local(keys, [None], "cpu", "disk", False)
    with pytest.raises(OpError, match="dst: same tier as src"):
        ops.move_local(keys, None, "disk", "disk", False)
    with pytest.raises(OpError, match="src: unknown tier"):
        ops.move_local(keys, None, "ssd", "disk", False)
    with pytest.raises(OpError, match="op: unknown operation"):
        ops.run("explode", {})
    with pytest.raises(OpError, match="args: clear"):
        ops.run("clear", {"tierr": "cpu"})
    assert ops.run("verify", {"keys": keys, "tier": "cpu"})["verified"] == 2
    assert isinstance(OpError("x"), ValueError)
    assert env.held("cpu", keys) == [True, True]  # nothing changed


# -- concurrency and result shapes ----------------------------------------------------------------


def test_ops_run_beside_the_engine(env: Env) -> None:
    """Operations from another thread while an 'engine' thread stores and reads: no error, no leaked reference."""
    import json
    import threading

    errors: list[BaseException] = []
    stop = threading.Event()

    def engine() -> None:
        try:
            seed = 0
            while not stop.is_set():
                seed = (seed + 1) % 12
                keys = store(env.mgr, 500 + seed, 2)
                for h in env.mgr.open_read_many([(k, None) for k in keys]):
                    if h is not None:
                        h.close()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=engine)
    t.start()
    try:
        for i in range(4):
            keys = env.mgr.keys(prompt(500 + i, 2))
            results = [
                env.ops.verify(keys, None),
                env.ops.move_local(keys, None, "cpu", "disk", copy=bool(i % 2)),
                env.ops.export(keys, None, "remote"),
                env.ops.delete(keys[1:], "disk"),
                env.ops.health(),
                env.ops.clear("cpu" if i % 2 else None),
                env.ops.pin(keys, "p", 30.0),
                env.ops.unpin("p"),
            ]
            for r in results:
                json.dumps(r)  # plain JSON-able dicts
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive() and not errors
    assert env.mgr.flush(10)
    assert env.mgr.cpu.referenced_chunks() == 0
    env.mgr.check_invariants()
    env.mgr.disk.check_invariants()  # type: ignore[union-attr]
