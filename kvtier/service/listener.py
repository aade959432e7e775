"""Listening sockets and the per-connection serve loop shared by every kvtier endpoint.

One acceptor thread per listener and one thread per connection: a connection
reads a frame, hands its body to the endpoint's ``handle``, writes the reply
(with a file descriptor attached when the endpoint passes one), and when the
connection ends for whatever reason calls the endpoint's ``drop`` exactly once,
before the socket is closed.

Hostile or broken peers are bounded (:class:`ConnLimits`): a deadline to
authenticate (the whole handshake), a cap on connections not yet authenticated,
a cap on connections open at once (the oldest one waiting for a frame makes
room), an idle timeout, a deadline for each whole frame (header and body: every
``recv`` gets the time left, so a peer dripping one byte at a time is cut off)
and a small frame bound before authentication. Resource
exhaustion in ``accept`` (EMFILE...) backs off and retries; it never ends the
loop (see :meth:`FrameServer.degraded_reason`).
"""

from __future__ import annotations

import enum
import errno
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from kvtier.protocol import (
    HEADER,
    MAX_FRAME_BYTES,
    ErrorCode,
    ProtocolError,
    error_reply,
    pack,
    recv_exact,
)

from kvtier.protocol.unix_socket import LISTEN_BACKLOG, UnixSocketFile, bind_unix

log = logging.getLogger(__name__)

S = TypeVar("S")

__all__ = ["LISTEN_BACKLOG", "ConnLimits", "Endpoint", "FrameServer", "Phase", "UnixSocketFile", "bind_unix"]


class Endpoint(Protocol[S]):
    """What a :class:`FrameServer` serves."""

    def open(self, sock: socket.socket, kind: str) -> S | None:
        """A session for a new connection, or None to refuse it (too many clients)."""
        ...

    def handle(self, session: S, body: bytearray) -> tuple[dict[str, Any] | None, int | None]:
        """Reply (None: one-way request) and an fd to pass with it (None: none) for one frame body."""
        ...

    def drop(self, session: S) -> None:
        """The connection ended: release everything ``session`` holds."""
        ...

    def frame_too_large(self, session: S) -> None:
        """Count a frame over the bound (the connection is then closed)."""
        ...


@dataclass(frozen=True)
class ConnLimits:
    """Per-connection bounds a :class:`FrameServer` enforces (None: no bound).

    Attributes:
        handshake_timeout_s: seconds from accept until the endpoint reports the
            connection authenticated (:attr:`Phase.READY`); then it is closed.
        idle_timeout_s: seconds an authenticated connection may wait between
            frames (for a frame's first byte); then it is closed (the endpoint's
            ``drop`` releases its holds).
        frame_timeout_s: seconds to receive the whole of a frame (header and
            body) once its first byte arrived, and to send its reply; a deadline
            for the frame, not per ``recv`` (slow readers and writers are closed).
            Before authentication the handshake deadline also bounds the frame.
        max_connections: connections served at once; a new connection beyond it
            closes the oldest one that is waiting for (or in the middle of) a
            frame rather than being refused; refused (``busy``) only while every
            connection is busy handling a request. Bounds the serving threads to
            ``2 * max_connections`` (closed ones still leaving included).
        max_unauthenticated: connections not yet authenticated at once; a new
            connection beyond it closes the oldest unauthenticated one, so idle
            sockets can never keep an engine (which registers at once) out, nor
            hold more than this many fds.
        handshake_frame_bytes: largest frame body accepted before authentication
            (bytes); after it, :data:`MAX_FRAME_BYTES`.
    """

    handshake_timeout_s: float | None = None
    idle_timeout_s: float | None = None
    frame_timeout_s: float | None = None
    max_unauthenticated: int | None = None
    handshake_frame_bytes: int = MAX_FRAME_BYTES
    max_connections: int | None = None

    def __post_init__(self) -> None:
        for name in ("handshake_timeout_s", "idle_timeout_s", "frame_timeout_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"connection limit {name} must be > 0 seconds (or None: off), got {v}")
        for name in ("max_unauthenticated", "max_connections"):
            n = getattr(self, name)
            if n is not None and n < 1:
                raise ValueError(f"connection limit {name} must be >= 1, got {n}")
        if not 64 <= self.handshake_frame_bytes <= MAX_FRAME_BYTES:
            raise ValueError(
                f"connection limit handshake_frame_bytes must be in 64..{MAX_FRAME_BYTES}, got {self.handshake_frame_bytes}"
            )


class Phase(enum.Enum):
    """Where a connection stands, as its endpoint reports it after each frame."""

    HANDSHAKE = "handshake"  # not authenticated: handshake deadline, unauthenticated cap, small frames
    READY = "ready"  # authenticated: idle timeout between frames
    CLOSE = "close"  # close the connection once the reply is sent (e.g. a failed token)


#: ``accept()`` errors that mean "out of fds or memory now": back off and retry.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
#: ``accept()`` errors about one connection only (it died in the backlog): accept the next.
_TRANSIENT_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN, errno.EPERM})
#: Bounds of the accept back-off (seconds).
ACCEPT_BACKOFF_MIN_S = 0.01
ACCEPT_BACKOFF_MAX_S = 1.0


class FrameServer(Generic[S]):
    """Accept loops and per-connection threads for ``endpoint`` on ``listeners``.

    Args:
        endpoint: what the connections are served by. If it has a
            ``phase(session) -> Phase`` method, a new connection starts in
            :attr:`Phase.HANDSHAKE` and ``limits`` apply by phase; otherwise
            every connection is :attr:`Phase.READY` from the start.
        name: thread name prefix.
        limits: per-connection bounds (default: none).

    An accept that fails for lack of fds or memory (EMFILE, ENFILE, ENOMEM,
    ENOBUFS) is retried after a back-off of 10 ms doubling to 1 s; meanwhile
    :meth:`degraded_reason` says why (the loop never ends before :meth:`close`).
    A connection thread that cannot start closes its connection and drops its
    session.

    Memory a peer can make this class hold: one frame body at a time per
    connection (``handshake_frame_bytes`` before authentication, else
    :data:`MAX_FRAME_BYTES`), freed once handled; one reply at a time (a peer
    that does not read it is closed after ``frame_timeout_s``); no queue of
    pending replies. With the endpoint's connection bound ``C`` and
    ``max_unauthenticated`` ``U``: at most ``C * MAX_FRAME_BYTES +
    U * handshake_frame_bytes`` bytes of frame buffers.
    """

    def __init__(self, endpoint: Endpoint[S], name: str, limits: ConnLimits | None = None):
        self.endpoint = endpoint
        self.name = name
        self.limits = limits or ConnLimits()
        self._phase: Callable[[S], Phase] | None = getattr(endpoint, "phase", None)
        self._stop = threading.Event()
        self._listeners: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._conns: dict[int, socket.socket] = {}
        self._conns_lock = threading.Lock()
        self._pending: dict[int, socket.socket] = {}  # unauthenticated, oldest first; guarded by _conns_lock
        self._waiting: dict[int, None] = {}  # keys reading a frame (evictable), with max_connections; same lock
        self._evicted: set[int] = set()  # keys closed to make room whose thread has not left yet; same lock
        self._keys = itertools.count(1)
        self._degraded: dict[str, str] = {}  # listener kind -> reason; guarded by _conns_lock
        self.evicted_unauthenticated = 0
        self.evicted_connections = 0
        self.accept_failures = 0
        self.thread_start_failures = 0
        self.timeouts = 0

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wait_stopped(self, timeout_s: float | None = None) -> bool:
        """Block until :meth:`close` (or ``timeout_s`` seconds); True once stopped."""
        return self._stop.wait(timeout_s)

    def degraded_reason(self) -> str | None:
        """Why a listener cannot accept connections now (None: every listener accepts)."""
        with self._conns_lock:
            return "; ".join(self._degraded.values()) or None

    def unauthenticated(self) -> int:
        """Connections open and not yet authenticated."""
        with self._conns_lock:
            return len(self._pending)

    def listen(self, lsock: socket.socket) -> None:
        """Serve connections accepted on ``lsock`` (a thread)."""
        self._listeners.append(lsock)
        kind = "unix" if lsock.family == socket.AF_UNIX else "tcp"
        self.spawn(self._accept_loop, f"{self.name}-accept-{kind}", lsock, kind)

    def spawn(self, target: Callable[..., None], name: str, *args: Any) -> threading.Thread:
        """A daemon thread joined by :meth:`close`."""
        t = threading.Thread(target=target, name=name, args=args, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def close(self) -> None:
        """Stop accepting, shut every connection down (each drops its session) and join the threads."""
        self._stop.set()
        for lsock in self._listeners:
            _quiet(lambda: lsock.shutdown(socket.SHUT_RDWR))  # wakes the thread blocked in accept()
            _quiet(lsock.close)
        with self._conns_lock:
            conns = list(self._conns.values())
        for c in conns:
            _quiet(lambda: c.shutdown(socket.SHUT_RDWR))
        for t in self._threads:
            t.join(timeout=5)

    # -- accepting ----------------------------------------------------------------------------
    def _set_degraded(self, kind: str, reason: str | None) -> None:
        with self._conns_lock:
            before = self._degraded.get(kind)
            if reason is None:
                self._degraded.pop(kind, None)
            else:
                self._degraded[kind] = reason
        if before != reason:
            if reason is None:
                log.warning("%s: accepting %s connections again", self.name, kind)
            else:
                log.warning("%s: %s; backing off", self.name, reason)

    def _accept_loop(self, lsock: socket.socket, kind: str) -> None:
        delay = 0.0
        while not self._stop.is_set():
            try:
                conn, _ = lsock.accept()
            except TimeoutError:  # only while degraded: nobody is waiting to connect
                if _fds_available(lsock):
                    self._set_degraded(kind, None)
                    _quiet(lambda: lsock.settimeout(None))
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                if exc.errno in RESOURCE_ERRNOS:
                    self.accept_failures += 1
                    self._set_degraded(kind, f"cannot accept {kind} connections: {exc.strerror or exc}")
                    delay = min(max(2 * delay, ACCEPT_BACKOFF_MIN_S), ACCEPT_BACKOFF_MAX_S)
                    _quiet(lambda: lsock.settimeout(ACCEPT_BACKOFF_MAX_S))
                    self._stop.wait(delay)
                    continue
                if exc.errno in _TRANSIENT_ERRNOS:
                    continue
                return  # the listener is closed
            if delay:
                delay = 0.0
                self._set_degraded(kind, None)
                _quiet(lambda: lsock.settimeout(None))
            try:
                conn.setblocking(True)
                self._admit(conn, kind)
            except Exception:  # one connection's failure must never end the loop
                log.exception("%s: setting up a %s connection failed", self.name, kind)
                _quiet(conn.close)

    def _admit(self, conn: socket.socket, kind: str) -> None:
        if kind == "tcp":
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        key = next(self._keys)
        if not self._add_conn(key, conn):
            _refuse(conn, "too many connections, all busy")
            return
        if self._phase is not None:
            self._add_pending(key, conn)
        try:
            session = self.endpoint.open(conn, kind)
        except BaseException:
            self._gone(key)
            raise
        if session is None:
            self._gone(key)
            _refuse(conn, "too many clients")
            return
        try:
            self._start_conn_thread(key, conn, session)
        except RuntimeError as exc:  # "can't start new thread": close this one, keep accepting
            self.thread_start_failures += 1
            log.warning("%s: cannot start a connection thread (%s); connection closed", self.name, exc)
            self._gone(key)
            try:
                self.endpoint.drop(session)
            finally:
                _quiet(conn.close)

    def _add_conn(self, key: int, conn: socket.socket) -> bool:
        """Count ``conn`` as served; at ``max_connections``, close the oldest connection reading a frame.

        False (refuse ``conn``): every connection is busy handling a request, or
        ``2 * max_connections`` threads are still serving (closed ones leaving included).
        """
        cap = self.limits.max_connections
        victim = None
        with self._conns_lock:
            if cap is not None and len(self._conns) - len(self._evicted) >= cap:
                candidates = [k for k in self._waiting if k not in self._evicted]
                if not candidates or len(self._conns) >= 2 * cap:
                    return False
                oldest = min(candidates)  # keys grow with accept order
                self._evicted.add(oldest)
                victim = self._conns[oldest]
            self._conns[key] = conn
        if victim is not None:
            self.evicted_connections += 1
            _quiet(lambda: victim.shutdown(socket.SHUT_RDWR))  # its thread sees EOF and drops it
        return True

    def _set_waiting(self, key: int, waiting: bool) -> None:
        """Mark connection ``key`` as reading a frame (evictable) or handling one (with ``max_connections``)."""
        if self.limits.max_connections is None:
            return
        with self._conns_lock:
            if waiting:
                self._waiting[key] = None
            else:
                self._waiting.pop(key, None)

    def _gone(self, key: int) -> None:
        """Forget connection ``key`` entirely (its thread left, or never started)."""
        with self._conns_lock:
            self._conns.pop(key, None)
            self._pending.pop(key, None)
            self._waiting.pop(key, None)
            self._evicted.discard(key)

    def _add_pending(self, key: int, conn: socket.socket) -> None:
        """Count ``conn`` as unauthenticated, closing the oldest such connection if at the cap."""
        cap = self.limits.max_unauthenticated
        victim = None
        with self._conns_lock:
            if cap is not None and len(self._pending) >= cap:
                victim = self._pending.pop(next(iter(self._pending)))
            self._pending[key] = conn
            assert cap is None or len(self._pending) <= cap, "unauthenticated connections over the cap"
        if victim is not None:
            self.evicted_unauthenticated += 1
            _quiet(lambda: victim.shutdown(socket.SHUT_RDWR))  # its thread sees EOF and drops it

    def _start_conn_thread(self, key: int, conn: socket.socket, session: S) -> None:
        """Start the thread serving ``conn`` (raises RuntimeError when no thread can start)."""
        threading.Thread(
            target=self._serve, args=(key, conn, session), name=f"{self.name}-conn", daemon=True
        ).start()

    def _authenticated_or_gone(self, key: int) -> None:
        with self._conns_lock:
            self._pending.pop(key, None)

    # -- serving ------------------------------------------------------------------------------
    def _serve(self, key: int, sock: socket.socket, session: S) -> None:
        lim = self.limits
        phase = Phase.READY if self._phase is None else Phase.HANDSHAKE
        handshake_deadline = None if lim.handshake_timeout_s is None else time.monotonic() + lim.handshake_timeout_s
        header = bytearray(HEADER.size)
        try:
            while not self._stop.is_set():
                handshake = phase is Phase.HANDSHAKE
                bound = lim.handshake_frame_bytes if handshake else MAX_FRAME_BYTES
                self._set_waiting(key, True)
                try:
                    body = self._read_frame(sock, header, bound, handshake_deadline if handshake else None)
                except TimeoutError:
                    self.timeouts += 1
                    return
                if body is None:
                    return
                if isinstance(body, int):
                    # The stream cannot be resynchronised: answer and hang up.
                    self.endpoint.frame_too_large(session)
                    sock.settimeout(lim.frame_timeout_s)
                    sock.sendall(pack(error_reply(-1, ErrorCode.TOO_LARGE, f"frame of {body} B exceeds the bound of {bound} B")))
                    return
                self._set_waiting(key, False)
                reply, fd = self.endpoint.handle(session, body)
                del body
                if reply is not None:
                    try:
                        frame = pack(reply)
                    except ProtocolError as exc:  # a reply over the frame bound: say so, keep the stream in step
                        frame = pack(error_reply(reply.get("id", -1), exc.code, str(exc)))
                    sock.settimeout(lim.frame_timeout_s)  # sendall: a bound on the whole reply
                    if fd is not None:
                        socket.send_fds(sock, [frame], [fd])
                    else:
                        sock.sendall(frame)
                if self._phase is not None:
                    now = self._phase(session)
                    if now is Phase.CLOSE:
                        return
                    if phase is Phase.HANDSHAKE and now is Phase.READY:
                        phase = Phase.READY
                        self._authenticated_or_gone(key)
        except OSError:
            return  # connection reset, timed out, or the server is closing
        finally:
            self._gone(key)
            try:
                self.endpoint.drop(session)  # before the close: a peer that sees EOF finds its holds released
            finally:
                _quiet(sock.close)

    def _read_frame(
        self, sock: socket.socket, header: bytearray, bound: int, handshake_deadline: float | None
    ) -> bytearray | int | None:
        """The next frame's body; its length if over ``bound`` (body unread); None on EOF.

        The first byte waits for the idle timeout (authenticated) or the handshake
        deadline; from then the whole frame must arrive within ``frame_timeout_s``
        seconds (and by ``handshake_deadline``, a ``time.monotonic`` point, if given).

        Raises:
            TimeoutError: a deadline passed. OSError: the socket failed.
        """
        lim = self.limits
        view = memoryview(header)
        if handshake_deadline is not None:
            first: float | None = handshake_deadline
        else:
            first = None if lim.idle_timeout_s is None else time.monotonic() + lim.idle_timeout_s
        if not _recv_by(sock, view[:1], first):
            return None
        deadline = None if lim.frame_timeout_s is None else time.monotonic() + lim.frame_timeout_s
        if handshake_deadline is not None:
            deadline = handshake_deadline if deadline is None else min(deadline, handshake_deadline)
        if not _recv_by(sock, view[1:], deadline):
            return None
        (n,) = HEADER.unpack(header)
        if n > bound:
            return int(n)
        body = bytearray(n)
        return body if _recv_by(sock, memoryview(body), deadline) else None


def _recv_by(sock: socket.socket, view: memoryview, deadline: float | None) -> bool:
    """:func:`recv_exact` of ``view`` by ``deadline`` (``time.monotonic`` seconds; None: no bound)."""
    if deadline is None:
        sock.settimeout(None)
    return recv_exact(sock, view, deadline)


def _refuse(conn: socket.socket, why: str) -> None:
    """Answer ``busy`` without waiting on the peer, and close."""
    conn.setblocking(False)
    _quiet(lambda: conn.send(pack(error_reply(-1, ErrorCode.BUSY, why))))
    _quiet(conn.close)


def _fds_available(lsock: socket.socket) -> bool:
    """Whether this process can open a file descriptor now (duplicates ``lsock``'s and closes it)."""
    try:
        os.close(os.dup(lsock.fileno()))
    except OSError:
        return False
    return True


def _quiet(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:
        pass
