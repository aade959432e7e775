"""The lookup path's keep-alive HTTP client (:mod:`kvtier.transfer.keepalive_http`) against a real server."""

from __future__ import annotations

import http.client
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


# -- hostile servers (the hostile trial's findings): raw sockets, one script per connection ----------


@pytest.fixture
def raw_server() -> Iterator:
    """``start(script)``: a TCP server running ``script(conn, request_bytes, n)`` for the n-th request
    of each connection (it writes whatever it likes); returns the URL."""
    socks: list[socket.socket] = []

    def start(script) -> str:
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(16)
        socks.append(ls)

        def serve_conn(conn: socket.socket) -> None:
            n = 0
            buf = b""
            try:
                while True:
                    while b"\r\n\r\n" not in buf:
                        data = conn.recv(65536)
                        if not data:
                            return
                        buf += data
                    head, _, buf = buf.partition(b"\r\n\r\n")
                    length = int(next((ln.split(b":")[1] for ln in head.split(b"\r\n")
                                       if ln.lower().startswith(b"content-length")), b"0"))
                    while len(buf) < length:
                        buf += conn.recv(65536)
                    req, buf = buf[:length], buf[length:]
                    if script(conn, req, n) is False:
                        return
                    n += 1
            except OSError:
                return
            finally:
                conn.close()

        def accept() -> None:
            while True:
                try:
                    conn, _ = ls.accept()
                except OSError:
                    return
                threading.Thread(target=serve_conn, args=(conn,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return f"http://127.0.0.1:{ls.getsockname()[1]}"

    yield start
    for s in socks:
        s.close()


def reply(conn: socket.socket, body: bytes, status: str = "200 OK", extra: bytes = b"") -> None:
    conn.sendall(b"HTTP/1.1 %s\r\nContent-Length: %d\r\n%s\r\n%s" % (status.encode(), len(body), extra, body))


@pytest.mark.slow
def test_a_dripping_server_is_bounded_by_one_deadline(raw_server) -> None:
    """Status line, headers and body one byte every 0.1 s: each read arrives within the per-read
    timeout, so only a deadline over the whole exchange bounds it."""
    def drip(conn: socket.socket, req: bytes, n: int) -> bool:
        for b in b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nX-Pad: " + b"x" * 200:
            conn.sendall(bytes([b]))
            time.sleep(0.1)
        return False

    def endless_continue(conn: socket.socket, req: bytes, n: int) -> bool:
        for _ in range(200):
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            time.sleep(0.05)
        return False

    for script in (drip, endless_continue):
        c = KeepAliveClient(raw_server(script), timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            c.post("/x", b"")
        assert time.monotonic() - t0 < 1.0, script.__name__


def test_an_informational_reply_is_refused_and_never_desyncs_the_next_request(raw_server) -> None:
    """103 Early Hints then the real answer: taken as final, the connection went back to the pool
    with the answer unread, and the next request got the previous one's reply."""
    def hints(conn: socket.socket, req: bytes, n: int) -> None:
        conn.sendall(b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n")
        reply(conn, b"answer-to-" + req)

    c = KeepAliveClient(raw_server(hints), timeout_s=1)
    with pytest.raises(http.client.HTTPException):
        c.post("/x", b"first")
    with pytest.raises(http.client.HTTPException):  # a fresh connection: refused again, never "first"'s answer
        c.post("/x", b"second")
    assert c.opened == 2


def test_bytes_nobody_asked_for_are_never_taken_for_the_next_reply(raw_server) -> None:
    def late_extra(conn: socket.socket, req: bytes, n: int) -> None:
        reply(conn, b"answer-to-" + req)
        time.sleep(0.05)
        reply(conn, b"unsolicited")  # after the client read its reply

    c = KeepAliveClient(raw_server(late_extra), timeout_s=1)
    assert c.post("/x", b"one") == (200, b"answer-to-one")
    time.sleep(0.2)
    assert c.post("/x", b"two") == (200, b"answer-to-two")
    assert c.opened == 2  # the connection holding the unsolicited reply was not reused


def test_a_short_body_or_a_strange_length_is_refused(raw_server) -> None:
    def short(conn: socket.socket, req: bytes, n: int) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{\"instances\": []}")
        return False  # closes before the 50 bytes

    def superscript(conn: socket.socket, req: bytes, n: int) -> None:
        conn.sendall("HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\n\r\nab".encode("latin-1"))

    for script, exc in ((short, http.client.IncompleteRead), (superscript, http.client.HTTPException)):
        with pytest.raises(exc):
            KeepAliveClient(raw_server(script), timeout_s=1).post("/x", b"")


def test_a_reply_that_closes_the_connection_is_read_to_its_end(raw_server) -> None:
    """http.client closes the connection's socket as soon as a reply says it will close, before its
    body is read: the deadline reader holds its own descriptor, so a body that comes later still arrives."""
    body = bytes(range(256)) * 80

    def close_after(conn: socket.socket, req: bytes, n: int) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:100])
        time.sleep(0.05)
        conn.sendall(body[100:])
        return False

    c = KeepAliveClient(raw_server(close_after), timeout_s=2)
    assert c.post("/x", b"") == (200, body)
    assert c.post("/x", b"") == (200, body) and c.opened == 2
