"""Listening sockets and the per-connection serve loop shared by every kvtier endpoint.

One acceptor thread per listener and one thread per connection: a connection
reads a frame, hands its body to the endpoint's ``handle``, writes the reply
(with a file descriptor attached when the endpoint passes one), and when the
connection ends for whatever reason calls the endpoint's ``drop`` exactly once.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
from typing import Any, Callable, Generic, Protocol, TypeVar

from kvtier.protocol import (
    HEADER,
    MAX_FRAME_BYTES,
    ErrorCode,
    ProtocolError,
    error_reply,
    make_socket_dir,
    pack,
    recv_exact,
)

log = logging.getLogger(__name__)

S = TypeVar("S")


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


def bind_unix(path: str) -> socket.socket:
    """Listen on the Unix socket ``path``, owner-only (socket 0600, directory 0700).

    A stale socket of a dead process is replaced.

    Raises:
        UnsafeSocketDir: the directory is another user's or group/other-writable.
        RuntimeError: ``path`` is not a socket, or a live server listens on it.
        OSError: the socket cannot be bound.
    """
    make_socket_dir(path)
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise RuntimeError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale socket of a dead server
        else:
            raise RuntimeError(f"another kvtier server is listening on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(128)
    return sock


def unlink_socket(path: str) -> None:
    """Remove ``path`` if it is a socket (quietly)."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass


class FrameServer(Generic[S]):
    """Accept loops and per-connection threads for ``endpoint`` on ``listeners``."""

    def __init__(self, endpoint: Endpoint[S], name: str):
        self.endpoint = endpoint
        self.name = name
        self._stop = threading.Event()
        self._listeners: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._conns: dict[int, socket.socket] = {}
        self._conns_lock = threading.Lock()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wait_stopped(self, timeout_s: float | None = None) -> bool:
        """Block until :meth:`close` (or ``timeout_s`` seconds); True once stopped."""
        return self._stop.wait(timeout_s)

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

    def _accept_loop(self, lsock: socket.socket, kind: str) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = lsock.accept()
            except OSError:
                return  # listener closed
            if kind == "tcp":
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            session = self.endpoint.open(conn, kind)
            if session is None:
                _quiet(lambda: conn.sendall(pack(error_reply(-1, ErrorCode.BUSY, "too many clients"))))
                conn.close()
                continue
            threading.Thread(
                target=self._serve, args=(conn, session), name=f"{self.name}-conn", daemon=True
            ).start()

    def _serve(self, sock: socket.socket, session: S) -> None:
        key = id(sock)
        with self._conns_lock:
            self._conns[key] = sock
        header = bytearray(HEADER.size)
        try:
            while not self._stop.is_set():
                if not recv_exact(sock, memoryview(header)):
                    return
                (n,) = HEADER.unpack(header)
                if n > MAX_FRAME_BYTES:
                    # The stream cannot be resynchronised: answer and hang up.
                    self.endpoint.frame_too_large(session)
                    sock.sendall(pack(error_reply(-1, ErrorCode.TOO_LARGE, f"frame of {n} B exceeds the bound")))
                    return
                body = bytearray(n)
                if not recv_exact(sock, memoryview(body)):
                    return
                reply, fd = self.endpoint.handle(session, body)
                if reply is None:
                    continue
                try:
                    frame = pack(reply)
                except ProtocolError as exc:  # a reply over the frame bound: say so, keep the stream in step
                    frame = pack(error_reply(reply.get("id", -1), exc.code, str(exc)))
                if fd is not None:
                    socket.send_fds(sock, [frame], [fd])
                else:
                    sock.sendall(frame)
        except OSError:
            return  # connection reset, or the server is closing
        finally:
            with self._conns_lock:
                self._conns.pop(key, None)
            _quiet(sock.close)
            self.endpoint.drop(session)


def _quiet(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:
        pass
