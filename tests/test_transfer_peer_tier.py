"""A peer instance as a read-only lower tier: two StorageManagers in one process, TCP and shared memory."""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import CHUNK, payload_for, small_namespace
from transfer_helpers import CB, store_chain
from kvtier.config import KVTierConfig
from kvtier.storage.manager import StorageManager
from kvtier.transfer.assembly import open_manager
from kvtier.transfer.peer_tier import PeerServer, PeerTier
from kvtier.transfer.shm import ShmChannel
from kvtier.transfer.shm_listener import ShmListener
from kvtier.testing.fleet_keys import make_fleet
from kvtier.transfer.peer_auth import ClientAuth
from kvtier.transfer.tcp import TcpChannel, TcpListener


def _config(chunks: int = 16) -> KVTierConfig:
    return KVTierConfig(chunk_size=CHUNK, cpu_capacity=chunks * CB)


@pytest.fixture(params=["tcp", "shm"])
def peers(request, tmp_path):
    a = StorageManager(_config(), small_namespace())
    creds = None
    if request.param == "tcp":
        fleet = make_fleet(tmp_path / "keys", ["a", "b"])
        creds = fleet.credentials("a")
        listener = TcpListener(timeout_s=5)
        connect = lambda: TcpChannel.connect(*listener.address, timeout_s=2,  # noqa: E731
                                             auth=ClientAuth(fleet.credentials("b")))
    else:
        listener = ShmListener(timeout_s=5, staging_bytes=1 << 20)
        connect = lambda: ShmChannel.connect(listener.path, 2, staging_bytes=1 << 20)  # noqa: E731
    server = PeerServer(a, listener, credentials=creds)
    tier = PeerTier(connect, timeout_s=2.0, retry_s=0.2)
    b = StorageManager(_config(), small_namespace(), lower=[tier])
    yield a, b, tier, server
    server.stop()
    b.close()
    a.close()


def test_prefix_only_on_a_is_served_to_b_from_the_peer(peers):
    a, b, tier, _ = peers
    tokens = list(range(5 * CHUNK + 3))
    keys = store_chain(a, tokens)
    assert not any(b.cpu.contains(k) for k in keys)
    assert tier.contains_many(keys + [b"\x01" * 32]) == [True] * 5 + [False]
    assert b.lookup(tokens).num_tokens >= 4 * CHUNK  # the peer's chunks count as hits
    for k in keys:
        h = b.open_read(k)
        assert h is not None and h.source == "peer"
        with h:
            assert np.array_equal(h.buffer, payload_for(k, CB))
    assert all(b.cpu.contains(k) for k in keys)  # promoted into B's CPU tier
    s = tier.stats()
    assert s["get_hits"] == 5 and s["errors"] == 0


def test_batched_get_with_absent_keys(peers):
    a, b, tier, _ = peers
    keys = store_chain(a, list(range(3 * CHUNK)))
    outs = [np.zeros(CB, np.uint8) for _ in range(4)]
    got = tier.get_many_into(list(zip([keys[0], b"\x02" * 32, keys[2], keys[1]], outs)))
    assert got == [True, False, True, True]
    assert np.array_equal(outs[0], payload_for(keys[0], CB)) and not outs[1].any()
    many = [bytes([i % 256, i // 256]) * 16 for i in range(700)] + keys  # several requests
    assert tier.contains_many(many) == [False] * 700 + [True] * 3
    assert tier.put(keys[0], outs[0]) is False and not tier.writable


def test_vanished_peer_is_a_miss_within_the_timeout(peers):
    a, b, tier, server = peers
    keys = store_chain(a, list(range(2 * CHUNK)))
    assert tier.contains_many(keys) == [True, True]
    server.stop()  # the peer goes away (its channels close)
    t0 = time.monotonic()
    assert b.open_read(keys[0]) is None
    assert tier.contains_many(keys) == [False, False]
    assert tier.get_many_into([(keys[1], np.zeros(CB, np.uint8))]) == [False]
    assert time.monotonic() - t0 < 5.0
    assert tier.stats()["errors"] >= 1


def test_peer_down_from_the_start_is_a_miss():
    def refuse():
        return TcpChannel.connect("127.0.0.1", 1, timeout_s=0.5)

    tier = PeerTier(refuse, timeout_s=0.5, retry_s=10)
    assert tier.contains_many([b"\x03" * 32]) == [False]
    assert tier.get_many_into([(b"\x03" * 32, np.zeros(8, np.uint8))]) == [False]
    s = tier.stats()
    assert s["errors"] == 1 and s["skipped_calls"] == 1  # no retry storm while down
    tier.close()


def test_over_shared_memory_peers_copy_straight_out_of_the_cpu_tier(tmp_path):
    """``peer_listen = shm://``: A's CPU tier lives in a shared segment that each peer maps
    read-only; A's chunks reach B with no copy on A's side (no staging ring is ever made)."""
    from kvtier.transfer.peer_open import open_peer_tier

    url = f"shm://{tmp_path / 'a.sock'}"
    a = open_manager(KVTierConfig(chunk_size=CHUNK, cpu_capacity=16 * CB, peer_listen=url), small_namespace())
    tier = open_peer_tier(url, timeout_s=2.0, retry_s=0.2)
    b = StorageManager(_config(), small_namespace(), lower=[tier])
    try:
        seg = a.cpu_segment
        assert seg is not None
        base = int(seg.array.ctypes.data)
        slots = a.cpu.pool._buf
        assert base <= int(slots.ctypes.data) and int(slots.ctypes.data) + slots.nbytes <= base + seg.size
        keys = store_chain(a, list(range(4 * CHUNK + 1)))
        for k in keys:
            h = b.open_read(k)
            assert h is not None and h.source == "peer"
            with h:
                assert np.array_equal(h.buffer, payload_for(k, CB))
        served = a.peer_server.channels
        assert len(served) == 1 and served[0]._staging is None  # every chunk went in place
        mapped = list(tier._chan._theirs.values())
        assert len(mapped) == 1 and not mapped[0].array.flags.writeable  # read-only on B
    finally:
        b.close()
        a.close()
    assert a.cpu_segment.fd is None  # closed with the manager


def test_without_shared_memory_peering_the_cpu_tier_stays_private(tmp_path):
    fleet = make_fleet(tmp_path / "keys", ["a"])
    for extra in ({}, {"peer_listen": "tcp://127.0.0.1:0", **fleet.config("a")}):
        m = open_manager(KVTierConfig(chunk_size=CHUNK, cpu_capacity=4 * CB, **extra), small_namespace())
        try:
            assert m.cpu_segment is None
        finally:
            m.close()
