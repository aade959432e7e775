"""``kvtier server`` and P2P: one peer listener serving every hosted namespace, and peers as lower tiers.

The server (in process, real sockets) holds chains of two model namespaces stored by
clients; an embedded storage manager with ``peers=[server]`` pulls each. The other way,
a server with ``peers=[A]`` serves its clients a prefix only the embedded A holds.
Every check reads real state: payload bytes, where chunks live, namespace holds.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import CHUNK, payload_for, small_namespace
from service_helpers import connect, server_config, short_dir, store, wait_until  # noqa: F401
from transfer_helpers import CB, store_chain, read_chain
from kvtier.config import KVTierConfig
from kvtier.service.server import CacheServer, ServerOptions
from kvtier.storage.manager import StorageManager
from kvtier.transfer.assembly import open_manager

OTHER = small_namespace(model="test/other-model")


def _embedded(**kw: object) -> StorageManager:
    return open_manager(KVTierConfig(chunk_size=CHUNK, cpu_capacity=32 * CB, peer_timeout_s=1.0, **kw), small_namespace())


@pytest.fixture(params=["tcp", "shm"])
def serving(request, short_dir: Path, fleet):
    listen = "tcp://127.0.0.1:0" if request.param == "tcp" else f"shm://{short_dir}/peer.sock"
    keys = fleet.config("a") if request.param == "tcp" else {}
    srv = CacheServer(server_config(32, peer_listen=listen, **keys),
                      ServerOptions(socket_path=str(short_dir / "s.sock"))).start()
    srv.test_client_keys = fleet.config("b") if request.param == "tcp" else {}
    yield srv, short_dir
    srv.close()


@pytest.mark.slow
def test_one_listener_serves_every_hosted_namespace(serving) -> None:
    srv, d = serving
    assert srv.peer_server is not None
    tokens = list(range(4 * CHUNK + 5))
    keys_by_ns = {}
    for ns in (small_namespace(), OTHER):
        c = connect(d / "s.sock", ns, client_id=f"engine-{ns.model}")
        mgr_keys = StorageManager(KVTierConfig(chunk_size=CHUNK, cpu_capacity=4 * CB), ns)
        try:
            keys = mgr_keys.keys(tokens)
        finally:
            mgr_keys.close()
        store(c, keys)
        c.close()
        keys_by_ns[ns.model] = keys
    assert keys_by_ns["test/tiny-model"] != keys_by_ns["test/other-model"]
    for ns in (small_namespace(), OTHER):
        b = open_manager(KVTierConfig(chunk_size=CHUNK, cpu_capacity=32 * CB, peers=[srv.peer_server.url],
                                        **srv.test_client_keys), ns)
        try:
            keys = keys_by_ns[ns.model]
            hit = b.lookup(tokens)
            assert hit.num_tokens == 4 * CHUNK and hit.tiers == ["peer"] * 4
            got = read_chain(b, keys)
            assert all(g is not None and np.array_equal(g, payload_for(k, CB)) for k, g in zip(keys, got))
        finally:
            b.close()
    # the peer server closes its read handles on its own thread once B's acks arrive: poll (a hang guard)
    wait_until(lambda: all(e.reading == 0 for e in srv._namespaces._entries.values()), 10.0,
               "every peer read's namespace hold released")


@pytest.mark.slow
def test_a_corrupt_slot_is_not_served_to_peers(serving) -> None:
    srv, d = serving
    tokens = list(range(3 * CHUNK + 1))
    c = connect(d / "s.sock")
    probe = _embedded()
    keys = probe.keys(tokens)
    probe.close()
    store(c, keys)
    cpu = srv._namespaces.hosts()[0].manager.cpu
    view = cpu.acquire(keys[1])
    assert view is not None
    view[:16] ^= 0xFF  # a stray write into the shared segment after the commit
    cpu.release(keys[1])
    b = _embedded(peers=[srv.peer_server.url], **srv.test_client_keys)
    try:
        assert b.lookup(tokens).num_tokens == 3 * CHUNK  # presence is cheap; the bytes are checked on read
        got = read_chain(b, keys)
        assert got[0] is not None and np.array_equal(got[0], payload_for(keys[0], CB))
        assert got[1] is None, "a chunk that fails its commit checksum reached a peer"
    finally:
        b.close()
        c.close()


def test_a_namespace_held_by_a_peer_read_is_not_released(short_dir: Path, fleet) -> None:
    srv = CacheServer(server_config(16, peer_listen="tcp://127.0.0.1:0", **fleet.config("a")),
                      ServerOptions(socket_path=str(short_dir / "s.sock"), namespace_idle_s=0.01)).start()
    try:
        c = connect(short_dir / "s.sock")
        probe = _embedded()
        keys = probe.keys(list(range(2 * CHUNK)))
        probe.close()
        store(c, keys)
        c.close()
        view = srv.peer_server.manager
        handles = view.open_read_many([(keys[0], None)])
        assert handles[0] is not None
        table = srv._namespaces
        wait_until(lambda: srv.num_sessions() == 0, 10.0, "the client's session to end")
        for _ in range(3):  # the first pass marks it idle, later ones would release it
            table.maintain()
            time.sleep(0.05)
        assert len(table.hosts()) == 1, "released while a peer read held it"
        assert np.array_equal(handles[0].buffer, payload_for(keys[0], CB))  # still mapped
        handles[0].close()
        handles[0].close()  # idempotent
        table.maintain()
        wait_until(lambda: (table.maintain(), not table.hosts())[1], 10.0, "the idle namespace to be released")
    finally:
        srv.close()


def test_server_with_peers_serves_its_clients_from_an_embedded_peer(short_dir: Path, fleet) -> None:
    a = _embedded(peer_listen="tcp://127.0.0.1:0", **fleet.config("a"))
    srv = CacheServer(server_config(32, peers=[a.peer_server.url], peer_timeout_s=1.0, **fleet.config("b")),
                      ServerOptions(socket_path=str(short_dir / "s.sock"))).start()
    try:
        tokens = list(range(3 * CHUNK + 7))
        keys = store_chain(a, tokens)
        c = connect(short_dir / "s.sock")
        hit = c.lookup_keys(keys)
        assert hit.keys == keys and hit.tiers == ["peer"] * 3, hit
        got = read_chain(c, keys)  # the server's client reads like a storage manager
        assert all(g is not None and np.array_equal(g, payload_for(k, CB)) for k, g in zip(keys, got))
        c.close()
    finally:
        srv.close()
        a.close()


@pytest.mark.slow
def test_kvtier_server_cli_takes_peer_settings_as_flags_and_variables(short_dir: Path, fleet) -> None:
    import os

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}, "KVTIER_PEERS": "tcp://127.0.0.1:1",
           "KVTIER_FLEET_KEY": str(fleet.key_path("a")), "KVTIER_FLEET_MEMBERS": str(fleet.members_path)}
    p = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "server", "--socket", str(short_dir / "s.sock"),
                          "--no-metrics", "--peer-listen", "tcp://127.0.0.1:0", "--peer", "tcp://127.0.0.1:2"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: (short_dir / "s.sock").exists() or p.poll() is not None, 60.0, "the server to listen")
        assert p.poll() is None, p.stdout.read() if p.stdout else ""
    finally:
        p.terminate()
        out, _ = p.communicate(timeout=30)
    assert p.returncode == 0, out
    assert "serving this instance's chunks on tcp://127.0.0.1:" in out, out
    assert "peers=('tcp://127.0.0.1:2',)" in out, out  # the flag wins over KVTIER_PEERS
    bad = subprocess.run([sys.executable, "-m", "kvtier.cli", "server", "--socket", str(short_dir / "t.sock"),
                          "--no-metrics", "--peer", "http://x:1"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "(from flag --peer)" in bad.stderr and "scheme must be one of" in bad.stderr
