"""Connections of the cache service under hostile and broken peers (issue 14, items 3, 4, 9).

Idle and half-open sockets, a dead accept loop, token guessing, oversized and
slow frames, HTTP floods. Loopback only, small caps, bounded waits.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import small_namespace
from service_helpers import connect, server_config, short_dir, start_server, wait_until  # noqa: F401

from kvtier import protocol as P
from kvtier.service.auth import AuthThrottle
from kvtier.service.listener import ConnLimits
from kvtier.service.server import ServerOptions

KEYS = [bytes([i + 1]) * 32 for i in range(4)]
TOKEN = "s3cret-token"


# -- helpers --------------------------------------------------------------------------------
def raw_unix(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(path))
    return s


def raw_tcp(addr: tuple[str, int]) -> socket.socket:
    s = socket.create_connection(addr, timeout=5)
    return s


def recv_reply(s: socket.socket) -> dict[str, Any] | None:
    """One reply frame, or None if the server closed the connection."""
    buf = bytearray(P.MAX_FRAME_BYTES + 64)
    try:
        reply, _ = P.read_reply(s, buf, time.monotonic() + 5)
    except (ConnectionResetError, BrokenPipeError):
        return None
    return reply


def closed_by_server(s: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``s`` (EOF or reset) within ``within_s`` seconds (replies are skipped)."""
    s.settimeout(within_s)
    try:
        while True:
            if not s.recv(65536):
                return True
    except TimeoutError:
        return False
    except OSError:
        return True


def register_req(token: str | None, client_id: str = "raw") -> P.Register:
    ns = small_namespace()
    return P.Register(client_id, os.getpid(), ns, ns.digest(), ns.chunk_bytes, token)


def http_get(port: int, path: str, timeout_s: float = 5.0) -> tuple[int, dict[str, Any] | bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as r:
            body = r.read()
            code = r.status
    except urllib.error.HTTPError as exc:
        body, code = exc.read(), exc.code
    return code, (json.loads(body) if path == "/health" else body)


# -- item 3: idle connections, timeouts, caps ---------------------------------------------------
def test_idle_unregistered_connections_never_crowd_out_an_engine(short_dir: Path) -> None:
    # Before: 40 silent sockets took every client slot and the engine got "busy".
    with start_server(short_dir, max_clients=4, max_unauthenticated=4, handshake_timeout_s=30) as srv:
        idle = [raw_unix(short_dir / "s.sock") for _ in range(40)]
        try:
            wait_until(lambda: srv._frames.unauthenticated() <= 4, 5, "unauthenticated cap")
            t0 = time.monotonic()
            c = connect(short_dir / "s.sock", wait_connected_s=5)
            assert c.lookup_keys(KEYS).num_tokens == 0
            assert time.monotonic() - t0 < 2.0
            assert srv._frames.unauthenticated() <= 4 and srv.num_sessions() <= 4 + 4
            c.close()
        finally:
            for s in idle:
                s.close()


def test_silent_connection_closed_at_handshake_deadline(short_dir: Path) -> None:
    with start_server(short_dir, handshake_timeout_s=0.3) as srv:
        s = raw_unix(short_dir / "s.sock")
        assert closed_by_server(s, 5), "a connection that never registers must be closed"
        s.close()
        wait_until(lambda: srv.num_sessions() == 0, 5, "session dropped")


@pytest.mark.slow
def test_dribbling_bytes_does_not_extend_the_handshake(short_dir: Path) -> None:
    with start_server(short_dir, handshake_timeout_s=0.5, frame_timeout_s=30) as srv:
        s = raw_unix(short_dir / "s.sock")
        frame = P.encode_request(P.Health(), 1)
        for _ in range(20):  # a health every 50 ms, never a register: still closed at the deadline
            try:
                s.sendall(frame)
            except OSError:
                break
            time.sleep(0.05)
        assert closed_by_server(s, 5)
        s.close()
        wait_until(lambda: srv.num_sessions() == 0, 5, "session dropped")


def test_idle_registered_client_closed_and_reconnects(short_dir: Path) -> None:
    with start_server(short_dir, idle_timeout_s=0.3) as srv:
        c = connect(short_dir / "s.sock")
        wait_until(lambda: srv.num_sessions() == 0, 5, "idle session closed")
        wait_until(lambda: c.lookup_keys(KEYS[:1]) is not None and srv.num_sessions() == 1, 10, "reconnect")
        c.close()


def test_partial_frame_closed_after_frame_timeout(short_dir: Path) -> None:
    # A header announcing 1 MiB and then silence must not pin a thread and a buffer forever.
    with start_server(short_dir, frame_timeout_s=0.3, idle_timeout_s=60) as srv:
        c = connect(short_dir / "s.sock")
        s = raw_unix(short_dir / "s.sock")
        s.sendall(P.encode_request(register_req(None), 1))
        assert recv_reply(s)["ok"]  # type: ignore[index]
        s.sendall(P.HEADER.pack(P.MAX_FRAME_BYTES) + b"\x00" * 1000)
        assert closed_by_server(s, 5)
        s.close()
        assert c.lookup_keys(KEYS).num_tokens == 0  # the others are unaffected
        wait_until(lambda: srv.num_sessions() == 1, 5)
        c.close()


def test_client_that_never_reads_replies_is_closed(short_dir: Path) -> None:
    # Replies pile up only in the kernel's socket buffers: a reply that cannot be sent within
    # frame_timeout_s closes the connection instead of pinning its thread (and holds) forever.
    with start_server(short_dir, frame_timeout_s=0.3) as srv:
        s = raw_unix(short_dir / "s.sock")
        s.sendall(P.encode_request(register_req(None), 1))
        assert recv_reply(s)["ok"]  # type: ignore[index]
        burst = P.encode_request(P.Health(), 2) * 1000

        def flood() -> None:
            deadline = time.monotonic() + 10
            try:
                while time.monotonic() < deadline:
                    s.sendall(burst)
            except OSError:
                return

        t = threading.Thread(target=flood)
        t.start()
        wait_until(lambda: srv.num_sessions() == 0, 8, "the non-reading client closed")
        t.join(12)
        s.close()


def test_frame_bounds_before_and_after_registration(short_dir: Path) -> None:
    with start_server(short_dir) as srv:
        # Before registering: 64 KiB at most (a register is < 1 KiB).
        s = raw_unix(short_dir / "s.sock")
        s.sendall(P.HEADER.pack(64 * 1024 + 1))
        r = recv_reply(s)
        assert r is not None and r["code"] == P.ErrorCode.TOO_LARGE
        assert closed_by_server(s, 5)
        s.close()
        # After: a body of exactly the maximum is read and rejected, the connection lives on.
        s = raw_unix(short_dir / "s.sock")
        s.sendall(P.encode_request(register_req(None), 1))
        assert recv_reply(s)["ok"]  # type: ignore[index]
        s.sendall(P.HEADER.pack(P.MAX_FRAME_BYTES) + b"\xc1" * P.MAX_FRAME_BYTES)
        r = recv_reply(s)
        assert r is not None and r["code"] == P.ErrorCode.BAD_MSGPACK
        s.sendall(P.encode_request(P.Health(), 2))
        assert recv_reply(s)["ok"]  # type: ignore[index]
        # One byte more: too large, and the stream is closed.
        s.sendall(P.HEADER.pack(P.MAX_FRAME_BYTES + 1))
        r = recv_reply(s)
        assert r is not None and r["code"] == P.ErrorCode.TOO_LARGE
        assert closed_by_server(s, 5)
        s.close()
        wait_until(lambda: srv.num_sessions() == 0, 5)


# -- item 9: TCP authentication ---------------------------------------------------------------
def test_tcp_serves_nothing_before_a_valid_token_and_backs_off(short_dir: Path) -> None:
    with start_server(
        short_dir, tcp_host="127.0.0.1", token=TOKEN, auth_backoff_s=0.3, auth_backoff_max_s=0.6
    ) as srv:
        addr = srv.tcp_address
        assert addr is not None
        s = raw_tcp(addr)
        s.sendall(P.encode_request(P.Health(), 1))  # before: answered without a token
        r = recv_reply(s)
        assert r is not None and r["code"] == P.ErrorCode.NOT_REGISTERED
        s.sendall(P.encode_request(register_req("wrong"), 2))
        r = recv_reply(s)
        assert r is not None and r["code"] == P.ErrorCode.AUTH
        assert closed_by_server(s, 5), "a failed token closes the connection"
        s.close()
        # The right token during the back-off is not even compared.
        s = raw_tcp(addr)
        s.sendall(P.encode_request(register_req(TOKEN), 3))
        r = recv_reply(s)
        assert r is not None and r["code"] == P.ErrorCode.AUTH and "retry in" in r["error"]
        s.close()
        time.sleep(0.35)
        s = raw_tcp(addr)
        s.sendall(P.encode_request(register_req(TOKEN), 4))
        r = recv_reply(s)
        assert r is not None and r["ok"], r
        s.sendall(P.encode_request(P.Health(), 5))
        assert recv_reply(s)["ok"]  # type: ignore[index]
        s.close()
        assert srv._health_state()[1]["connections"]["server_auth_failures"] == 1


@pytest.mark.slow
def test_token_guessing_is_throttled(short_dir: Path) -> None:
    # Before: ~4,800 guesses/s on one connection. Now one guess per back-off per address.
    with start_server(short_dir, tcp_host="127.0.0.1", token=TOKEN, auth_backoff_s=5, auth_backoff_max_s=5) as srv:
        assert srv.tcp_address is not None
        compared = 0
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            s = raw_tcp(srv.tcp_address)
            s.sendall(P.encode_request(register_req(f"guess{compared}"), 1))
            r = recv_reply(s)
            s.close()
            assert r is not None and r["code"] == P.ErrorCode.AUTH
            compared += "may retry" in r["error"]  # the token was compared (not refused by the back-off)
        assert compared == 1


def test_auth_throttle_is_bounded_and_exponential() -> None:
    now = [0.0]
    t = AuthThrottle(0.5, 4.0, max_sources=8, clock=lambda: now[0])
    assert [t.failed("a")[1] for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert t.retry_after("a") == 4.0
    now[0] += 4.0
    assert t.retry_after("a") == 0.0
    t.succeeded("a")
    assert t.failed("a")[1] == 0.5
    for i in range(10_000):
        t.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(t) == 8
    with pytest.raises(ValueError, match="first_s"):
        AuthThrottle(0, 1, 8)


# -- item 4: the accept loop survives ----------------------------------------------------------
class _FailingListener:
    """A listening socket whose ``accept`` fails with EMFILE while ``failing`` is set."""

    def __init__(self, real: socket.socket):
        self._real = real
        self.failing = threading.Event()
        self.failing.set()

    def accept(self) -> tuple[socket.socket, Any]:
        if self.failing.is_set():
            raise OSError(errno.EMFILE, "Too many open files")
        return self._real.accept()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def test_accept_failure_backs_off_reports_degraded_and_recovers(short_dir: Path) -> None:
    with start_server(short_dir, metrics_port=0) as srv:
        real = socket.create_server(("127.0.0.1", 0))
        failing = _FailingListener(real)
        srv._frames.listen(failing)  # type: ignore[arg-type]
        port = srv.metrics_port
        assert port is not None
        wait_until(lambda: http_get(port, "/health")[0] == 503, 5, "degraded")
        _, h = http_get(port, "/health")
        assert h["status"] == "degraded" and "Too many open files" in h["reason"]  # type: ignore[index]
        n = srv._frames.accept_failures
        time.sleep(0.3)
        assert srv._frames.accept_failures - n < 40, "the back-off must not spin"
        failing.failing.clear()
        socket.create_connection(real.getsockname(), timeout=5).close()
        wait_until(lambda: http_get(port, "/health")[0] == 200, 5, "ok again")
        assert http_get(port, "/health")[1]["status"] == "ok"  # type: ignore[index]
        c = connect(short_dir / "s.sock")
        assert c.lookup_keys(KEYS).num_tokens == 0
        c.close()


def test_thread_start_failure_closes_that_connection_only(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: RuntimeError("can't start new thread") ended the accept loop and leaked the session.
    with start_server(short_dir) as srv:
        frames = srv._frames
        real = frames._start_conn_thread
        calls = {"n": 0}

        def fail_once(*args: Any) -> None:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("can't start new thread")
            real(*args)

        monkeypatch.setattr(frames, "_start_conn_thread", fail_once)
        s = raw_unix(short_dir / "s.sock")
        assert closed_by_server(s, 5)
        s.close()
        assert srv.num_sessions() == 0 and frames.unauthenticated() == 0
        c = connect(short_dir / "s.sock", wait_connected_s=5)
        assert c.lookup_keys(KEYS).num_tokens == 0
        c.close()
        assert frames.thread_start_failures == 1


_CHILD = textwrap.dedent(
    """
    import resource, sys
    from kvtier.service.server import CacheServer, ServerOptions
    sys.path.insert(0, {tests!r})
    from service_helpers import server_config
    resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))
    opts = ServerOptions(socket_path={sock!r}, max_clients=100, max_unauthenticated=100, metrics_port=0)
    with CacheServer(server_config(), opts).start() as srv:
        print(srv.metrics_port, flush=True)
        sys.stdin.read()
    """
)


def test_accept_loop_survives_fd_exhaustion_in_a_child(short_dir: Path) -> None:
    # Before: the loop returned on the first EMFILE; new clients were never answered.
    sock = short_dir / "s.sock"
    code = _CHILD.format(tests=str(Path(__file__).parent), sock=str(sock))
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        idle = [raw_unix(sock) for _ in range(60)]  # the kernel queues those the server cannot accept
        time.sleep(0.3)
        for s in idle:
            s.close()
        c = connect(sock, wait_connected_s=10)
        assert c.lookup_keys(KEYS).num_tokens == 0
        c.close()
        wait_until(lambda: http_get(port, "/health")[0] == 200, 10, "health ok again")
    finally:
        child.kill()
        child.wait(10)


# -- HTTP -------------------------------------------------------------------------------------
def test_idle_http_sockets_do_not_block_a_scrape(short_dir: Path) -> None:
    # Before: one thread and fd per idle socket without limit (254 exhausted the fd table).
    with start_server(short_dir, metrics_port=0, http_max_connections=8, http_timeout_s=30) as srv:
        port = srv.metrics_port
        assert port is not None
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(40)]
        try:
            t0 = time.monotonic()
            code, h = http_get(port, "/health")
            assert code == 200 and h["status"] == "ok"  # type: ignore[index]
            assert time.monotonic() - t0 < 2.0
            assert srv._http is not None and srv._http.open_connections <= 8
        finally:
            for s in idle:
                s.close()


def test_http_sockets_dripping_their_headers_do_not_block_a_scrape(short_dir: Path) -> None:
    """Hostile trial (December 7): connections that sent a request line and then one header byte
    at a time counted as busy (not evictable), so 40 of them filled the connections and 8 of 10
    real scrapes failed. They are evictable until their whole request head is in."""
    with start_server(short_dir, metrics_port=0, http_max_connections=8, http_timeout_s=30) as srv:
        port = srv.metrics_port
        assert port is not None
        drips = []
        for _ in range(12):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: a")  # request line, then a header never ended
            drips.append(s)
        try:
            wait_until(lambda: srv._http is not None and srv._http.open_connections == 8, 10, "connections full")
            for _ in range(5):
                code, h = http_get(port, "/health")
                assert code == 200 and h["status"] == "ok"  # type: ignore[index]
            assert srv._http.open_connections <= 8
        finally:
            for s in drips:
                s.close()


def test_idle_http_socket_closed_after_request_timeout(short_dir: Path) -> None:
    with start_server(short_dir, metrics_port=0, http_timeout_s=0.3) as srv:
        assert srv.metrics_port is not None
        s = socket.create_connection(("127.0.0.1", srv.metrics_port), timeout=5)
        assert closed_by_server(s, 5)
        s.close()


def test_64_concurrent_gets_finish_fast(short_dir: Path) -> None:
    # Before: a listen backlog of 5 made some of 64 concurrent GETs wait for SYN retransmits (1 s+).
    with start_server(short_dir, metrics_port=0) as srv:
        port = srv.metrics_port
        assert port is not None
        codes: list[int] = []
        go = threading.Event()

        def get() -> None:
            go.wait()
            codes.append(http_get(port, "/metrics", timeout_s=10)[0])

        threads = [threading.Thread(target=get) for _ in range(64)]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        go.set()
        for t in threads:
            t.join(15)
        elapsed = time.monotonic() - t0
        assert codes == [200] * 64
        assert elapsed < 0.95, f"64 concurrent GETs took {elapsed:.2f} s"


# -- options -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [
        ("handshake_timeout_s", 0), ("idle_timeout_s", -1), ("frame_timeout_s", 0), ("max_unauthenticated", 0),
        ("auth_backoff_s", 0), ("http_max_connections", 0), ("http_timeout_s", 0), ("auth_sources", 0),
    ],
)
def test_bad_connection_options_name_the_option(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        ServerOptions(socket_path="/tmp/x.sock", **{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="auth_backoff_max_s"):
        ServerOptions(socket_path="/tmp/x.sock", auth_backoff_s=2, auth_backoff_max_s=1)


def test_conn_limits_validate() -> None:
    with pytest.raises(ValueError, match="handshake_frame_bytes"):
        ConnLimits(handshake_frame_bytes=P.MAX_FRAME_BYTES + 1)


@pytest.mark.slow
def test_server_flags_reach_the_listener(short_dir: Path) -> None:
    cb = small_namespace().chunk_bytes
    cmd = [
        sys.executable, "-m", "kvtier.cli", "server", "--socket", str(short_dir / "s.sock"),
        "--cpu-capacity", str(16 * cb), "--no-metrics", "--handshake-timeout-s", "0.3",
        "--max-unauthenticated", "2", "--idle-timeout-s", "0",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "ready" in line:
                break
        else:
            pytest.fail("server did not start")
        s = raw_unix(short_dir / "s.sock")
        assert closed_by_server(s, 5), "--handshake-timeout-s 0.3 not applied"
        s.close()
    finally:
        proc.terminate()
        proc.wait(10)
