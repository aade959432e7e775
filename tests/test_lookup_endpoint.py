"""The scheduler-to-worker lookup endpoint speaks the one control plane (issue 8, failing input 1).

Failing input 1: one chunk held only in Redis (a restarted engine, empty local
tiers), a 33-token prompt, chunk_size 32: the worker's own lookup finds 32
tokens; the scheduler's lookup over the old RPC got 0 (its tier table had no
``remote``, the error reply became a miss) and the lease taken before the error
stayed pinned until its TTL. Right: 32 with tiers ["remote"], and no lease
outlives a failed call, on the lookup endpoint and on the cache server alike.
"""

from __future__ import annotations

import os
import random
import socket
import stat
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Sequence

import pytest

from conftest import CHUNK, payload_for, small_namespace
from kvtier import protocol as P
from kvtier.config import KVTierConfig
from kvtier.service.lookup_endpoint import LookupClient, LookupServer, socket_path
from kvtier.storage.manager import StorageManager
from kvtier.storage.types import LookupResult
from service_helpers import connect, short_dir, start_server, wait_until  # noqa: F401 (fixture)

CB = small_namespace().chunk_bytes


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def store(mgr: Any, keys: Sequence[bytes]) -> None:
    parent = None
    for k in keys:
        buf = mgr.open_write(k, parent)
        assert buf is not None
        buf[:] = payload_for(k, CB)
        mgr.commit(k, parent)
        parent = k


@pytest.fixture
def redis_url(redis_url: str) -> str:
    """The CI Redis under a key prefix of this test's own."""
    return f"{redis_url}?key_prefix=kvtier-test-{uuid.uuid4().hex[:10]}:"


@pytest.fixture
def manager() -> Iterator[StorageManager]:
    m = StorageManager(KVTierConfig(chunk_size=CHUNK, cpu_capacity=8 * CB), small_namespace())
    yield m
    m.close()


@pytest.fixture
def endpoint(short_dir: Path, manager: StorageManager) -> Iterator[tuple[LookupServer, str]]:
    path = str(short_dir / "lookup.sock")
    srv = LookupServer(manager, path)
    yield srv, path
    srv.close()


def fail_after_grant(m: Any, how: str) -> None:
    """Make ``m.lookup_keys`` fail after the real one granted the lease (instance attribute)."""
    real = m.lookup_keys

    def patched(keys: Sequence[bytes], lease_owner: str | None = None) -> LookupResult:
        res = real(keys, lease_owner)
        if how == "bad_tier":
            return LookupResult(res.num_tokens, res.keys, ["tape"] * len(res.keys))
        if how == "raise":
            raise RuntimeError("tier exploded after the lease")
        time.sleep(1.0)  # "slow": the client gives up first
        return res

    m.lookup_keys = patched


# -- failing input 1 ---------------------------------------------------------------------------
def test_remote_only_chunk_is_found_over_the_endpoint(short_dir: Path, redis_url: str) -> None:
    cfg = KVTierConfig(chunk_size=CHUNK, cpu_capacity=8 * CB, remote_url=redis_url, remote_timeout_s=2.0)
    tokens = prompt(1, 33)
    writer = StorageManager(cfg, small_namespace())
    try:
        store(writer, writer.keys(tokens)[:1])
        assert writer.flush(10)
    finally:
        writer.close()
    fresh = StorageManager(cfg, small_namespace())  # a restarted engine: empty CPU, no disk
    path = str(short_dir / "lookup.sock")
    srv = LookupServer(fresh, path)
    client = LookupClient(path, CHUNK, timeout_s=5.0)
    try:
        own = fresh.lookup(tokens)
        assert own.num_tokens == 32 and own.tiers == ["remote"]
        res = client.lookup_keys(fresh.keys(tokens)[:1], "req-1")
        assert res.num_tokens == 32 and res.tiers == ["remote"] and res.keys == own.keys  # was 0
        assert fresh.leases.holds("req-1")
        client.release("req-1")
        assert not fresh.leases.holds("req-1")
    finally:
        client.close()
        srv.close()
        fresh.clear()
        fresh.close()


@pytest.mark.parametrize("how", ["bad_tier", "raise"])
def test_no_lease_outlives_a_failed_endpoint_call(endpoint: tuple[LookupServer, str], manager: Any, how: str) -> None:
    srv, path = endpoint
    keys = manager.keys(prompt(2, 3 * CHUNK + 1))
    store(manager, keys)
    fail_after_grant(manager, how)
    client = LookupClient(path, CHUNK, timeout_s=5.0)
    assert client.lookup_keys(keys, "req-x").num_tokens == 0
    assert not manager.leases.holds("req-x") and manager.leases.pinned_keys == 0  # was pinned until the TTL
    del manager.lookup_keys  # the real method again
    time.sleep(0.01)
    assert client.lookup_keys(keys, "req-y").num_tokens == 3 * CHUNK  # the endpoint kept serving
    assert manager.leases.holds("req-y")
    client.close()


@pytest.mark.slow
def test_no_lease_outlives_a_client_timeout(endpoint: tuple[LookupServer, str], manager: Any) -> None:
    srv, path = endpoint
    keys = manager.keys(prompt(3, 2 * CHUNK + 1))
    store(manager, keys)
    fail_after_grant(manager, "slow")
    client = LookupClient(path, CHUNK, timeout_s=0.2, backoff_min_s=0.01, backoff_max_s=0.02)
    t0 = time.monotonic()
    assert client.lookup_keys(keys, "req-t").num_tokens == 0
    assert time.monotonic() - t0 < 1.0  # the bound is timeout_s, not the slow handler
    wait_until(lambda: not manager.leases.holds("req-t"), timeout_s=10, what="lease end after the timeout")
    assert client.failures == 1
    del manager.lookup_keys
    time.sleep(0.05)  # back-off passes
    assert client.lookup_keys(keys, "req-u").num_tokens == 2 * CHUNK
    assert not manager.leases.holds("req-t") and manager.leases.holds("req-u")
    client.close()


# -- the same on the cache server (siblings) ------------------------------------------------------
def owner_on_server(client_id: str, owner: str) -> str:
    return f"{len(client_id)}:{client_id}/{owner}"


@pytest.mark.slow  # its "slow" case waits out a server timeout (1.5 s)
@pytest.mark.parametrize("how", ["bad_tier", "raise", "slow"])
def test_no_lease_outlives_a_failed_server_lookup(short_dir: Path, how: str) -> None:
    with start_server(short_dir) as srv:
        c = connect(short_dir / "s.sock", timeout_s=0.3 if how == "slow" else 5.0, backoff_min_s=0.01, backoff_max_s=0.02)
        keys = [bytes([i + 1]) * 32 for i in range(3)]
        store(c, keys)
        assert c.flush(5)
        m = srv.hosts()[0].manager
        fail_after_grant(m, how)
        assert c.lookup_keys(keys, "r1").num_tokens == 0
        wait_until(lambda: not m.leases.holds(owner_on_server("engine-a", "r1")), timeout_s=10, what="lease end")
        assert m.leases.pinned_keys == 0
        del m.lookup_keys
        wait_until(lambda: c.connected, what="reconnect")
        assert c.lookup_keys(keys, "r2").num_tokens == 3 * CHUNK
        assert m.leases.holds(owner_on_server("engine-a", "r2"))
        srv.check_invariants()
        c.close()


# -- the endpoint itself ---------------------------------------------------------------------------
def test_endpoint_socket_is_owner_only_and_serves_only_lease_ops(endpoint: tuple[LookupServer, str]) -> None:
    srv, path = endpoint
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(path)
    for i, req in enumerate([P.Health(), P.Stats(), P.Lookup([b"\x01" * 32], None)]):
        s.sendall(P.encode_request(req, i + 1))
        reply, _ = P.read_reply(s, bytearray(4096), time.monotonic() + 10)
        assert reply["id"] == i + 1
        if isinstance(req, P.Stats):
            assert reply["ok"] is False and reply["code"] == "unsupported"
        else:
            assert reply["ok"] is True
    s.sendall(b"\x00\x00\x00\x03abc")  # not msgpack: an error reply, the connection stays
    reply, _ = P.read_reply(s, bytearray(4096), time.monotonic() + 10)
    assert reply["ok"] is False and reply["code"] == "bad_msgpack"
    s.close()


def test_endpoint_and_clients_refuse_a_shared_socket_dir(short_dir: Path, manager: StorageManager) -> None:
    shared = short_dir / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(P.UnsafeSocketDir):
        LookupServer(manager, str(shared / "l.sock"))
    ok_dir = short_dir / "ok"
    srv = LookupServer(manager, str(ok_dir / "l.sock"))
    try:
        ok_dir.chmod(0o777)  # someone opened it up after the endpoint started
        client = LookupClient(str(ok_dir / "l.sock"), CHUNK, timeout_s=1.0)
        assert client.lookup_keys([b"\x01" * 32], "r").num_tokens == 0 and client.failures == 1
        client.close()
    finally:
        ok_dir.chmod(0o700)
        srv.close()


def test_default_socket_path_is_in_a_private_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    p = socket_path("engine/../x y")
    assert os.path.dirname(p) == str(tmp_path / f"kvtier-{os.getuid()}")
    assert os.path.basename(p).startswith("kvtier-lookup-") and "/" not in os.path.basename(p)


def test_unreachable_endpoint_is_a_quick_miss(short_dir: Path) -> None:
    client = LookupClient(str(short_dir / "none.sock"), CHUNK, timeout_s=0.2)
    t0 = time.monotonic()
    assert client.lookup_keys([b"\x01" * 32], "r").num_tokens == 0
    client.release("r")
    assert time.monotonic() - t0 < 2 and client.failures == 1  # the second call waited out the back-off
    client.close()
