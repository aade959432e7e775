"""Cache service: store/load through shared memory, leases, access control, refusals, metrics."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from conftest import payload_for, small_namespace
from kvtier import protocol as P
from kvtier.index.keys import chain_parents
from kvtier.service.client import ServiceClient
from kvtier.storage.types import WriteSkip
from service_helpers import connect, store, short_dir, start_server, wait_until  # noqa: F401 (fixture)

KEYS = [bytes([i + 1]) * 32 for i in range(8)]


def test_store_then_load_through_shared_memory(short_dir: Path) -> None:
    with start_server(short_dir) as srv:
        a = connect(short_dir / "s.sock")
        store(a, KEYS[:3])
        res = a.lookup_keys(KEYS[:4])
        assert res.num_tokens == 3 * 32 and res.keys == KEYS[:3] and res.tiers == ["cpu"] * 3
        for k in KEYS[:3]:
            with a.open_read(k) as h:
                assert h.source == "cpu"
                assert np.array_equal(h.buffer, payload_for(k, a.chunk_bytes))
        assert a.open_read(KEYS[4]) is None
        assert a.contains(KEYS[0]) and not a.contains(KEYS[4])
        assert a.open_write(KEYS[0], None) is None  # already stored
        st = a.stats()
        assert st["stored_chunks"] == 3 and st["referenced_chunks"] == 0 and st["server_holds"] == 0
        assert st["load_failures"] == 1  # KEYS[4]: asked for, not served (kvtier_load_failures_total)
        a.close()
        wait_until(lambda: srv.num_sessions() == 0, what="session drop")


def test_socket_is_owner_only(short_dir: Path) -> None:
    with start_server(short_dir):
        mode = os.stat(short_dir / "s.sock").st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_a_second_server_on_the_same_socket_is_refused(short_dir: Path) -> None:
    with start_server(short_dir):
        with pytest.raises(RuntimeError, match="another kvtier server"):
            start_server(short_dir)


def test_two_clients_share_chunks_and_leases_follow_client_ids(short_dir: Path) -> None:
    with start_server(short_dir) as srv:
        a = connect(short_dir / "s.sock", client_id="engine-a")
        b = connect(short_dir / "s.sock", client_id="engine-b")
        b_worker = connect(short_dir / "s.sock", client_id="engine-b")
        store(a, KEYS[:2])
        a.flush(1)  # commits are one-way: a round trip makes them visible to everyone
        assert b.lookup_keys(KEYS[:2], "req-1").num_tokens == 64
        with b.open_read(KEYS[1]) as h:
            assert np.array_equal(h.buffer, payload_for(KEYS[1], b.chunk_bytes))
        m = srv.hosts()[0].manager
        assert len(m.leases) == 1
        a.release("req-1")  # another engine's request with the same id: not its lease
        assert len(m.leases) == 1
        b_worker.release("req-1")  # same engine, other connection (scheduler vs worker)
        assert len(m.leases) == 0
        for c in (a, b, b_worker):
            c.close()


def test_disconnect_releases_holds_but_keeps_commits(short_dir: Path) -> None:
    with start_server(short_dir, cpu_chunks=4) as srv:
        a = connect(short_dir / "s.sock")
        store(a, KEYS[:1])
        assert a.open_write(KEYS[1], None) is not None  # reserved, never committed
        h = a.open_read(KEYS[0])
        assert h is not None
        assert a.lookup_keys(KEYS[:1], "r").num_tokens == 32
        m = srv.hosts()[0].manager
        assert srv.total_holds() == 2 and len(m.leases) == 1
        a.close()
        wait_until(lambda: srv.num_sessions() == 0, what="session drop")
        assert srv.total_holds() == 0 and len(m.leases) == 0
        assert m.cpu.referenced_chunks() == 0
        assert m.contains(KEYS[0]) and not m.contains(KEYS[1])
        pool = srv.hosts()[0].pool
        assert pool.num_free == pool.num_slots - 1
        h.close()  # a handle of a dead connection closes quietly


def test_only_own_reservations_can_be_committed(short_dir: Path) -> None:
    with start_server(short_dir) as srv:
        a = connect(short_dir / "s.sock", sync_commit=True)
        b = connect(short_dir / "s.sock", client_id="engine-b", sync_commit=True)
        assert a.open_write(KEYS[0], None) is not None
        b._writes[KEYS[0]] = b._link.conn.gen  # forge: b pretends it reserved a's key
        b.commit(KEYS[0], None)
        assert b.counters.lost_stores == 1  # refused by the server
        assert not srv.hosts()[0].manager.contains(KEYS[0])
        a.commit(KEYS[0], None)
        assert srv.hosts()[0].manager.contains(KEYS[0])
        a.close()
        b.close()


def test_reserve_many_in_one_round_trip(short_dir: Path) -> None:
    with start_server(short_dir, max_holds_per_client=4) as srv:
        a = connect(short_dir / "s.sock")
        store(a, KEYS[:1])
        bufs = a.open_write_many(KEYS[:3], chain_parents(KEYS[:3]))
        assert bufs[0] is WriteSkip.PRESENT  # KEYS[0] already stored: the reply says why
        assert isinstance(bufs[1], np.ndarray) and isinstance(bufs[2], np.ndarray)
        for k, b in zip(KEYS[1:3], bufs[1:]):
            b[:] = payload_for(k, a.chunk_bytes)
            a.commit(k, None)
        a.flush()  # commits are one-way: wait until they are applied
        over = a.open_write_many(KEYS[3:8], chain_parents(KEYS[3:8]))  # more than the holds bound (4): refused whole
        assert over == [WriteSkip.NO_ROOM] * 5  # a refused call: stop storing
        b = connect(short_dir / "s.sock")
        with b.open_read(KEYS[2]) as h:
            assert np.array_equal(h.buffer, payload_for(KEYS[2], b.chunk_bytes))
        a.close()
        b.close()
        wait_until(lambda: srv.total_holds() == 0)
        with pytest.raises(P.ProtocolError):
            P.ReserveMany.from_fields({"keys": KEYS[0] + KEYS[0]})  # duplicates refused


def test_holds_per_client_are_bounded(short_dir: Path) -> None:
    with start_server(short_dir, max_holds_per_client=2) as srv:
        a = connect(short_dir / "s.sock")
        assert a.open_write(KEYS[0], None) is not None and a.open_write(KEYS[1], None) is not None
        assert a.open_write(KEYS[2], None) is None
        assert a.counters.error_replies == 1 and a.connected
        a.abort(KEYS[0])
        assert a.open_write(KEYS[2], None) is not None
        a.close()
        wait_until(lambda: srv.total_holds() == 0)


@pytest.mark.slow
def test_other_namespace_or_chunk_bytes_is_refused(short_dir: Path) -> None:
    with start_server(short_dir, max_namespaces=1):  # a full namespace table refuses another model
        a = connect(short_dir / "s.sock")
        other = ServiceClient(str(short_dir / "s.sock"), small_namespace(model="other"), "x", wait_connected_s=1.0)
        assert not other.connected and other.counters.connect_failures >= 1
        assert other.lookup_keys(KEYS).num_tokens == 0
        other.close()
        # A client lying about chunk_bytes is refused at register.
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(short_dir / "s.sock"))
        ns = small_namespace()
        s.sendall(P.encode_request(P.Register("liar", 1, ns, ns.digest(), ns.chunk_bytes + 1), 1))
        reply = _read_reply(s)
        assert reply["ok"] is False and reply["code"] == "namespace_mismatch"
        s.close()
        a.close()


def test_server_hosts_several_namespaces_when_allowed(short_dir: Path) -> None:
    with start_server(short_dir, cpu_chunks=8, max_namespaces=2) as srv:
        a = connect(short_dir / "s.sock")
        b = connect(short_dir / "s.sock", small_namespace(rank=1, world_size=2), "engine-a")
        store(a, KEYS[:1])
        a.flush(1)
        assert b.lookup_keys(KEYS[:1]).num_tokens == 0  # namespaces never share chunks
        # Each segment spans the whole capacity; the two share it dynamically (tests/test_service_namespaces.py).
        assert len(srv.hosts()) == 2 and all(h.pool.num_slots == 8 for h in srv.hosts())
        a.close()
        b.close()


def _read_reply(s: socket.socket) -> dict:
    head = s.recv(4, socket.MSG_WAITALL)
    (n,) = P.HEADER.unpack(head)
    return P.unpack_body(s.recv(n, socket.MSG_WAITALL))


@pytest.mark.slow
def test_tcp_listener_requires_the_token(short_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="token"):
        start_server(short_dir, tcp_host="127.0.0.1")
    with start_server(short_dir, tcp_host="127.0.0.1", token="s3cret") as srv:
        host, port = srv.tcp_address
        assert host == "127.0.0.1"
        bad = ServiceClient(f"tcp://{host}:{port}", small_namespace(), "x", token="wrong", wait_connected_s=1.0)
        assert not bad.connected
        bad.close()
        good = connect(f"tcp://{host}:{port}", token="s3cret")
        store(good, KEYS[:1])
        with good.open_read(KEYS[0]) as h:  # the segment is mapped through /proc/<pid>/fd
            assert np.array_equal(h.buffer, payload_for(KEYS[0], good.chunk_bytes))
        good.close()


def test_unreachable_server_gives_misses_within_the_timeout(short_dir: Path) -> None:
    c = ServiceClient(str(short_dir / "none.sock"), small_namespace(), "x", timeout_s=0.2)
    t0 = time.monotonic()
    assert c.lookup_keys(KEYS).num_tokens == 0
    assert c.open_write(KEYS[0], None) is None and c.open_read(KEYS[0]) is None
    assert not c.contains(KEYS[0])
    c.commit(KEYS[0], None)
    c.release("r")
    assert c.flush(0.1) is False
    assert c.stats()["client_connected"] == 0
    assert time.monotonic() - t0 < 5  # hang guard: calls do not wait for the server
    c.close()


def test_a_hung_server_gives_misses_within_the_timeout(short_dir: Path) -> None:
    """A server that accepts and then never answers (stopped, deadlocked) must not hang the engine."""
    with start_server(short_dir) as srv:
        c = connect(short_dir / "s.sock", timeout_s=0.3)
        store(c, KEYS[:1])
        c.flush(1)
        stall = threading.Event()
        table = srv._handlers.table
        original = table["lookup"]
        table["lookup"] = lambda h, reg, r: (stall.wait(10), original(h, reg, r))[1]
        t0 = time.monotonic()
        assert c.lookup_keys(KEYS[:1]).num_tokens == 0
        assert time.monotonic() - t0 < 5  # hang guard (the bound is timeout_s)
        assert c.counters.timeouts == 1 and not c.connected
        stall.set()
        table["lookup"] = original
        wait_until(lambda: c.connected, what="reconnect")
        assert c.lookup_keys(KEYS[:1]).num_tokens == 32
        c.close()


def test_prefetch_and_clear(short_dir: Path) -> None:
    with start_server(short_dir, cpu_chunks=2, disk=True) as srv:
        a = connect(short_dir / "s.sock")
        for k in KEYS[:3]:  # 2 CPU slots: the first chunk ends up on disk only
            store(a, [k])
            assert a.flush(5)
        m = srv.hosts()[0].manager
        wait_until(lambda: m.disk is not None and len(m.disk) == 3, what="write-behind")
        assert m.where(KEYS[0]) == "disk"
        assert a.prefetch([KEYS[0]]) == 1
        wait_until(lambda: m.where(KEYS[0]) == "cpu", what="prefetch promotion")
        removed = a.clear()
        assert removed["cpu"] == 2 and removed["disk"] == 3
        assert a.lookup_keys(KEYS[:1]).num_tokens == 0
        a.close()


def test_metrics_and_health_endpoints(short_dir: Path) -> None:
    with start_server(short_dir, metrics_port=0) as srv:
        a = connect(short_dir / "s.sock")
        store(a, KEYS[:2])
        a.lookup_keys(KEYS[:3], "r")
        with a.open_read(KEYS[0]):
            pass
        base = f"http://127.0.0.1:{srv.metrics_port}"
        health = json.loads(urllib.request.urlopen(base + "/health").read())
        assert health["status"] == "ok" and health["clients"] == 1
        text = urllib.request.urlopen(base + "/metrics").read().decode()
        values = {
            line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"
        }
        assert values['kvtier_lookup_hit_tokens_total{tier="cpu"}'] == 64
        assert values["kvtier_lookups_total"] == 1
        assert values["kvtier_committed_bytes_total"] == 2 * a.chunk_bytes
        assert values["kvtier_served_bytes_total"] == a.chunk_bytes
        assert values["kvtier_active_clients"] == 1
        assert values["kvtier_leases"] == 1
        assert values['kvtier_server_request_seconds_count{op="lookup"}'] == 1
        assert "kvtier_cpu_evicted_chunks_total" in values
        a.close()


def test_open_read_many_in_one_round_trip(short_dir: Path) -> None:
    with start_server(short_dir) as srv:
        a = connect(short_dir / "s.sock")
        store(a, KEYS[:3])
        handles = a.open_read_many([(KEYS[0], None), (KEYS[5], None), (KEYS[2], KEYS[1])])
        assert handles[1] is None
        for k, h in ((KEYS[0], handles[0]), (KEYS[2], handles[2])):
            assert h is not None and np.array_equal(h.buffer, payload_for(k, a.chunk_bytes))
            h.close()
        assert a.open_read_many([]) == []
        a.flush(1)
        assert srv.total_holds() == 0
        a.close()


def chain_store(c: ServiceClient, keys: list[bytes]) -> int:
    """Store a prompt's chain as the connector does: one reserve_many, fill, commit; a chunk being
    written by someone else (IN_FLIGHT) is skipped, anything else that got no slot ends the chain."""
    stored, parent = 0, None
    for key, got in zip(keys, c.open_write_many(keys, chain_parents(keys))):
        if isinstance(got, np.ndarray):
            got[:] = payload_for(key, c.chunk_bytes)
            c.commit(key, parent)
            stored += 1
        elif got is not WriteSkip.IN_FLIGHT and got is not WriteSkip.PRESENT:
            break
        parent = key
    return stored


def test_concurrent_writer_does_not_drop_the_rest_of_the_chain(short_dir: Path) -> None:
    """Issue 8, failing input 5: A holds an uncommitted reservation of the shared head; B stores
    head + 2 unique chunks. B's unique chunks were dropped (a third client found 1 of 3); right: 3 of 3."""
    with start_server(short_dir) as srv:
        a = connect(short_dir / "s.sock", client_id="engine-a", sync_commit=True)
        b = connect(short_dir / "s.sock", client_id="engine-b", sync_commit=True)
        c = connect(short_dir / "s.sock", client_id="engine-c")
        head, u1, u2 = KEYS[0], KEYS[1], KEYS[2]
        (slot,) = a.open_write_many([head], [None])
        assert isinstance(slot, np.ndarray)
        got = b.open_write_many([head, u1, u2], [None, head, u1])
        assert got[0] is WriteSkip.IN_FLIGHT  # was a bare None: indistinguishable from "no room"
        for g in got[1:]:
            assert isinstance(g, np.ndarray)
        b.abort(u1)
        b.abort(u2)
        assert chain_store(b, [head, u1, u2]) == 2
        slot[:] = payload_for(head, a.chunk_bytes)
        a.commit(head, None)
        res = c.lookup_keys([head, u1, u2])
        assert res.num_tokens == 3 * 32 and res.keys == [head, u1, u2]
        for k in (head, u1, u2):
            with c.open_read(k) as h:
                assert np.array_equal(h.buffer, payload_for(k, c.chunk_bytes))
        srv.check_invariants()
        assert b.open_write_many([head, u1], [None, head]) == [WriteSkip.PRESENT, WriteSkip.PRESENT]
        for x in (a, b, c):
            x.close()
        wait_until(lambda: srv.total_holds() == 0)


@pytest.mark.slow
def test_socket_dir_must_be_private_to_the_server_and_clients(short_dir: Path) -> None:
    """Issue 14, failing input 2: a group/other-writable socket directory is refused on both sides."""
    shared = short_dir / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(P.UnsafeSocketDir):
        start_server(shared)
    with start_server(short_dir):
        short_dir.chmod(0o775)
        try:
            c = ServiceClient(str(short_dir / "s.sock"), small_namespace(), "x", wait_connected_s=1.0)
            assert not c.connected and c.counters.connect_failures >= 1
            c.close()
        finally:
            short_dir.chmod(0o700)


@pytest.mark.slow
@pytest.mark.parametrize("n", [5000, 16_384, 20_000])
def test_a_load_of_many_keys_is_a_clean_miss_and_keeps_the_connection(short_dir: Path, n: int) -> None:
    """A load_many of over 4,096 keys was undecodable (arrays were bounded below MAX_KEYS): the
    server's error lacked the request id and the client dropped its connection."""
    import logging
    from kvtier.protocol.framing import MAX_ARRAY_LEN

    assert P.MAX_KEYS <= MAX_ARRAY_LEN
    with start_server(short_dir) as srv:
        a = connect(short_dir / "s.sock")
        store(a, KEYS[:1])
        lost: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda rec: lost.append(rec.getMessage()) if "connection lost" in rec.getMessage() else None  # type: ignore[method-assign]
        logging.getLogger("kvtier").addHandler(handler)
        try:
            assert a.open_read_many([(bytes([i % 256, i // 256]) * 16, None) for i in range(n)]) == [None] * n
        finally:
            logging.getLogger("kvtier").removeHandler(handler)
        assert not lost
        with a.open_read(KEYS[0]) as h:  # the same connection still serves
            assert h.source == "cpu"
        a.close()
