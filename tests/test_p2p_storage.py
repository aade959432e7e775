"""P2P sharing built from the config: two StorageManagers in one process (A serves, B has peers=[A])."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from conftest import CHUNK, payload_for, small_namespace
from transfer_helpers import CB, store_chain
from kvtier.config import KVTierConfig
from kvtier.transfer.assembly import open_manager

#: A hang guard, not a speed target: a dead peer must cost about one peer_timeout_s.
HANG_S = 10.0


def _config(**kw) -> KVTierConfig:
    return KVTierConfig(**{"chunk_size": CHUNK, "cpu_capacity": 32 * CB, "peer_timeout_s": 0.5, **kw})


@pytest.fixture(params=["tcp", "shm"])
def pair(request, tmp_path, fleet):
    listen = "tcp://127.0.0.1:0" if request.param == "tcp" else f"shm://{tmp_path}/peer-a.sock"
    keys = (lambda name: fleet.config(name)) if request.param == "tcp" else (lambda name: {})
    a = open_manager(_config(peer_listen=listen, **keys("a")), small_namespace())
    b = open_manager(_config(peers=[a.peer_server.url], peer_retry_s=60.0, **keys("b")), small_namespace())
    request.node.peer_keys = keys("c")  # a third instance's settings, for the tests that start one
    yield a, b
    b.close()
    a.close()


def test_b_gets_a_prefix_only_a_holds_and_promotes_it(pair):
    a, b = pair
    assert [t.kind for t in b.lower] == ["peer"] and a.lower == []
    tokens = list(range(5 * CHUNK + 3))
    keys = store_chain(a, tokens)
    assert not any(b.contains(k) for k in keys)
    hit = b.lookup(tokens)
    assert hit.num_tokens == 5 * CHUNK and hit.tiers == ["peer"] * 5 and hit.keys == keys
    handles = b.open_read_many([(k, keys[i - 1] if i else None) for i, k in enumerate(keys)])
    try:
        assert all(h is not None and h.source == "peer" for h in handles)
        for k, h in zip(keys, handles):
            assert np.array_equal(h.buffer, payload_for(k, CB))
    finally:
        for h in handles:
            if h is not None:
                h.close()
    assert all(b.cpu.contains(k) for k in keys)  # promoted into B's CPU tier
    assert b.lookup(tokens).tiers == ["cpu"] * 5  # a second request is a local hit
    s = b.stats()
    assert s["peer_get_hits"] == 5 and s["peer_errors"] == 0


def test_partial_prefix_and_other_namespace_miss(pair, request):
    a, b = pair
    tokens = list(range(6 * CHUNK + 1))
    keys = store_chain(a, tokens[: 3 * CHUNK])
    assert b.lookup(tokens).keys == keys  # B gets exactly what A holds, nothing past the gap
    other = open_manager(_config(peers=[a.peer_server.url], **request.node.peer_keys),
                           small_namespace(model="test/other-model"))
    try:
        assert other.lookup(tokens).num_tokens == 0  # keys are per namespace: another model never hits
    finally:
        other.close()


def test_a_closed_between_lookup_and_pull_is_a_miss(pair):
    a, b = pair
    tokens = list(range(4 * CHUNK + 1))
    keys = store_chain(a, tokens)
    assert b.lookup(tokens).num_tokens == 4 * CHUNK
    a.close()  # the peer goes away after B's lookup, before its pull
    t0 = time.monotonic()
    handles = b.open_read_many([(k, None) for k in keys])
    assert handles == [None] * 4 and not any(b.cpu.contains(k) for k in keys)
    assert b.lookup(tokens).num_tokens == 0  # no exception: a miss
    assert time.monotonic() - t0 < HANG_S
    s = b.stats()
    assert s["peer_errors"] == 1  # one failure, then the peer is skipped for peer_retry_s
    assert s["peer_skipped_calls"] >= 1
    b.check_invariants()


def test_dead_and_silent_peers_cost_one_timeout_then_are_skipped(fleet):
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers the hello
    dead = socket.create_server(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()  # nothing listens there: connection refused
    try:
        cfg = _config(peers=[f"tcp://127.0.0.1:{dead_port}", f"tcp://127.0.0.1:{silent.getsockname()[1]}"],
                      peer_timeout_s=0.3, peer_retry_s=60.0, **fleet.config("b"))
        b = open_manager(cfg, small_namespace())
        try:
            tokens = list(range(3 * CHUNK + 1))
            t0 = time.monotonic()
            assert b.lookup(tokens).num_tokens == 0
            assert b.open_read(b.keys(tokens)[0]) is None
            assert b.lookup(tokens).num_tokens == 0
            assert time.monotonic() - t0 < HANG_S
            s = b.stats()
            assert s["peer_errors"] == 1 and s["peer2_errors"] == 1  # each tried once, then skipped
            assert s["peer_skipped_calls"] >= 2 and s["peer2_skipped_calls"] >= 2
        finally:
            b.close()
    finally:
        silent.close()


def test_listen_address_taken_is_an_error_and_close_frees_it(fleet):
    a = open_manager(_config(peer_listen="tcp://127.0.0.1:0", **fleet.config("a")), small_namespace())
    url = a.peer_server.url
    with pytest.raises(OSError):
        open_manager(_config(peer_listen=url, **fleet.config("a")), small_namespace())
    a.close()
    a2 = open_manager(_config(peer_listen=url, **fleet.config("a")), small_namespace())  # the port is free again after close
    try:
        assert a2.peer_server.url == url
    finally:
        a2.close()
