"""Dashboard routes for the cache server's ``http.server`` endpoint (``kvtier.service.http``).

``GET /`` (the page) and ``/dashboard/static/<file>`` are served to anyone who reaches the
port; ``/dashboard/snapshot`` (JSON) and ``/dashboard/events`` (server-sent events, one
snapshot per ``step_s``) follow :mod:`kvtier.dashboard.access` (the server token, as a bearer
token or the session cookie of ``POST /dashboard/login``; ``POST /dashboard/logout``).
Event streams are bounded per client and in total (:class:`~kvtier.dashboard.access.StreamSlots`:
a new one closes the oldest) so viewers can never take every HTTP slot from Prometheus
scrapes nor lock another viewer out; each stream lasts at most ``stream_s`` seconds (the
browser's EventSource reconnects) and a stalled reader is cut by the connection's socket
timeout.
"""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler

from kvtier.dashboard.access import DashboardAccess, Denied, StreamSlots
from kvtier.dashboard.assets import Assets
from kvtier.dashboard.source import DashboardSource

#: Largest ``POST /dashboard/login`` body read (bytes).
MAX_LOGIN_BYTES = 8192

log = logging.getLogger(__name__)


class DashboardRoutes:
    """Answers the dashboard's GETs on a ``BaseHTTPRequestHandler``.

    Args:
        source: the dashboard's data.
        access: who may read it (:class:`~kvtier.dashboard.access.DashboardAccess`).
        max_streams: event streams open at once (>= 1).
        per_client_streams: event streams one client address holds at once (>= 1).
        stream_s: seconds one event stream lasts (> 0).
    """

    def __init__(self, source: DashboardSource, access: DashboardAccess, max_streams: int = 8,
                 per_client_streams: int = 4, stream_s: float = 300.0):
        if not stream_s > 0:
            raise ValueError(f"stream_s > 0 required, got {stream_s}")
        self.source = source
        self.access = access
        self.assets = Assets()
        self.stream_s = stream_s
        self.streams = StreamSlots(max_streams, per_client_streams)

    def handle(self, h: BaseHTTPRequestHandler, path: str) -> bool:
        """Answer ``GET path`` if it is a dashboard route; False otherwise (nothing written)."""
        if path in ("/", "/dashboard", "/dashboard/"):
            self._send(h, 200, *self.assets.index())
        elif path in ("/dashboard/snapshot", "/dashboard/events"):
            try:
                self.access.check_read(h.headers.get("Host"), h.headers.get("Authorization"), h.headers.get("Cookie"))
            except Denied as exc:
                self._deny(h, exc)
                return True
            if path == "/dashboard/events":
                self._events(h)
            else:
                body = json.dumps(self.source.snapshot(), separators=(",", ":")).encode()
                self._send(h, 200, "application/json", body, cache="no-store")
        elif path.startswith("/dashboard/static/"):
            got = self.assets.get(path)
            if got is None:
                self._send(h, 404, "text/plain", b"not found\n")
            else:
                self._send(h, 200, *got, cache="max-age=300")
        else:
            return False
        return True

    def handle_post(self, h: BaseHTTPRequestHandler, path: str) -> bool:
        """Answer ``POST path`` if it is a dashboard route (login, logout); False otherwise."""
        if path == "/dashboard/logout":
            self.access.logout(h.headers.get("Cookie"))
            self._send(h, 204, "application/json", b"", extra={"Set-Cookie": self.access.clear_cookie()})
            return True
        if path != "/dashboard/login":
            return False
        try:
            self.access.check_host(h.headers.get("Host"))
            length = h.headers.get("Content-Length", "")
            if not length.isdigit() or int(length) > MAX_LOGIN_BYTES:
                raise Denied(413 if length.isdigit() else 411, f"a login body of at most {MAX_LOGIN_BYTES} bytes")
            try:
                token = json.loads(h.rfile.read(int(length))).get("token")
            except (ValueError, AttributeError):
                raise Denied(400, 'the body must be {"token": "..."}') from None
            sid = self.access.login(token)
        except Denied as exc:
            self._deny(h, exc)
            return True
        self._send(h, 204, "application/json", b"", cache="no-store", extra={"Set-Cookie": self.access.set_cookie(sid)})
        return True

    def _deny(self, h: BaseHTTPRequestHandler, exc: Denied) -> None:
        extra = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
        self._send(h, exc.status, "application/json", json.dumps({"detail": exc.reason}).encode(), extra=extra)

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, code: int, ctype: str, body: bytes, cache: str = "no-cache",
              extra: dict[str, str] | None = None) -> None:
        h.send_response(code)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Cache-Control", cache)
        h.send_header("X-Content-Type-Options", "nosniff")
        for k, v in (extra or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(body)

    def _events(self, h: BaseHTTPRequestHandler) -> None:
        ended = self.streams.open(h.client_address[0] if h.client_address else "?")
        try:
            h.send_response(200)
            h.send_header("Content-Type", "text/event-stream")
            h.send_header("Cache-Control", "no-store")
            h.end_headers()
            for frame in self.source.events(self.stream_s, ended):
                h.wfile.write(frame)
                h.wfile.flush()
        except OSError:  # the viewer left or stalled past the socket timeout
            log.debug("kvtier dashboard: event stream ended", exc_info=True)
        finally:
            self.streams.close(ended)
