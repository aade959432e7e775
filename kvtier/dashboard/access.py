"""Who may read a dashboard, and how a browser proves it (one concept: dashboard access).

The rule is the API's: a service with an operator token (the controller's token, a
``kvtier server``'s server token) serves its dashboard data only to a viewer that presents
it; a service without one listens on loopback only and then answers only requests whose
``Host`` names loopback. Only the page itself and its static files (a bare liveness page: no
number, no name) are served to anyone who may reach the port.

* **Presenting the token.** ``Authorization: Bearer TOKEN`` (``kvtier top``, scripts), or a
  session: ``POST /dashboard/login`` with ``{"token": ...}`` sets the cookie
  :attr:`DashboardAccess.cookie_name` (a random 256-bit session id, ``HttpOnly``,
  ``SameSite=Strict``, ``Path=/``, 12 h), so the page's ``EventSource`` (which cannot send
  headers) is authorised and page scripts never hold the token. At most ``max_sessions``
  sessions exist (the oldest is dropped); ``POST /dashboard/logout`` ends one. An operation
  authorised by the cookie alone must also carry the header ``X-Kvtier-Dashboard: 1``, which
  another site's page cannot send without a CORS preflight that is never granted.
* **DNS rebinding.** A page on ``evil.example`` whose name the attacker re-points at
  127.0.0.1 reaches a loopback service from the operator's browser; its requests carry
  ``Host: evil.example``. A tokenless service on loopback refuses (403) every request whose
  ``Host`` is not a loopback name or address (:func:`kvtier.hosts.is_loopback`); a missing
  ``Host`` (HTTP/1.0 tools; browsers always send one) is accepted.
* **A tokenless service beyond loopback** (``kvtier server --metrics-host 0.0.0.0`` without a
  server token) keeps ``/metrics`` and ``/health`` (the operator chose to publish them) but
  refuses the dashboard's data (403): there is nothing to authenticate a viewer with.

Event streams are bounded per client and in total (:class:`StreamSlots`).
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from http.cookies import SimpleCookie
from typing import Any

from kvtier.hosts import is_loopback

#: Header an operation authorised by the session cookie alone must carry (CSRF defence).
CSRF_HEADER = "x-kvtier-dashboard"
#: Seconds a session lasts.
SESSION_S = 12 * 3600.0


class Denied(Exception):
    """A request the dashboard refuses: ``status`` (401, 403) and the reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def host_name(host_header: str) -> str:
    """The host part of a ``Host`` header (``[::1]:7601`` -> ``::1``, ``h:80`` -> ``h``)."""
    h = host_header.strip()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header (``None``: none)."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


class DashboardAccess:
    """The access rule of one service's dashboard (thread-safe).

    Args:
        token: the operator token, read at each request (``None`` or ``""``: none).
        bound_host: the address the service listens on (decides whether a tokenless
            dashboard is loopback-only).
        port: the service's port, read at each request (names the cookie: cookies are not
            per port, so a controller and a server on one host must not share one).
        max_sessions: sessions kept (>= 1).
        clock: monotonic seconds (tests pass a fake).

    Raises:
        ValueError: ``max_sessions`` < 1.
    """

    def __init__(self, token: Callable[[], str | None], bound_host: str, port: Callable[[], int],
                 max_sessions: int = 64, clock: Callable[[], float] = time.monotonic) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self._token = token
        self._port = port
        self.loopback = is_loopback(bound_host)
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[str, float] = OrderedDict()  # session id -> expiry (monotonic)
        self._lock = threading.Lock()

    @property
    def token(self) -> str:
        return self._token() or ""

    @property
    def cookie_name(self) -> str:
        return f"kvtier_dash_{self._port()}"

    # -- checks ------------------------------------------------------------------------------
    def host_ok(self, host_header: str | None) -> bool:
        """Whether a request with this ``Host`` may be answered at all: always with a token or when
        listening beyond loopback (then by whatever name clients use; the data routes need a
        token there anyway); a tokenless loopback service only for loopback names (or no ``Host``)."""
        if self.token or host_header is None or not self.loopback:
            return True
        return is_loopback(host_name(host_header))

    def check_host(self, host_header: str | None) -> None:
        """Raises Denied(403) for a foreign ``Host`` on a tokenless service (see :meth:`host_ok`)."""
        if not self.host_ok(host_header):
            raise Denied(403, "this service has no token and answers loopback names only "
                              "(Host header names another host: a DNS-rebinding page?)")

    def check_read(self, host: str | None, authorization: str | None, cookie: str | None) -> None:
        """May this request read the dashboard's data?

        Raises:
            Denied: 403 (foreign ``Host`` without a token, or a tokenless service beyond
                loopback), 401 (the token is required and was not presented).
        """
        self.check_host(host)
        if not self.token:
            if not self.loopback:
                raise Denied(403, "the dashboard's data needs a token when the service listens beyond loopback")
            return
        if not (self._bearer_ok(authorization) or self._session_ok(cookie)):
            raise Denied(401, "sign in with the operator token (POST /dashboard/login) or send it as a bearer token")

    def check_operation(self, host: str | None, authorization: str | None, cookie: str | None,
                        csrf: str | None) -> None:
        """May this request run an operation? As :meth:`check_read`, and a session cookie alone
        counts only with the :data:`CSRF_HEADER` header set to ``1``.

        Raises:
            Denied: as :meth:`check_read`, or 403 for a cookie without the header.
        """
        self.check_host(host)
        if not self.token:
            if not self.loopback:
                raise Denied(403, "operations need a token when the service listens beyond loopback")
            return
        if self._bearer_ok(authorization):
            return
        if self._session_ok(cookie):
            if csrf != "1":
                raise Denied(403, f"an operation by session cookie must carry the {CSRF_HEADER}: 1 header")
            return
        raise Denied(401, "missing or wrong bearer token")

    def _bearer_ok(self, authorization: str | None) -> bool:
        got = bearer(authorization)
        return got is not None and hmac.compare_digest(got.encode(), self.token.encode())

    def _session_ok(self, cookie_header: str | None) -> bool:
        sid = self.session_of(cookie_header)
        if sid is None:
            return False
        now = self._clock()
        with self._lock:
            expiry = None
            for known, exp in self._sessions.items():  # constant time per entry, all compared
                if hmac.compare_digest(known.encode(), sid.encode()):
                    expiry = exp
            if expiry is None:
                return False
            if expiry <= now:
                self._sessions.pop(sid, None)
                return False
            return True

    def session_of(self, cookie_header: str | None) -> str | None:
        """The session id this service's cookie carries in a ``Cookie`` header (``None``: none)."""
        if not cookie_header:
            return None
        jar: SimpleCookie = SimpleCookie()
        try:
            jar.load(cookie_header)
        except Exception:  # noqa: BLE001 - a malformed Cookie header is no session
            return None
        m = jar.get(self.cookie_name)
        return m.value if m is not None and m.value else None

    # -- sessions ----------------------------------------------------------------------------
    def login(self, presented: Any) -> str:
        """A new session for the operator token ``presented``.

        Raises:
            Denied: 400 without a token service (nothing to sign in to), 401 for a wrong token.
        """
        if not self.token:
            raise Denied(400, "this service has no token: nothing to sign in to")
        if not isinstance(presented, str) or not hmac.compare_digest(presented.encode(), self.token.encode()):
            raise Denied(401, "wrong token")
        sid = secrets.token_urlsafe(32)
        with self._lock:
            self._sessions[sid] = self._clock() + SESSION_S
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return sid

    def logout(self, cookie_header: str | None) -> None:
        """End the session the cookie names (if any)."""
        sid = self.session_of(cookie_header)
        if sid is not None:
            with self._lock:
                self._sessions.pop(sid, None)

    def set_cookie(self, sid: str) -> str:
        """The ``Set-Cookie`` value of a new session."""
        return f"{self.cookie_name}={sid}; HttpOnly; SameSite=Strict; Path=/; Max-Age={int(SESSION_S)}"

    def clear_cookie(self) -> str:
        """The ``Set-Cookie`` value that removes the session cookie."""
        return f"{self.cookie_name}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0"


class StreamSlots:
    """Bounds on open event streams: ``per_client`` per client address and ``max_streams`` in
    all. A new stream beyond either bound closes the oldest stream (that client's when it is over
    its own bound) instead of being refused, so no set of open streams, a stranger's or a
    forgotten tab's, can keep a viewer out (thread-safe).

    Args:
        max_streams: streams open at once (>= 1).
        per_client: streams one client address holds at once (>= 1).

    Raises:
        ValueError: a bound < 1.
    """

    def __init__(self, max_streams: int = 8, per_client: int = 4) -> None:
        if max_streams < 1 or per_client < 1:
            raise ValueError(f"max_streams and per_client must be >= 1, got {max_streams}, {per_client}")
        self.max_streams = max_streams
        self.per_client = per_client
        self._open: OrderedDict[threading.Event, str] = OrderedDict()  # oldest first: end event -> client
        self._lock = threading.Lock()
        self.evicted = 0

    def open(self, client: str) -> threading.Event:
        """A slot for a new stream of ``client``: an event set when the stream must end."""
        end = threading.Event()
        with self._lock:
            mine = [e for e, c in self._open.items() if c == client]
            victim = None
            if len(mine) >= self.per_client:
                victim = mine[0]
            elif len(self._open) >= self.max_streams:
                victim = next(iter(self._open))
            if victim is not None:
                self._open.pop(victim)
                victim.set()
                self.evicted += 1
            self._open[end] = client
        return end

    def close(self, end: threading.Event) -> None:
        """The stream of ``end`` ended (idempotent)."""
        with self._lock:
            self._open.pop(end, None)

    def close_all(self) -> None:
        """End every open stream."""
        with self._lock:
            for e in self._open:
                e.set()
            self._open.clear()

    def count(self) -> int:
        with self._lock:
            return len(self._open)


class LoopbackHostOnly:
    """ASGI middleware: while ``access`` has no token, a request whose ``Host`` is not loopback is
    answered 403 before it reaches the app (DNS rebinding; see the module docstring)."""

    def __init__(self, app: Any, access: DashboardAccess) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") == "http" and not self.access.token:
            host = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"host"), None)
            if not self.access.host_ok(host):
                body = b'{"detail":"foreign Host header refused: this service has no token and answers loopback names only"}'
                await send({"type": "http.response.start", "status": 403,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body, "more_body": False})
                return
        await self.app(scope, receive, send)
