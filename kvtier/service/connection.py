"""The cache-service client's connection: register, map the segment, call, reconnect.

Failure rule (the engine never waits on a sick server):

- Every call returns within ``timeout_s`` (waiting for another thread's call on
  the same connection included). A call that cannot finish in time, a broken
  connection, an unreachable server, a reply that does not fit its typed
  struct (:mod:`kvtier.protocol.replies`, ``BAD_REPLY``) or hands out a slot or
  handle out of range or twice (:mod:`kvtier.service.reply_checks`, ``BAD_REPLY``,
  the connection dropped) gives ``None`` (the caller's miss).
- A failed connection is closed (the server then releases everything this
  client held) and a background thread reconnects with the control plane's one
  back-off policy (:class:`kvtier.protocol.Backoff`), registering again and
  mapping the (possibly new) segment. Calls made meanwhile are misses without
  touching the network.
- Every connection has a generation; a call pinned to an older generation
  (a commit or unload of something an earlier connection held) is dropped,
  never applied to a newer one.

Not fork-safe: create it in the process that uses it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import msgspec
import numpy as np

from kvtier import protocol as P
from kvtier.protocol import Backoff, ErrorCode, ProtocolError, UnsafeSocketDir, check_socket_dir
from kvtier.protocol.framing import read_reply_body, time_left
from kvtier.protocol.replies import RegisterReply, Reply, decode_reply
from kvtier.protocol.reply_bounds import MAX_REPLY_BYTES
from kvtier.memory.shared_segment import SharedSegment

log = logging.getLogger(__name__)

#: The reply buffer: a header plus the largest legitimate reply of any op (kvtier.protocol.reply_bounds).
_RECV_BYTES = P.HEADER.size + MAX_REPLY_BYTES
T = TypeVar("T")
R = TypeVar("R", bound=Reply)


@dataclass
class ClientCounters:
    """Monotonic counters of one client (calls, not chunks)."""

    connects: int = 0
    connect_failures: int = 0
    disconnects: int = 0
    timeouts: int = 0
    skipped_calls: int = 0  # answered as a miss without a connection
    error_replies: int = 0
    lost_stores: int = 0  # commits dropped because their connection ended
    corrupt_loads: int = 0  # loaded chunks this client found differing from their commit checksum


class Conn:
    """One registered connection: socket, mapped segment and its slot views.

    Attributes:
        slots: ``uint8 [num_slots, slot_bytes]`` view of the server's CPU pool.
        gen: generation (1 for the first connection of a client, then +1).
    """

    def __init__(self, sock: socket.socket, segment: SharedSegment, slot_bytes: int, num_slots: int):
        self.sock = sock
        self.segment = segment
        self.slots = segment.array[: slot_bytes * num_slots].reshape(num_slots, slot_bytes)
        self.num_slots = num_slots
        self.gen = 0
        self.next_id = 0
        self.buf = bytearray(_RECV_BYTES)

    def slot(self, v: object) -> np.ndarray | None:
        """The view of slot ``v`` if it is a valid slot index, else None."""
        return self.slots[v] if type(v) is int and 0 <= v < self.num_slots else None

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            self.slots = np.empty((0, 0), dtype=np.uint8)
            self.segment.close()  # unmapped once the last view handed out is gone


class ServiceConnection:
    """A self-healing registered connection to ``kvtier server``.

    Args:
        family / addr: from :func:`kvtier.protocol.parse_address`.
        register: the ``register`` request sent on every (re)connect.
        timeout_s: bound on each call, seconds.
        connect_timeout_s: bound on connecting and registering.
        backoff: reconnect delays.
    """

    def __init__(
        self,
        family: str,
        addr: Any,
        register: P.Register,
        timeout_s: float,
        connect_timeout_s: float,
        backoff: Backoff,
        counters: ClientCounters,
    ):
        self.family, self.addr = family, addr
        self.register = register
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.backoff = backoff
        self.counters = counters
        self.server_pid: int | None = None
        self.conn: Conn | None = None
        self._gen = 0
        self._lock = threading.Lock()  # serialises calls on the connection
        self._closed = threading.Event()
        self._need_connect = threading.Event()
        self._need_connect.set()
        self.connected_event = threading.Event()
        self._last_refusal = ""
        self._thread = threading.Thread(target=self._connect_loop, name="kvtier-service-connect", daemon=True)
        self._thread.start()

    def _connect_loop(self) -> None:
        while not self._closed.is_set():
            self._need_connect.wait()
            if self._closed.is_set():
                return
            try:
                conn = self._open()
            except Exception as exc:
                self.counters.connect_failures += 1
                msg = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, (ProtocolError, UnsafeSocketDir)) and msg != self._last_refusal:
                    log.error("kvtier server %s refused this client: %s", self.addr, exc)
                    self._last_refusal = msg
                else:
                    log.debug("kvtier server %s unreachable: %s", self.addr, msg)
                self._closed.wait(self.backoff.next_delay())
                continue
            with self._lock:
                if self._closed.is_set():
                    conn.close()
                    return
                self._gen += 1
                conn.gen = self._gen
                self.conn = conn
                self._need_connect.clear()
                self.connected_event.set()
            self.counters.connects += 1
            self._last_refusal = ""
            self.backoff.reset()
            log.info("kvtier: connected to cache server %s (pid %s)", self.addr, self.server_pid)

    def _open(self) -> Conn:
        if self.family == "unix":
            check_socket_dir(self.addr)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in self.addr[0] else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            # One deadline for connect + register + its reply (each recv gets the time left).
            deadline = time.monotonic() + self.connect_timeout_s
            sock.settimeout(self.connect_timeout_s)
            sock.connect(self.addr)
            time_left(sock, deadline)
            sock.sendall(P.encode_request(self.register, 0))
            fds: list[int] = []
            time_left(sock, deadline)
            if self.family == "unix":
                head, fds, _, _ = socket.recv_fds(sock, P.HEADER.size, 4)
            else:
                head = sock.recv(P.HEADER.size)
            try:
                conn = self._registered(sock, head, fds, deadline)
            finally:
                for fd in fds:
                    os.close(fd)
            sock.settimeout(self.timeout_s)
            return conn
        except BaseException:
            sock.close()
            raise

    def _registered(self, sock: socket.socket, head: bytes, fds: list[int], deadline: float) -> Conn:
        head = head + _recv_n(sock, P.HEADER.size - len(head), deadline)
        (n,) = P.HEADER.unpack(head)
        if n > P.MAX_FRAME_BYTES:
            raise ProtocolError(ErrorCode.TOO_LARGE, "register reply too large")
        reply = decode_reply(_REGISTER_REPLY, _recv_n(sock, n, deadline))
        if not reply.ok:
            raise ProtocolError(reply.code, reply.error)
        seg = reply.segment
        if seg is None:
            raise ProtocolError(ErrorCode.BAD_REPLY, "register reply lacks the segment geometry")
        size, slot_bytes, num_slots = seg.size, seg.slot_bytes, seg.num_slots
        if min(size, slot_bytes, num_slots) <= 0:
            raise ProtocolError(ErrorCode.BAD_REPLY, "register reply has a non-positive segment geometry")
        if slot_bytes != self.register.chunk_bytes or size < slot_bytes * num_slots:
            raise ProtocolError(ErrorCode.BAD_REPLY, "server slots do not match this namespace's chunk_bytes")
        try:  # a segment it cannot map safely (unsealed, short): a failed connect, never a SIGBUS later
            if fds:
                segment = SharedSegment.attach_fd(fds.pop(0), size)
            elif seg.path is not None:
                segment = SharedSegment.attach_path(seg.path, size)
            else:
                raise ProtocolError(ErrorCode.BAD_REPLY, "no shared segment received")
        except ProtocolError:
            raise
        except ValueError as exc:
            raise ProtocolError(ErrorCode.BAD_REPLY, f"unusable shared segment: {exc}") from None
        self.server_pid = reply.server_pid
        return Conn(sock, segment, slot_bytes, num_slots)

    def _drop(self, conn: Conn, why: object) -> None:
        """Close a failed connection (caller holds ``_lock``) and wake the reconnect thread."""
        if self.conn is conn:
            self.conn = None
            self.connected_event.clear()
            self.counters.disconnects += 1
            log.warning("kvtier: cache server connection lost (%s); calls are misses until it is back", why)
            try:
                conn.close()
            except Exception:
                pass
            if not self._closed.is_set():
                self._need_connect.set()

    def call(
        self, req: P.Request, noreply: bool = False, gen: int | None = None, timeout_s: float | None = None
    ) -> tuple[dict[str, Any] | None, Conn | None]:
        """Send ``req``; returns ``(reply map, conn)``, reply None on any failure (a miss).

        ``gen``: only send on the connection of that generation. An error reply
        gives ``(None, conn)``.
        """
        return self._call(req, noreply, gen, timeout_s, _map_reply, {"ok": True})

    def call_typed(
        self, req: P.Request, decoder: "msgspec.msgpack.Decoder[R]", gen: int | None = None,
        timeout_s: float | None = None, check: Callable[[R, Conn], None] | None = None,
    ) -> tuple[R | None, Conn | None]:
        """:meth:`call` whose reply is decoded by ``decoder`` into a typed reply
        (:mod:`kvtier.protocol.replies`); a reply that does not fit drops the connection
        (``BAD_REPLY``: the server releases what it granted). ``check(reply, conn)`` runs on
        an ok reply and refuses it the same way by raising ``ProtocolError`` (e.g.
        :mod:`kvtier.service.reply_checks`: slots out of range or granted twice)."""
        return self._call(req, False, gen, timeout_s, lambda body: _typed_reply(decoder, body), None, check)

    def _call(
        self, req: P.Request, noreply: bool, gen: int | None, timeout_s: float | None,
        read: Callable[[memoryview], tuple[T, object, bool]], sent: T | None,
        check: Callable[[T, Conn], None] | None = None,
    ) -> tuple[T | None, Conn | None]:
        """The call; ``read`` decodes a reply body into (reply, its id, ok); ``sent`` is what a
        one-way request (``noreply``) returns once sent; ``check`` vets an ok reply (raising
        ``ProtocolError`` drops the connection: a miss)."""
        if self.conn is None:
            self.counters.skipped_calls += 1
            return None, None
        budget = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        if not self._lock.acquire(timeout=budget):
            self.counters.timeouts += 1
            return None, None
        conn = self.conn
        retimed = False
        try:
            if conn is None or (gen is not None and conn.gen != gen):
                self.counters.skipped_calls += 1
                return None, None
            try:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.counters.timeouts += 1
                    return None, None
                if timeout_s is not None or left < 0.9 * self.timeout_s:
                    conn.sock.settimeout(left)
                    retimed = True
                conn.next_id += 1
                rid = conn.next_id
                conn.sock.sendall(P.encode_request(req, rid, noreply))
                if noreply:
                    return sent, conn
                body, more = read_reply_body(conn.sock, conn.buf, deadline)
                retimed = retimed or more
                reply, reply_id, ok = read(body)
                if reply_id != rid:
                    raise ProtocolError(ErrorCode.DESYNC, "reply for another request")
                if ok and check is not None:
                    check(reply, conn)
            except (OSError, ValueError) as exc:  # timeouts are OSError; ProtocolError is a ValueError
                if isinstance(exc, socket.timeout):
                    self.counters.timeouts += 1
                self._drop(conn, exc)
                return None, None
            if not ok:
                self.counters.error_replies += 1
                log.debug("kvtier server refused %s: %s", req.OP, _refusal(reply))
                return None, conn
            return reply, conn
        finally:
            if retimed and self.conn is conn and conn is not None:
                try:
                    conn.sock.settimeout(self.timeout_s)
                except OSError:
                    pass
            self._lock.release()

    def close(self) -> None:
        """Disconnect (the server releases this client's reservations, reads and leases)."""
        self._closed.set()
        self._need_connect.set()
        with self._lock:
            conn, self.conn = self.conn, None
            if conn is not None:
                conn.close()
        self._thread.join(timeout=self.connect_timeout_s + 1)


_REGISTER_REPLY = msgspec.msgpack.Decoder(RegisterReply)


def _map_reply(body: memoryview) -> tuple[dict[str, Any], object, bool]:
    reply = P.unpack_body(body)
    return reply, reply.get("id"), bool(reply.get("ok"))


def _typed_reply(decoder: "msgspec.msgpack.Decoder[R]", body: memoryview) -> tuple[R, object, bool]:
    reply = decode_reply(decoder, body)
    return reply, reply.id, reply.ok


def _refusal(reply: object) -> str:
    if isinstance(reply, Reply):
        return f"{reply.code} {reply.error}"
    return f"{reply.get('code')} {reply.get('error')}" if isinstance(reply, dict) else ""


def _recv_n(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes from ``sock`` by ``deadline`` (``time.monotonic`` seconds).

    Raises:
        socket.timeout: not all in time. ConnectionResetError: the server closed the connection.
    """
    out = bytearray()
    while len(out) < n:
        time_left(sock, deadline)
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionResetError("server closed the connection")
        out += chunk
    return bytes(out)
