"""The scheduler-to-worker lookup endpoint of one engine (the control plane's second speaker).

vLLM's multi-process engine runs the scheduler and the model worker in
different processes, but a lookup must be answered and leased by the manager
that will serve the load. The worker runs a :class:`LookupServer` on an
owner-only Unix socket; the scheduler calls it through :class:`LookupClient`.
Both speak :mod:`kvtier.protocol` (same framing, messages, tier table, error
codes and back-off as the cache service) and the server answers with the cache
server's own lookup/release code path (:mod:`kvtier.service.lease_ops`). Only
``lookup``, ``release``, ``health`` and ``clear`` (the connector's ``reset_cache``: this
engine's own tiers) are served; there is no ``register`` and
lease owners are not prefixed (the worker releases them by the same name).

Failure rule: a call never blocks longer than ``timeout_s``; a failed call is a
miss, and its lease does not outlive it (the server ends it on a handler error;
on a client timeout the connection is dropped, which ends every lease it was
granted, and the client sends a release once it is back). After a failure the
client reports misses without calling until the shared back-off passes.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Sequence

import blake3

from kvtier import protocol as P
from kvtier.protocol import Backoff, ErrorCode, ProtocolError
from kvtier.protocol.transport import check_socket_dir, private_runtime_dir
from kvtier.service.lease_ops import LeaseManager, lookup_op, release_op
from kvtier.service.listener import ConnLimits, FrameServer, bind_unix
from kvtier.service.session import Holds
from kvtier.storage.types import LookupResult

log = logging.getLogger(__name__)

#: Connections served at once (a scheduler needs one); a new one beyond closes the oldest one
#: waiting for a frame (stalled or idle), so stalled sockets cannot lock the scheduler out.
MAX_CONNECTIONS = 16
#: Seconds a started frame (header and body) has to arrive, and its reply to be sent; a peer
#: that sends part of a frame and stalls is closed after it.
FRAME_TIMEOUT_S = 2.0


def socket_path(instance: str) -> str:
    """Owner-only Unix socket of one engine instance's lookup endpoint (in a 0700 per-user directory).

    ``instance`` names one engine instance (``modes.engine_instance``: its engine id, vLLM's
    per-instance id and its data-parallel rank). The file name is a digest of all of it, so
    engines whose ids differ only in characters a file name cannot hold, or only after some
    length, get their own sockets (a sanitised, cut id did not: "a.b" and "ab" shared one).
    """
    digest = blake3.blake3(instance.encode("utf-8")).hexdigest()[:32]
    return os.path.join(private_runtime_dir(), f"kvtier-lookup-{digest}.sock")


class LookupServer:
    """Serves ``lookup``/``release``/``health`` for ``manager`` on ``path`` (background threads).

    Args:
        manager: the worker's storage manager (anything with ``lookup_keys``,
            ``release`` and ``abort``).
        path: Unix socket path; its directory is created 0700 and must be
            private to this user.
        frame_timeout_s: seconds a started frame (header and body) has to arrive
            and its reply to be sent; the connection is closed after it.
        max_connections: connections served at once (one thread each); a new one
            beyond closes the oldest connection waiting for a frame (stalled or
            idle; its leases end), and is refused only while all are busy.

    Raises:
        UnsafeSocketDir: the directory is another user's or group/other-writable.
        ValueError: a non-positive frame_timeout_s or max_connections.
        RuntimeError: ``path`` exists: it is never replaced (the name is unique per engine
            instance, so it is another process's socket, or this instance's twice).
        OSError: the socket cannot be bound.
    """

    def __init__(
        self, manager: LeaseManager, path: str, frame_timeout_s: float = FRAME_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ):
        self.manager = manager
        self.path = path
        self.errors = 0
        # No idle timeout: the scheduler keeps its one connection open between calls.
        limits = ConnLimits(frame_timeout_s=frame_timeout_s, max_connections=max_connections)
        self._frames: FrameServer[Holds] = FrameServer(self, "kvtier-lookup", limits)
        self._unix = bind_unix(path, replace_stale=False)
        self._frames.listen(self._unix.sock)

    # -- Endpoint --------------------------------------------------------------------------
    def open(self, sock: socket.socket, kind: str) -> Holds | None:
        return Holds(max_holds=0)  # the FrameServer bounds the connections (max_connections)

    def frame_too_large(self, session: Holds) -> None:
        self.errors += 1

    def handle(self, holds: Holds, body: bytearray) -> tuple[dict[str, Any] | None, int | None]:
        try:
            env, req = P.decode_request_body(body)
        except ProtocolError as exc:
            self.errors += 1
            return (None if exc.noreply else P.error_reply(exc.req_id, exc.code, str(exc))), None
        try:
            if isinstance(req, P.Lookup):
                _, codes = lookup_op(self.manager, holds, "", req)
                out: dict[str, Any] = {"tiers": codes}
            elif isinstance(req, P.ReleaseLease):
                release_op(self.manager, holds, "", req)
                out = {}
            elif isinstance(req, P.Health):
                out = {"status": "ok", "pid": os.getpid()}
            elif isinstance(req, P.Clear):
                out = {"removed": self.manager.clear()}  # type: ignore[attr-defined]
            else:
                raise ProtocolError(ErrorCode.UNSUPPORTED, f"the lookup endpoint does not serve {req.OP!r}")
            reply = P.ok_reply(env.req_id, **out)
        except ProtocolError as exc:
            self.errors += 1
            reply = P.error_reply(env.req_id, exc.code, str(exc))
        except Exception as exc:  # a failing tier or a bug: an error reply, never a dead endpoint
            self.errors += 1
            log.exception("kvtier lookup endpoint: %s failed", req.OP)
            reply = P.error_reply(env.req_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        return (None if env.noreply else reply), None

    def drop(self, holds: Holds) -> None:
        holds.release_all(self.manager)

    def close(self) -> None:
        """Stop serving (ending every lease granted over a connection still open) and remove the socket."""
        self._frames.close()
        self._unix.remove()  # only the file this endpoint created


class LookupClient:
    """Scheduler-side stub of the worker manager's lookup and lease release.

    Args:
        path: the endpoint's socket path.
        chunk_size: tokens per chunk (to turn hit chunks into tokens).
        timeout_s: bound on each call, seconds; a call that times out is a miss.
        backoff_min_s / backoff_max_s: after a failure, calls are misses without
            touching the network for a jittered delay that doubles from
            ``backoff_min_s`` up to ``backoff_max_s`` (:class:`kvtier.protocol.Backoff`).

    Raises:
        ValueError: non-positive timeout or chunk size, or a bad back-off range.
    """

    def __init__(
        self,
        path: str,
        chunk_size: int,
        timeout_s: float = 0.5,
        backoff_min_s: float = 0.05,
        backoff_max_s: float = 2.0,
    ):
        if timeout_s <= 0 or chunk_size <= 0:
            raise ValueError("timeout_s and chunk_size must be positive")
        self.path = path
        self.chunk_size = chunk_size
        self.timeout_s = timeout_s
        self._backoff = Backoff(backoff_min_s, backoff_max_s)
        self._sock: socket.socket | None = None
        self._buf = bytearray(64 * 1024)
        self._next_id = 0
        self._lock = threading.Lock()
        self._unreleased: list[str] = []  # owners whose call failed: released when the endpoint is back
        self.failures = 0

    def lookup_keys(self, keys: Sequence[bytes], lease_owner: str | None) -> LookupResult:
        """Longest prefix of ``keys`` the worker's tiers hold, leased to ``lease_owner`` if given.

        Returns ``LookupResult(0)`` on any failure (and the lease does not outlive it).
        """
        keys = list(keys[: P.MAX_KEYS])
        reply = self._call(P.Lookup(keys, lease_owner), lease_owner)
        codes = None if reply is None else reply.get("tiers")
        tiers = P.decode_tiers(codes) if isinstance(codes, bytes) and len(codes) <= len(keys) else None
        if tiers is None:
            if reply is not None and lease_owner is not None:
                self._call(P.ReleaseLease(lease_owner), None)  # a reply we cannot use: give the lease back
            return LookupResult(0)
        return LookupResult(len(tiers) * self.chunk_size, keys[: len(tiers)], tiers)

    def release(self, lease_owner: str) -> None:
        """End ``lease_owner``'s lease (when unreachable, the dropped connection already ended it)."""
        self._call(P.ReleaseLease(lease_owner), None)

    def clear(self, timeout_s: float = 60.0) -> dict[str, int] | None:
        """Remove this namespace's chunks from every tier of the worker's manager (it flushes its
        write-behind first, so this may take up to ``timeout_s`` seconds).

        Returns:
            Chunks removed per tier, or None when the call failed (nothing is known removed).
        """
        reply = self._call(P.Clear(), None, timeout_s=timeout_s)
        removed = None if reply is None else reply.get("removed")
        return dict(removed) if isinstance(removed, dict) else None

    def close(self) -> None:
        with self._lock:
            self._disconnect()

    # -- one call ------------------------------------------------------------------------------
    def _call(self, req: P.Request, owner: str | None, timeout_s: float | None = None) -> dict[str, Any] | None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        if not self._lock.acquire(timeout=timeout_s):
            return None
        try:
            if self._backoff.waiting():
                return None  # not sent: no lease was granted
            try:
                sock = self._connected()
                while self._unreleased:
                    self._exchange(sock, P.ReleaseLease(self._unreleased[0]), deadline)
                    self._unreleased.pop(0)
                reply = self._exchange(sock, req, deadline)
            except (OSError, ValueError) as exc:  # timeouts are OSError; ProtocolError is a ValueError
                self._fail(exc)
                self._remember(owner)
                return None
            self._backoff.reset()
            if not reply.get("ok"):
                log.warning("kvtier lookup endpoint refused %s: %s %s", req.OP, reply.get("code"), reply.get("error"))
                return None
            return reply
        finally:
            self._lock.release()

    def _connected(self) -> socket.socket:
        if self._sock is None:
            check_socket_dir(self.path)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.settimeout(self.timeout_s)
                s.connect(self.path)
            except BaseException:
                s.close()
                raise
            self._sock = s
        return self._sock

    def _exchange(self, sock: socket.socket, req: P.Request, deadline: float) -> dict[str, Any]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("no time left for the call")
        sock.settimeout(left)
        self._next_id += 1
        rid = self._next_id
        sock.sendall(P.encode_request(req, rid))
        reply, _ = P.read_reply(sock, self._buf, deadline)
        if reply.get("id") != rid:
            raise ProtocolError(ErrorCode.DESYNC, "reply for another request")
        return reply

    def _remember(self, owner: str | None) -> None:
        if owner is not None and owner not in self._unreleased:
            self._unreleased.append(owner)
            del self._unreleased[:-1024]

    def _fail(self, exc: BaseException) -> None:
        # A timed-out exchange leaves the stream mid-reply: start a new connection.
        self._disconnect()
        self.failures += 1
        delay = self._backoff.next_delay()
        log.warning("kvtier lookup call failed (%s: %s); reporting misses for %.2f s", type(exc).__name__, exc, delay)

    def _disconnect(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
