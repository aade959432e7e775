"""Cache service against hostile or buggy clients (issue 14, items 5-8).

Per-client-id quotas and the reservation timeout (5), namespace squatting (6),
bad registrations and the log (7), writes into the shared pool by any client (8).
Loopback Unix sockets in a temporary directory; every wait is bounded.
"""

from __future__ import annotations

import logging
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import payload_for, small_layout, small_namespace
from kvtier import protocol as P
from kvtier.index.keys import KeyNamespace
from kvtier.service.server import ServerOptions
from kvtier.storage.types import WriteSkip
from service_helpers import connect, store, short_dir, start_server, wait_until  # noqa: F401 (fixture)

KEYS = [bytes([i + 1]) * 32 for i in range(16)]


class Raw:
    """A bare protocol connection (no client library): to read error codes and to misbehave."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(str(path))
        self.buf = bytearray(1 << 20)
        self.rid = 0

    def call(self, req: P.Request) -> dict[str, Any]:
        self.rid += 1
        self.sock.sendall(P.encode_request(req, self.rid))
        reply, _ = P.read_reply(self.sock, self.buf, time.monotonic() + 5)
        return reply

    def register(self, ns: KeyNamespace, client_id: str = "raw", chunk_bytes: int | None = None) -> dict[str, Any]:
        cb = ns.chunk_bytes if chunk_bytes is None else chunk_bytes
        return self.call(P.Register(client_id, 1, ns, ns.digest(), cb))

    def close(self) -> None:
        self.sock.close()


# -- 5. one client starves everyone ------------------------------------------------------------
def test_one_client_id_over_many_connections_stays_within_its_quota(short_dir: Path) -> None:
    # 16 slots, a quarter per client id: before, each of the 8 connections could hold 1,024.
    with start_server(short_dir, cpu_chunks=16, client_hold_share=0.25) as srv:
        hoarder = [connect(short_dir / "s.sock", client_id="hoarder") for _ in range(8)]
        got = 0
        for i, c in enumerate(hoarder):
            for k in KEYS[2 * i : 2 * i + 2]:
                got += c.open_write(k, None) is not None
        assert got == 4
        srv.check_invariants()
        b = connect(short_dir / "s.sock", client_id="engine-b")
        store(b, [bytes([0xB0 + i]) * 32 for i in range(4)])
        st = b.stats()
        assert st["client_max_holds"] == 4 and st["quota_refusals"] == 12
        c = connect(short_dir / "s.sock", client_id="engine-c")  # a batch over the quota: its prefix fits
        got = c.open_write_many([bytes([0xC0 + i]) * 32 for i in range(6)], [None] * 6)
        assert [isinstance(g, np.ndarray) for g in got] == [True] * 4 + [False] * 2
        assert got[4] == WriteSkip.NO_ROOM
        c.close()
        for c in hoarder:
            c.close()
        b.close()
        wait_until(lambda: srv.num_sessions() == 0, what="sessions gone")
        assert not any(h.manager.cpu.check_invariants() for h in srv.hosts())


@pytest.mark.slow
def test_hoarded_reservations_expire_then_another_client_stores(short_dir: Path) -> None:
    with start_server(short_dir, cpu_chunks=4, client_hold_share=1.0, reservation_timeout_s=0.3) as srv:
        hoarder = Raw(short_dir / "s.sock")
        assert hoarder.register(small_namespace(), "hoarder")["ok"]
        reply = hoarder.call(P.ReserveMany(KEYS[:4], None))
        assert reply["ok"] and all(s is not None for s in reply["slots"])
        b = connect(short_dir / "s.sock", client_id="engine-b")
        assert b.open_write(KEYS[8], None) is None  # the pool is held
        wait_until(lambda: srv.total_holds() == 0, timeout_s=10, what="reservations expired")
        store(b, KEYS[8:11])  # slots are free again
        late = hoarder.call(P.Commit(KEYS[0], None))
        assert not late["ok"] and late["code"] == "expired"
        assert hoarder.call(P.Abort(KEYS[1]))["ok"]  # aborting an expired reservation is not an error
        assert srv.hosts()[0].stats()["expired_reservations"] == 4
        srv.check_invariants()
        hoarder.close()
        b.close()


def test_leases_beyond_the_client_quota_are_a_miss_not_pinned(short_dir: Path) -> None:
    with start_server(short_dir, cpu_chunks=16, client_lease_share=0.25) as srv:
        a = connect(short_dir / "s.sock", client_id="engine-a")
        store(a, KEYS[:8])
        m = srv.hosts()[0].manager
        leaser = [connect(short_dir / "s.sock", client_id="leaser") for _ in range(2)]
        cs = small_namespace().chunk_size
        assert leaser[0].lookup_keys(KEYS[:8], "r1").num_tokens == 4 * cs  # narrowed to its quota of 4
        assert m.leases.pinned_keys == 4
        assert leaser[1].lookup_keys(KEYS[:8], "r2").num_tokens == 0  # same client id, other connection
        assert m.leases.pinned_keys == 4
        assert leaser[0].lookup_keys(KEYS[:8], "r1").num_tokens == 4 * cs  # a repeated lookup replaces its lease
        leaser[0].release("r1")
        assert leaser[1].lookup_keys(KEYS[:8], "r2").num_tokens == 4 * cs
        assert a.lookup_keys(KEYS[:8], "a1").num_tokens == 4 * cs  # other client ids have their own quota
        assert a.lookup_keys(KEYS[:8]).num_tokens == 8 * cs  # lookups without a lease are not limited
        m.leases.check_invariants()
        for c in (a, *leaser):
            c.close()
        wait_until(lambda: m.leases.pinned_keys == 0, what="leases ended")


# -- 6. namespace squatting ----------------------------------------------------------------------
@pytest.mark.slow
def test_a_squatters_namespace_is_released_once_unused(short_dir: Path) -> None:
    with start_server(short_dir, max_namespaces=1, namespace_idle_s=0.2) as srv:
        squatter = Raw(short_dir / "s.sock")
        assert squatter.register(small_namespace(model="squatter/any"), "squatter")["ok"]
        engine = Raw(short_dir / "s.sock")
        refused = engine.register(small_namespace(), "engine")
        assert not refused["ok"] and refused["code"] == "namespace_mismatch"  # in use: refused
        squatter.close()
        wait_until(lambda: not srv.hosts(), timeout_s=10, what="idle namespace released")
        assert engine.register(small_namespace(), "engine")["ok"]
        assert [h.namespace.model for h in srv.hosts()] == ["test/tiny-model"]
        engine.close()


def test_an_unused_namespace_makes_room_at_once(short_dir: Path) -> None:
    with start_server(short_dir, max_namespaces=1, namespace_idle_s=3600) as srv:
        squatter = Raw(short_dir / "s.sock")
        assert squatter.register(small_namespace(model="squatter/any"), "squatter")["ok"]
        squatter.close()
        wait_until(lambda: srv.num_sessions() == 0, what="squatter gone")
        a = connect(short_dir / "s.sock")
        store(a, KEYS[:2])
        a.close()


def test_allow_list_refuses_other_models(short_dir: Path) -> None:
    with start_server(short_dir, max_namespaces=2, allowed_models=("test/*",)) as srv:
        squatter = Raw(short_dir / "s.sock")
        reply = squatter.register(small_namespace(model="squatter/any"), "squatter")
        assert not reply["ok"] and reply["code"] == "not_allowed" and "squatter/any" in reply["error"]
        assert not srv.hosts()
        a = connect(short_dir / "s.sock")
        store(a, KEYS[:1])
        a.close()
        squatter.close()


def test_namespace_cap_per_client_and_two_namespaces_share_the_server(short_dir: Path) -> None:
    with start_server(short_dir, max_namespaces=3, max_namespaces_per_client=1) as srv:
        x1, x2 = Raw(short_dir / "s.sock"), Raw(short_dir / "s.sock")
        assert x1.register(small_namespace(model="x/one"), "x")["ok"]
        reply = x2.register(small_namespace(model="x/two"), "x")
        assert not reply["ok"] and reply["code"] == "not_allowed"
        a = connect(short_dir / "s.sock", client_id="engine-a")
        b = connect(short_dir / "s.sock", ns=small_namespace(model="test/other"), client_id="engine-b")
        store(a, KEYS[:2])
        store(b, KEYS[:2])
        assert len(srv.hosts()) == 3
        for c in (a, b, x1, x2):
            c.close()


def test_namespace_options_are_validated(short_dir: Path) -> None:
    with pytest.raises(ValueError, match="client_hold_share"):
        ServerOptions(socket_path="x", client_hold_share=0)
    with pytest.raises(ValueError, match="reservation_timeout_s"):
        ServerOptions(socket_path="x", reservation_timeout_s=-1)
    with pytest.raises(ValueError, match="allowed_models"):
        ServerOptions(socket_path="x", allowed_models=("",))


# -- 7. log flood ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "ns, chunk_bytes, code",
    [
        (small_namespace(layout=small_layout(dtype="foo")), 2048, "bad_namespace"),
        (small_namespace(layout=small_layout(dtype="object")), 2048, "bad_namespace"),
        (small_namespace(layout=small_layout(head_dim=1 << 20)), 2048, "bad_namespace"),
        (small_namespace(), 4096, "namespace_mismatch"),
    ],
)
def test_bad_registrations_are_refused_with_a_code_and_bounded_logs(
    short_dir: Path, caplog: pytest.LogCaptureFixture, ns: KeyNamespace, chunk_bytes: int, code: str
) -> None:
    caplog.set_level(logging.INFO, logger="kvtier")
    with start_server(short_dir) as srv:
        raw = Raw(short_dir / "s.sock")
        answered = 0
        for _ in range(1000):
            try:
                reply = raw.register(ns, "bad-client", chunk_bytes)
            except OSError:  # the handshake timeout closed this connection: go on with a new one
                raw.close()
                raw = Raw(short_dir / "s.sock")
                continue
            assert not reply["ok"] and reply["code"] == code, reply
            answered += 1
        raw.close()
        assert answered > 900
        assert not srv.hosts()
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) <= 3, [r.getMessage() for r in lines]
    assert not any(r.exc_info for r in caplog.records), "a traceback was logged"


def test_rate_limited_log_counts_what_it_skipped() -> None:
    from kvtier.service.ratelog import RateLimitedLog

    now = [0.0]
    rl = RateLimitedLog(logging.getLogger("kvtier.test"), interval_s=10, max_keys=2, clock=lambda: now[0])
    assert rl.warning("a", "r", "x")
    assert not rl.warning("a", "r", "x")
    assert rl.warning("a", "other", "x") and rl.warning("b", "r", "x")
    now[0] = 11
    assert rl.warning("a", "r", "x")
    assert rl.suppressed == 1
    few = RateLimitedLog(logging.getLogger("kvtier.test"), interval_s=10, max_lines=3, clock=lambda: now[0])
    assert sum(few.warning(f"id-{i}", "r", "x") for i in range(100)) == 3  # a new id per request is bounded too


# -- 8. shared-memory writes by any client ---------------------------------------------------------
def test_a_scribbled_chunk_is_a_miss_never_the_scribbled_bytes(short_dir: Path) -> None:
    with start_server(short_dir, metrics_port=0) as srv:
        a = connect(short_dir / "s.sock", client_id="engine-a")
        store(a, KEYS[:2])
        host = srv.hosts()[0]
        wait_until(lambda: host.manager.cpu.contains(KEYS[1]), what="commit")
        h = host.manager.open_read(KEYS[1])
        slot = host.pool.slot_of(h.buffer)
        h.close()
        # A hostile client writes into the committed slot through its own read-write mapping.
        evil = connect(short_dir / "s.sock", client_id="evil")
        view = evil._link.conn.slot(slot)
        assert view is not None
        view[:] = 0xEE
        b = connect(short_dir / "s.sock", client_id="engine-b")
        assert b.open_read(KEYS[1]) is None  # a miss, not 0xEE bytes
        assert host.sums.corrupt == 1 and not host.manager.cpu.contains(KEYS[1])  # dropped and counted
        with b.open_read(KEYS[0]) as good:  # the untouched chunk is still served
            assert np.array_equal(good.buffer, payload_for(KEYS[0], b.chunk_bytes))
        assert b.stats()["corrupt_chunks"] == 1
        text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5).read().decode()
        assert "kvtier_corrupt_chunks_total 1.0" in text
        for c in (a, evil, b):
            c.close()


def test_write_behind_skips_a_chunk_that_fails_its_checksum() -> None:
    from kvtier.service.integrity import ChunkSums, verify_writes

    class Tier:
        def __init__(self) -> None:
            self.got: list[bytes] = []

        def put_many(self, items: list[Any]) -> list[bool]:
            self.got += [w.key for w in items]
            return [True] * len(items)

    class W:
        def __init__(self, key: bytes, payload: np.ndarray) -> None:
            self.key, self.payload = key, payload

    sums = ChunkSums(4, lambda k: True)
    good, bad = np.full(64, 1, np.uint8), np.full(64, 2, np.uint8)
    sums.record(b"g" * 32, good)
    sums.record(b"b" * 32, bad)
    bad[0] = 9  # scribbled after commit
    tier = verify_writes(Tier(), sums)
    assert tier.put_many([W(b"g" * 32, good), W(b"b" * 32, bad)]) == [True, False]
    assert tier.got == [b"g" * 32] and sums.corrupt == 1
