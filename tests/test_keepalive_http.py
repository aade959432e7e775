"""The lookup path's keep-alive HTTP client (:mod:`kvtier.transfer.keepalive_http`) against a real server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtier.transfer.keepalive_http import KeepAliveClient, ReplyTooLarge


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    mode = "echo"  # set per server (class attribute of a subclass)
    wbufsize = 1 << 16  # one write per reply, as uvicorn does (else Nagle + delayed ACK: 40 ms a request)
    disable_nagle_algorithm = True

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests.append((self.path, self.headers.get("Authorization")))  # type: ignore[attr-defined]
        mode = self.mode
        if mode == "slow":
            time.sleep(1.0)
        if mode == "huge_chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(40):
                self.wfile.write(b"%x\r\n%s\r\n" % (1000, b"x" * 1000))
            self.wfile.write(b"0\r\n\r\n")
            return
        reply = b"y" * 5000 if mode == "huge" else b"echo:" + body
        self.send_response(201)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)
        if mode == "drop_idle":  # closes the connection without saying so (as an idle timeout does)
            self.close_connection = True


@pytest.fixture
def serve() -> Iterator:
    servers: list[ThreadingHTTPServer] = []

    def start(mode: str = "echo") -> ThreadingHTTPServer:
        handler = type("H", (Handler,), {"mode": mode})
        srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        srv.daemon_threads = True
        srv.requests = []  # type: ignore[attr-defined]
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def url(srv: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}/base"


def test_requests_reuse_one_connection_and_carry_path_headers_and_body(serve) -> None:
    srv = serve()
    c = KeepAliveClient(url(srv), headers={"Authorization": "Bearer t"}, timeout_s=2)
    for i in range(20):
        assert c.post("/locate", b"%d" % i) == (201, b"echo:%d" % i)
    assert c.opened == 1
    assert srv.requests[0] == ("/base/locate", "Bearer t")
    c.close()
    with pytest.raises(RuntimeError):
        c.post("/locate", b"")


def test_a_connection_the_server_closed_is_retried_once_on_a_fresh_one(serve) -> None:
    srv = serve("drop_idle")
    c = KeepAliveClient(url(srv), timeout_s=2)
    for i in range(5):
        assert c.post("/x", b"%d" % i) == (201, b"echo:%d" % i)
    assert c.opened == 5  # each reuse found the connection closed and opened another
    assert len(srv.requests) == 5


def test_threads_share_the_client(serve) -> None:
    srv = serve()
    c = KeepAliveClient(url(srv), timeout_s=5, max_idle=2)
    bad: list[object] = []

    def run(t: int) -> None:
        for i in range(50):
            body = b"%d-%d" % (t, i)
            got = c.post("/x", body)
            if got != (201, b"echo:" + body):
                bad.append(got)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert bad == [] and len(srv.requests) == 200
    assert c.opened <= 50  # mostly reused (at most 4 at once, 2 kept idle)


@pytest.mark.parametrize("mode", ["huge", "huge_chunked"])
def test_a_reply_over_the_bound_is_refused(serve, mode: str) -> None:
    c = KeepAliveClient(url(serve(mode)), timeout_s=2, max_reply_bytes=4096)
    with pytest.raises(ReplyTooLarge):
        c.post("/x", b"")


def test_a_slow_or_dead_server_is_a_bounded_error(serve) -> None:
    c = KeepAliveClient(url(serve("slow")), timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        c.post("/x", b"")
    assert time.monotonic() - t0 < 0.9
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there
    with pytest.raises(OSError):
        KeepAliveClient(f"http://127.0.0.1:{port}", timeout_s=0.5).post("/x", b"")


@pytest.mark.parametrize("bad", ["ftp://h:1", "http://", "localhost:80", "http://h:99999"])
def test_a_bad_url_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        KeepAliveClient(bad)
