"""Whole-message deadlines and connection bounds of the framed endpoints.

A deadline bounds a whole frame (header and body), a whole handshake, a whole HTTP
request and a client's whole connect + register, not each ``recv``: a peer that drips
one byte at a time is cut off. The lookup endpoint evicts its oldest waiting connection
when full; ``max_clients`` bounds registered connections. Loopback only, bounded waits.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import msgpack
import pytest
from conftest import CHUNK, payload_for, small_namespace
from service_helpers import connect, short_dir, start_server, wait_until  # noqa: F401

from kvtier import protocol as P
from kvtier.config import KVTierConfig
from kvtier.protocol.framing import recv_exact, time_left
from kvtier.service.client import ServiceClient
from kvtier.service.listener import ConnLimits, FrameServer, bind_unix
from kvtier.service.lookup_endpoint import LookupClient, LookupServer
from kvtier.storage.manager import StorageManager

NS = small_namespace()


def drip(s: socket.socket, data: bytes, step_s: float, for_s: float) -> bool:
    """Send ``data`` a byte every ``step_s`` for up to ``for_s`` seconds; False once the peer closed."""
    t0 = time.monotonic()
    try:
        for i in range(len(data)):
            if time.monotonic() - t0 > for_s:
                break
            s.send(data[i:i + 1])
            time.sleep(step_s)
        s.settimeout(for_s)
        return bool(s.recv(65536))
    except OSError:
        return False


class Echo:
    """A :class:`FrameServer` endpoint answering every frame with ``{"ok": True}``."""

    def __init__(self) -> None:
        self.dropped = 0
        self.busy = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def open(self, sock: socket.socket, kind: str) -> object:
        return object()

    def handle(self, session: object, body: bytearray) -> tuple[dict[str, Any] | None, int | None]:
        self.busy.set()
        self.release.wait(10)
        return {"v": P.PROTOCOL_VERSION, "id": 1, "ok": True}, None

    def drop(self, session: object) -> None:
        self.dropped += 1

    def frame_too_large(self, session: object) -> None:
        pass


@pytest.fixture
def echo_server(short_dir: Path) -> Iterator[tuple[str, FrameServer[object], Echo]]:
    path = str(short_dir / "e.sock")
    ep = Echo()
    frames: FrameServer[object] = FrameServer(ep, "test-echo", ConnLimits(frame_timeout_s=0.6, max_connections=2))
    unix = bind_unix(path)
    frames.listen(unix.sock)
    try:
        yield path, frames, ep
    finally:
        ep.release.set()
        frames.close()
        unix.remove()


def dial(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(path)
    return s


def frame(obj: dict[str, Any]) -> bytes:
    body = msgpack.packb(obj)
    return struct.pack(">I", len(body)) + body


# -- the helper --------------------------------------------------------------------------------
def test_recv_exact_deadline_bounds_the_whole_view() -> None:
    a, b = socket.socketpair()
    try:
        def feed() -> None:
            for _ in range(10):
                try:
                    b.send(b"x")
                except OSError:
                    return
                time.sleep(0.1)

        threading.Thread(target=feed, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            recv_exact(a, memoryview(bytearray(10)), time.monotonic() + 0.35)
        assert time.monotonic() - t0 < 0.8
        with pytest.raises(TimeoutError):
            time_left(a, time.monotonic() - 1)
    finally:
        a.close()
        b.close()


# -- FrameServer -------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("part", ["header", "body"])
def test_a_drip_fed_frame_is_closed_at_the_frame_deadline(echo_server: Any, part: str) -> None:
    path, frames, _ = echo_server
    s = dial(path)
    data = frame({"op": "health", "pad": "x" * 8})
    if part == "body":
        s.sendall(data[:4])
        data = data[4:]
    t0 = time.monotonic()
    assert not drip(s, data, 0.15, 3.0), "a frame dripped past its deadline was served"
    assert time.monotonic() - t0 < 2.5
    assert frames.timeouts >= 1
    s.close()


def test_a_full_endpoint_evicts_its_oldest_waiting_connection(echo_server: Any) -> None:
    path, frames, _ = echo_server
    old = [dial(path), dial(path)]
    old[0].sendall(b"\x00")  # mid-header, stalled
    new = dial(path)
    new.sendall(frame({"op": "health"}))
    assert new.recv(64), "the new connection was not served"
    old[0].settimeout(2)
    assert old[0].recv(64) == b"", "the oldest waiting connection was not closed"
    assert frames.evicted_connections == 1
    for s in old + [new]:
        s.close()


def test_a_full_endpoint_refuses_only_while_every_connection_is_busy(echo_server: Any) -> None:
    path, frames, ep = echo_server
    ep.release.clear()
    busy = [dial(path), dial(path)]
    for s in busy:
        ep.busy.clear()
        s.sendall(frame({"op": "health"}))
        assert ep.busy.wait(5)
    wait_until(lambda: not frames._waiting, 5, "both handling")
    extra = dial(path)
    r = msgpack.unpackb(extra.recv(4096)[4:])
    assert r["code"] == "busy"
    ep.release.set()
    for s in busy:
        assert s.recv(64)
        s.close()
    extra.close()


# -- lookup endpoint ---------------------------------------------------------------------------
def test_stalled_sockets_are_evicted_for_the_scheduler(short_dir: Path) -> None:
    m = StorageManager(KVTierConfig(chunk_size=CHUNK, cpu_capacity=8 * NS.chunk_bytes), NS)
    path = str(short_dir / "l.sock")
    srv = LookupServer(m, path, frame_timeout_s=60, max_connections=4)
    stalled = []
    try:
        keys = m.keys(list(range(CHUNK)))
        buf = m.open_write(keys[0], None)
        assert buf is not None
        buf[:] = payload_for(keys[0], NS.chunk_bytes)
        m.commit(keys[0], None)
        for _ in range(8):
            x = socket.socket(socket.AF_UNIX)
            x.connect(path)
            x.sendall(b"\x00\x00")
            stalled.append(x)
        cl = LookupClient(path, CHUNK, timeout_s=2.0)
        try:
            assert cl.lookup_keys(keys, None).num_tokens == CHUNK
        finally:
            cl.close()
        assert srv._frames.evicted_connections >= 5
    finally:
        for x in stalled:
            x.close()
        srv.close()
        m.close()


# -- cache server ------------------------------------------------------------------------------
def register_frame(client_id: str) -> bytes:
    return P.encode_request(P.Register(client_id, os.getpid(), NS, NS.digest(), NS.chunk_bytes), 1)


def test_a_register_beyond_max_clients_is_refused_and_its_place_comes_back(short_dir: Path) -> None:
    with start_server(short_dir, max_clients=2) as srv:
        a, b = connect(short_dir / "s.sock", client_id="a"), connect(short_dir / "s.sock", client_id="b")
        try:
            assert a.connected and b.connected
            s = dial(str(short_dir / "s.sock"))
            s.sendall(register_frame("c"))
            reply, _ = P.read_reply(s, bytearray(1 << 16), time.monotonic() + 5)
            assert reply["ok"] is False and reply["code"] == "busy" and "max-clients" in reply["error"]
            assert s.recv(64) == b"", "the refused connection stays open"
            s.close()
            assert srv.sessions.registered() == 2
            b.close()
            wait_until(lambda: srv.sessions.registered() == 1, 5, "b's place given back")
            c = connect(short_dir / "s.sock", client_id="c")
            try:
                assert c.connected
            finally:
                c.close()
            srv.check_invariants()
        finally:
            a.close()
            b.close()


@pytest.mark.slow
def test_a_drip_fed_handshake_is_closed_at_its_deadline(short_dir: Path) -> None:
    with start_server(short_dir, handshake_timeout_s=0.8, frame_timeout_s=30) as srv:
        s = dial(str(short_dir / "s.sock"))
        t0 = time.monotonic()
        assert not drip(s, register_frame("slow"), 0.1, 3.0)
        assert time.monotonic() - t0 < 2.5
        assert srv.sessions.registered() == 0
        s.close()


@pytest.mark.slow
def test_a_drip_fed_http_request_is_closed_at_the_request_deadline(short_dir: Path) -> None:
    with start_server(short_dir, metrics_port=0, http_timeout_s=0.8) as srv:
        assert srv.metrics_port is not None
        s = socket.create_connection(("127.0.0.1", srv.metrics_port), timeout=5)
        t0 = time.monotonic()
        assert not drip(s, b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\nX-Pad: " + b"x" * 40 + b"\r\n\r\n", 0.1, 3.0)
        assert time.monotonic() - t0 < 2.5
        s.close()


# -- the client's connect + register -------------------------------------------------------------
def test_a_server_dripping_its_register_reply_fails_the_connect_in_time(short_dir: Path) -> None:
    path = str(short_dir / "drip.sock")
    ls = socket.socket(socket.AF_UNIX)
    ls.bind(path)
    ls.listen(4)
    stop = threading.Event()

    def serve() -> None:
        ls.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = ls.accept()
            except OSError:
                continue
            c.settimeout(5)
            try:
                c.recv(65536)
                c.send(b"\x00\x00\x00\x40")  # a reply header announcing 64 bytes, then one byte every 0.1 s
                while not stop.is_set():
                    c.send(b"\x80")
                    time.sleep(0.1)
            except OSError:
                pass
            finally:
                c.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        t0 = time.monotonic()
        cl = ServiceClient(path, NS, "drip", timeout_s=0.5, connect_timeout_s=0.5)
        try:
            wait_until(lambda: cl.counters.connect_failures >= 1, 3, "the dripped register reply failed")
            assert time.monotonic() - t0 < 2.5
            assert not cl.connected
        finally:
            cl.close()
    finally:
        stop.set()
        ls.close()
