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
  request uses one connection by itself, so the client is thread-safe.
- A reused connection the server closed meanwhile (uvicorn drops idle ones after 5 s) fails
  before a status line arrives; such a request is sent once more on a fresh connection (so only
  idempotent requests belong here: ``/locate`` reads the index). A fresh connection's failure is
  raised.
- ``timeout_s`` bounds connecting and each read of the socket; the body is read against one
  deadline of ``timeout_s`` in all, and at most ``max_reply_bytes`` of it.
"""

from __future__ import annotations

import http.client
import threading
import time
from urllib.parse import urlsplit

__all__ = ["KeepAliveClient", "ReplyTooLarge"]


class ReplyTooLarge(ValueError):
    """The server's reply body is over the client's ``max_reply_bytes``."""


_STALE = (http.client.RemoteDisconnected, http.client.BadStatusLine, BrokenPipeError, ConnectionResetError,
          ConnectionAbortedError)


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
        """``(status, reply body)`` of ``POST path`` with ``body``.

        Raises:
            OSError: connect/read failures and timeouts (``TimeoutError``), also after one retry of
                a reused connection the server had closed.
            http.client.HTTPException: a malformed reply.
            ReplyTooLarge: a reply body over ``max_reply_bytes``.
            RuntimeError: the client is closed.
        """
        conn, reused = self._take()
        try:
            try:
                return self._exchange(conn, path, body)
            except _STALE:
                if not reused:
                    raise
                conn.close()
                conn, reused = self._fresh(), False
                return self._exchange(conn, path, body)
        except BaseException:
            conn.close()
            raise

    def _exchange(self, conn: http.client.HTTPConnection, path: str, body: bytes) -> tuple[int, bytes]:
        conn.request("POST", self._prefix + path, body=body, headers=self._headers)
        resp = conn.getresponse()
        deadline = time.monotonic() + self.timeout_s
        length = resp.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > self.max_reply_bytes:
            raise ReplyTooLarge(f"a reply of {int(length)} bytes (at most {self.max_reply_bytes})")
        parts: list[bytes] = []
        got = 0
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the reply body took more than {self.timeout_s} s")
            part = resp.read(min(1 << 16, self.max_reply_bytes + 1 - got))  # closes the response at its end
            if not part:
                break
            parts.append(part)
            got += len(part)
            if got > self.max_reply_bytes:
                raise ReplyTooLarge(f"a reply of more than {self.max_reply_bytes} bytes")
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
            if self._idle:
                return self._idle.pop(), True
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
