"""Listening sockets and the per-connection serve loop shared by every kvtier endpoint.

One acceptor thread per listener and one thread per connection: a connection
reads a frame, hands its body to the endpoint's ``handle``, writes the reply
(with a file descriptor attached when the endpoint passes one), and when the
connection ends for whatever reason calls the endpoint's ``drop`` exactly once,
before the socket is closed.

Hostile or broken peers are bounded (:class:`ConnLimits`): a deadline to
authenticate, a cap on connections not yet authenticated, an idle timeout, a
per-frame timeout and a small frame bound before authentication. Resource
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
            frames; then it is closed (the endpoint's ``drop`` releases its holds).
        frame_timeout_s: seconds to receive the rest of a frame once its header
            arrived, and to send its reply (slow readers and writers are closed).
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

    def __post_init__(self) -> None:
        for name in ("handshake_timeout_s", "idle_timeout_s", "frame_timeout_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"connection limit {name} must be > 0 seconds (or None: off), got {v}")
        if self.max_unauthenticated is not None and self.max_unauthenticated < 1:
            raise ValueError(f"connection limit max_unauthenticated must be >= 1, got {self.max_unauthenticated}")
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
        self._keys = itertools.count(1)
        self._degraded: dict[str, str] = {}  # listener kind -> reason; guarded by _conns_lock
        self.evicted_unauthenticated = 0
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
        if self._phase is not None:
            self._add_pending(key, conn)
        try:
            session = self.endpoint.open(conn, kind)
        except BaseException:
            self._authenticated_or_gone(key)
            raise
        if session is None:
            self._authenticated_or_gone(key)
            _refuse(conn, "too many clients")
            return
        try:
            self._start_conn_thread(key, conn, session)
        except RuntimeError as exc:  # "can't start new thread": close this one, keep accepting
            self.thread_start_failures += 1
            log.warning("%s: cannot start a connection thread (%s); connection closed", self.name, exc)
            self._authenticated_or_gone(key)
            try:
                self.endpoint.drop(session)
            finally:
                _quiet(conn.close)

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
        with self._conns_lock:
            self._conns[key] = sock
        lim = self.limits
        phase = Phase.READY if self._phase is None else Phase.HANDSHAKE
        handshake_deadline = None if lim.handshake_timeout_s is None else time.monotonic() + lim.handshake_timeout_s
        header = bytearray(HEADER.size)
        try:
            while not self._stop.is_set():
                if phase is Phase.HANDSHAKE:
                    bound = lim.handshake_frame_bytes
                    wait = None if handshake_deadline is None else max(handshake_deadline - time.monotonic(), 0.001)
                else:
                    bound, wait = MAX_FRAME_BYTES, lim.idle_timeout_s
                sock.settimeout(wait)
                try:
                    if not recv_exact(sock, memoryview(header)):
                        return
                except TimeoutError:
                    self.timeouts += 1
                    return
                sock.settimeout(lim.frame_timeout_s)
                (n,) = HEADER.unpack(header)
                if n > bound:
                    # The stream cannot be resynchronised: answer and hang up.
                    self.endpoint.frame_too_large(session)
                    sock.sendall(pack(error_reply(-1, ErrorCode.TOO_LARGE, f"frame of {n} B exceeds the bound of {bound} B")))
                    return
                body = bytearray(n)
                if not recv_exact(sock, memoryview(body)):
                    return
                reply, fd = self.endpoint.handle(session, body)
                del body
                if reply is not None:
                    try:
                        frame = pack(reply)
                    except ProtocolError as exc:  # a reply over the frame bound: say so, keep the stream in step
                        frame = pack(error_reply(reply.get("id", -1), exc.code, str(exc)))
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
            with self._conns_lock:
                self._conns.pop(key, None)
            self._authenticated_or_gone(key)
            try:
                self.endpoint.drop(session)  # before the close: a peer that sees EOF finds its holds released
            finally:
                _quiet(sock.close)


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
