"""The cache service's HTTP endpoint (``/metrics``, ``/health``), bounded against idle and hostile clients.

``http.server.ThreadingHTTPServer`` as shipped starts one thread per connection,
without limit, each waiting forever for a request line, behind a listen backlog
of 5: 254 idle sockets exhaust the fd table, and 64 concurrent GETs pay SYN
retransmits (seconds). Here:

- at most ``max_connections`` connections are open at once; when full, the
  connection that has waited longest without sending its whole request head (request line and
  headers) is closed to
  make room (idle sockets can never crowd out a real scrape), and when every
  connection is busy serving, the new one is closed at once;
- each connection has ``request_timeout_s`` seconds to send its whole request
  (request line, headers and body: a deadline, each ``recv`` gets the time left,
  so a client dripping one byte at a time is cut off), and each write of the
  reply has ``request_timeout_s`` seconds (socket timeout; HTTP/1.0: one request
  per connection);
- the listen backlog is ``backlog`` (128 by default);
- an accept failing for lack of fds or memory backs off (10 ms .. 1 s) instead
  of spinning;
- without a server token (the endpoint then listens on loopback in the CLI's default), a
  request whose ``Host`` header is not a loopback name or address is refused (403): a
  DNS-rebinding web page cannot read it; the dashboard's data needs the server token when
  there is one (:mod:`kvtier.dashboard.access`).
"""

from __future__ import annotations

import errno
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST

from kvtier.protocol.framing import time_left

if TYPE_CHECKING:
    from kvtier.service.metrics import ServerMetrics

log = logging.getLogger(__name__)

#: ``accept()`` errors that mean "out of fds or memory now": back off and retry.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
#: Bounds of the accept back-off (seconds).
ACCEPT_BACKOFF_MIN_S = 0.01
ACCEPT_BACKOFF_MAX_S = 1.0


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer with a connection cap, oldest-idle eviction and accept back-off."""

    daemon_threads = True
    block_on_close = False

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        max_connections: int,
        backlog: int,
    ):
        self.request_queue_size = backlog  # read by server_activate() (listen backlog)
        self.max_connections = max_connections
        self.refused = 0
        self.evicted = 0
        self._lock = threading.Lock()
        # socket -> (accepted at, monotonic s; still waiting for its request line)
        self._open: dict[socket.socket, tuple[float, bool]] = {}
        self._accept_delay = 0.0
        super().__init__(address, handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            got = super().get_request()
        except OSError as exc:
            if exc.errno in RESOURCE_ERRNOS:
                self._accept_delay = min(max(2 * self._accept_delay, ACCEPT_BACKOFF_MIN_S), ACCEPT_BACKOFF_MAX_S)
                time.sleep(self._accept_delay)  # the serve_forever thread only; bounded
            raise
        self._accept_delay = 0.0
        return got

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Admit ``request`` if there is room (closing the oldest idle connection to make some)."""
        with self._lock:
            if len(self._open) >= self.max_connections:
                idle = [(t, s) for s, (t, waiting) in self._open.items() if waiting]
                if not idle:
                    self.refused += 1
                    return False  # every connection is being served: refuse this one
                _, oldest = min(idle, key=lambda x: x[0])
                self._open.pop(oldest)
                self.evicted += 1
                try:
                    oldest.shutdown(socket.SHUT_RDWR)  # wakes its thread, which then closes it
                except OSError:
                    pass
            self._open[request] = (time.monotonic(), True)
            return True

    def mark_busy(self, request: socket.socket) -> None:
        """``request`` sent its request line and headers: no longer evictable."""
        with self._lock:
            if request in self._open:
                self._open[request] = (self._open[request][0], False)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("kvtier metrics http: request from %s failed", client_address, exc_info=True)

    def open_connections(self) -> int:
        with self._lock:
            return len(self._open)


class _RequestReader(io.RawIOBase):
    """Reads a connection's request by ``deadline`` (``time.monotonic`` seconds): each ``recv``
    gets the time left (raises ``socket.timeout`` once it passed); closing it leaves the socket open."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        time_left(self._sock, self._deadline)
        return self._sock.recv_into(b)


class MetricsHTTPServer:
    """Serves ``/metrics`` and ``/health`` on ``host:port`` in a daemon thread.

    ``/health`` answers 200 when ``health`` says healthy, else 503; the JSON
    body is ``{"status": "ok" | "unavailable", **details}`` (``details`` may set
    its own ``status``, e.g. ``"degraded"``, and a ``reason``).

    Args:
        host: bind address (loopback by default in the CLI).
        port: TCP port; 0 picks a free one (see ``port`` after start).
        metrics: the server's metrics.
        health: returns ``(healthy, details)`` for ``/health``.
        max_connections: HTTP connections open at once (>= 1).
        request_timeout_s: seconds a connection has to send its request and
            read the reply (> 0).
        backlog: listen backlog (>= 1).
        token: the server token: the dashboard's data is served only to a viewer presenting
            it (``None``: no token; see :mod:`kvtier.dashboard.access`).

    Raises:
        OSError: the port cannot be bound.
        ValueError: a bound that cannot work.
    """

    def __init__(
        self,
        host: str,
        port: int,
        metrics: ServerMetrics,
        health: Callable[[], tuple[bool, dict[str, Any]]],
        max_connections: int = 32,
        request_timeout_s: float = 5.0,
        backlog: int = 128,
        token: str | None = None,
    ):
        if max_connections < 1 or backlog < 1 or not request_timeout_s > 0:
            raise ValueError(
                f"HTTP bounds must be positive: max_connections={max_connections}, "
                f"request_timeout_s={request_timeout_s}, backlog={backlog}"
            )
        outer_metrics, outer_health = metrics, health
        from kvtier.dashboard import DashboardRoutes, ServerDashboard  # the page at / (kvtier.dashboard)
        from kvtier.dashboard.access import DashboardAccess, Denied

        self.dashboard = ServerDashboard(metrics)
        self.access = DashboardAccess(lambda: token, host, lambda: self.port)
        dashboard = DashboardRoutes(self.dashboard, self.access)
        self._routes = dashboard
        access = self.access

        class Handler(BaseHTTPRequestHandler):
            timeout = request_timeout_s  # socket timeout of each reply write

            def setup(self) -> None:
                super().setup()
                self.rfile.close()  # the whole request by one deadline instead of per recv
                self.rfile = io.BufferedReader(_RequestReader(self.connection, time.monotonic() + request_timeout_s))

            def end_headers(self) -> None:
                self.connection.settimeout(request_timeout_s)  # reply writes: not what the request left
                super().end_headers()

            def parse_request(self) -> bool:
                # Busy (no longer evictable) only once its whole request head is in: marked at the
                # request line, a client dripping its headers held a place it could not lose
                # (hostile trial, December 7: 40 such connections failed 8 of 10 real scrapes).
                ok = super().parse_request()
                self.server.mark_busy(self.request)  # type: ignore[attr-defined]
                return ok

            def _foreign_host(self) -> bool:
                if access.host_ok(self.headers.get("Host")):
                    return False
                dashboard._deny(self, Denied(403, "foreign Host header refused: this server has no token and "
                                                  "answers loopback names only"))
                return True

            def do_POST(self) -> None:
                if self._foreign_host():
                    return
                if not dashboard.handle_post(self, self.path.split("?", 1)[0]):
                    body = b"not found\n"
                    self.send_response(404)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

            def do_GET(self) -> None:
                if self._foreign_host():
                    return
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, code = outer_metrics.exposition(), CONTENT_TYPE_LATEST, 200
                elif path == "/health":
                    healthy, details = outer_health()
                    body = json.dumps({"status": "ok" if healthy else "unavailable", **details}).encode()
                    ctype, code = "application/json", 200 if healthy else 503
                elif dashboard.handle(self, path):
                    return
                else:
                    body, ctype, code = b"not found\n", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                return

        self._httpd = _BoundedHTTPServer((host, port), Handler, max_connections, backlog)
        self.host = host
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="kvtier-metrics", daemon=True
        )
        self._thread.start()

    def dashboard_streams(self) -> int:
        """Dashboard event streams open now."""
        return self._routes.streams.count()

    @property
    def open_connections(self) -> int:
        """HTTP connections open now."""
        return self._httpd.open_connections()

    @property
    def refused(self) -> int:
        """Connections refused because every slot was serving a request."""
        return self._httpd.refused

    @property
    def evicted(self) -> int:
        """Idle connections closed to make room for a new one."""
        return self._httpd.evicted

    def close(self) -> None:
        self.dashboard.close()  # ends event streams
        self._httpd.shutdown()
        self._httpd.server_close()
