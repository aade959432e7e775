"""A keep-alive HTTP/1.1 POST client for the lookup path: pooled ``http.client`` connections.

:class:`~kvtier.transfer.directed_peer.DirectedPeerTier` asks the controller ``POST /locate``
on every local miss, inside the engine's lookup. That call is on the latency budget the fleet
soak judges (instance lookup p99 < 10 ms, :mod:`kvtier.bench.soak_fleet_report`), and the
client's own CPU time counts twice there: 2 cores shared by 3 instances, the controller, the
router and a hostile client. Python's standard ``http.client`` over a kept-alive connection
costs about half of what ``httpx.Client`` does per request (0.34 vs 0.64 ms measured against a
real controller's ``/locate`` on this machine, idle), so this path uses it; every other HTTP
client in kvtier stays on httpx.

Semantics:

- Connections are reused (HTTP/1.1 keep-alive); at most ``max_idle`` idle ones are kept. Each
  request uses one connection by itself, so the client is thread-safe. A pooled connection with
  anything to read before its next request (the server closed it, or sent bytes nobody asked for)
  is never reused: a late or unsolicited reply can never be taken for the next request's.
- A reused connection the server closed meanwhile (uvicorn drops idle ones after 5 s) is
  discarded before use; if it closes as the request goes out, the request is sent once more on
  a fresh connection (so only idempotent requests belong here: ``/locate`` reads the index).
- One deadline of ``timeout_s`` bounds the whole exchange: connecting, sending, and every read of
  the status line, headers, informational replies, chunks and trailers (a reader that sets the
  socket's timeout to what is left before each receive), whatever pace the server drips at. The
  host name's resolution is the system resolver's (not bounded here): name the controller by
  address where that matters.
- Refused as malformed (``http.client.HTTPException``, the connection closed): a final reply
  below 200 (``103 Early Hints`` is not an answer), a body shorter than its ``Content-Length``
  (``IncompleteRead``), a ``Content-Length`` that is not ASCII digits. A body over
  ``max_reply_bytes`` is :class:`ReplyTooLarge`.
"""

from __future__ import annotations

import http.client
import io
import select
import socket
import threading
import time
from typing import Any, Callable, cast
from urllib.parse import urlsplit

__all__ = ["KeepAliveClient", "ReplyTooLarge"]


class ReplyTooLarge(ValueError):
    """The server's reply body is over the client's ``max_reply_bytes``."""


#: A reused connection that the server closed as the request went out (sent once more, fresh).
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class _DeadlineReader(io.RawIOBase):
    """The socket's bytes, each receive bounded by what is left of one deadline.

    It reads a duplicate of the connection's socket, closed with the reader: ``http.client`` closes
    the connection's own socket as soon as a reply says it will close the connection (before its
    body is read), which ``socket.makefile`` survives by reference counting and this reader by
    holding its own descriptor.
    """

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock.dup()
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the reply did not arrive within the request's deadline")
        self._sock.settimeout(left)
        return self._sock.recv_into(b)

    def close(self) -> None:
        if not self.closed:
            self._sock.close()
        super().close()


class _DeadlineSocket:
    """What ``HTTPResponse`` reads its reply from: ``makefile`` over a :class:`_DeadlineReader`."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))


def _responses_within(deadline: float) -> Callable[..., http.client.HTTPResponse]:
    """What ``HTTPConnection.getresponse`` makes its reply with: one that reads within ``deadline``."""

    def make(sock: socket.socket, *args: Any, **kwargs: Any) -> http.client.HTTPResponse:
        return http.client.HTTPResponse(cast(socket.socket, _DeadlineSocket(sock, deadline)), *args, **kwargs)

    return make


def _pending_input(conn: http.client.HTTPConnection) -> bool:
    """True when an idle connection's socket has something to read (EOF or unsolicited bytes)."""
    sock = conn.sock
    if sock is None:
        return False
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):  # closed under us
        return True


class KeepAliveClient:
    """POST bodies to one HTTP(S) server over pooled keep-alive connections (module doc).

    Args:
        base_url: ``http://HOST:PORT`` or ``https://HOST:PORT`` (a path prefix is kept).
        headers: sent with every request (e.g. ``Authorization``).
        timeout_s: connect and per-read bound, and the whole body's deadline, seconds (> 0).
        max_idle: idle connections kept for reuse (>= 0).
        max_reply_bytes: longest reply body read (>= 1).

    Raises:
        ValueError: a URL that is not http(s)://HOST[:PORT][/path], or bad bounds.
    """

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, timeout_s: float = 1.0,
                 max_idle: int = 4, max_reply_bytes: int = 1 << 20) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"{base_url!r} is not an http(s)://HOST:PORT URL")
        if not timeout_s > 0 or max_idle < 0 or max_reply_bytes < 1:
            raise ValueError("timeout_s must be > 0, max_idle >= 0 and max_reply_bytes >= 1")
        try:
            port = u.port
        except ValueError as exc:
            raise ValueError(f"{base_url!r}: {exc}") from None
        self._conn_class = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        self._host = u.hostname
        self._port = port
        self._prefix = u.path.rstrip("/")
        self._headers = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
        self.timeout_s = timeout_s
        self.max_idle = max_idle
        self.max_reply_bytes = max_reply_bytes
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False
        #: Connections opened (a measure of reuse: requests / opened).
        self.opened = 0

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """``(status, reply body)`` of ``POST path`` with ``body``, within ``timeout_s`` in all.

        Raises:
            OSError: connect/read failures and timeouts (``TimeoutError``), also after one retry of
                a reused connection the server closed as the request went out.
            http.client.HTTPException: a malformed reply (see the module doc).
            ReplyTooLarge: a reply body over ``max_reply_bytes``.
            RuntimeError: the client is closed.
        """
        deadline = time.monotonic() + self.timeout_s
        conn, reused = self._take()
        try:
            try:
                return self._exchange(conn, path, body, deadline)
            except _STALE:
                if not reused:
                    raise
                conn.close()
                conn, reused = self._fresh(), False
                return self._exchange(conn, path, body, deadline)
        except BaseException:
            conn.close()
            raise

    def _exchange(self, conn: http.client.HTTPConnection, path: str, body: bytes,
                  deadline: float) -> tuple[int, bytes]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no time left of {self.timeout_s} s")
        conn.timeout = left  # connecting (a fresh connection), then sending: sendall's whole duration
        if conn.sock is not None:
            conn.sock.settimeout(left)
        conn.response_class = cast("type[http.client.HTTPResponse]", _responses_within(deadline))
        conn.request("POST", self._prefix + path, body=body, headers=self._headers)
        resp = conn.getresponse()
        if resp.status < 200:
            raise http.client.HTTPException(f"an informational reply ({resp.status}) where an answer was due")
        length = resp.getheader("Content-Length")
        expected: int | None = None
        if length is not None:
            if not (length.isascii() and length.isdigit()):
                raise http.client.HTTPException(f"Content-Length {length[:40]!r} is not a number")
            expected = int(length)
            if expected > self.max_reply_bytes:
                raise ReplyTooLarge(f"a reply of {expected} bytes (at most {self.max_reply_bytes})")
        parts: list[bytes] = []
        got = 0
        while True:
            part = resp.read(min(1 << 16, self.max_reply_bytes + 1 - got))  # closes the response at its end
            if not part:
                break
            parts.append(part)
            got += len(part)
            if got > self.max_reply_bytes:
                raise ReplyTooLarge(f"a reply of more than {self.max_reply_bytes} bytes")
        if expected is not None and got != expected and not resp.chunked:
            raise http.client.IncompleteRead(b"".join(parts), expected - got)
        status = resp.status
        if resp.will_close:
            conn.close()
        else:
            self._give(conn)
        return status, b"".join(parts)

    def _fresh(self) -> http.client.HTTPConnection:
        self.opened += 1
        return self._conn_class(self._host, self._port, timeout=self.timeout_s)

    def _take(self) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the HTTP client is closed")
            while self._idle:
                conn = self._idle.pop()
                if not _pending_input(conn):
                    return conn, True
                conn.close()  # closed by the server, or bytes nobody asked for: never reused
        return self._fresh(), False

    def _give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close every idle connection; later posts raise RuntimeError (idempotent)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
