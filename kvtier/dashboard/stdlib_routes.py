"""Dashboard routes for the cache server's ``http.server`` endpoint (``kvtier.service.http``).

``GET /`` (the page), ``/dashboard/static/<file>``, ``/dashboard/snapshot`` (JSON) and
``/dashboard/events`` (server-sent events, one snapshot per ``step_s``). Event streams
are bounded (``max_streams`` at once; more get 503 with ``Retry-After``) so viewers can
never take every HTTP slot from Prometheus scrapes; each stream lasts at most
``stream_s`` seconds (the browser's EventSource reconnects) and a stalled reader is cut
by the connection's socket timeout.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler

from kvtier.dashboard.assets import Assets
from kvtier.dashboard.source import DashboardSource

log = logging.getLogger(__name__)


class DashboardRoutes:
    """Answers the dashboard's GETs on a ``BaseHTTPRequestHandler``.

    Args:
        source: the dashboard's data.
        max_streams: event streams open at once (>= 1).
        stream_s: seconds one event stream lasts (> 0).
    """

    def __init__(self, source: DashboardSource, max_streams: int = 4, stream_s: float = 300.0):
        if max_streams < 1 or not stream_s > 0:
            raise ValueError(f"max_streams >= 1 and stream_s > 0 required, got {max_streams}, {stream_s}")
        self.source = source
        self.assets = Assets()
        self.stream_s = stream_s
        self._streams = threading.BoundedSemaphore(max_streams)

    def handle(self, h: BaseHTTPRequestHandler, path: str) -> bool:
        """Answer ``GET path`` if it is a dashboard route; False otherwise (nothing written)."""
        if path in ("/", "/dashboard", "/dashboard/"):
            self._send(h, 200, *self.assets.index())
        elif path == "/dashboard/snapshot":
            body = json.dumps(self.source.snapshot(), separators=(",", ":")).encode()
            self._send(h, 200, "application/json", body)
        elif path == "/dashboard/events":
            self._events(h)
        elif path.startswith("/dashboard/static/"):
            got = self.assets.get(path)
            if got is None:
                self._send(h, 404, "text/plain", b"not found\n")
            else:
                self._send(h, 200, *got, cache="max-age=300")
        else:
            return False
        return True

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, code: int, ctype: str, body: bytes, cache: str = "no-cache") -> None:
        h.send_response(code)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Cache-Control", cache)
        h.send_header("X-Content-Type-Options", "nosniff")
        h.end_headers()
        h.wfile.write(body)

    def _events(self, h: BaseHTTPRequestHandler) -> None:
        if not self._streams.acquire(blocking=False):
            h.send_response(503)
            h.send_header("Retry-After", "5")
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        try:
            h.send_response(200)
            h.send_header("Content-Type", "text/event-stream")
            h.send_header("Cache-Control", "no-cache")
            h.end_headers()
            for frame in self.source.events(self.stream_s):
                h.wfile.write(frame)
                h.wfile.flush()
        except OSError:  # the viewer left or stalled past the socket timeout
            log.debug("kvtier dashboard: event stream ended", exc_info=True)
        finally:
            self._streams.release()
