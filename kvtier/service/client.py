"""The engine-side client of ``kvtier server``: a :class:`kvtier.storage.backend.KVStore`.

``ServiceClient`` has exactly the storage interface of the embedded
:class:`~kvtier.storage.manager.StorageManager`, so a connector switches between
the two with one setting. Buffers it returns (``open_write`` and
``ReadHandle.buffer``) are ``uint8 [chunk_bytes]`` views of the server's
shared-memory segment mapped into this process: the copy into or out of them is
the only payload copy, and no payload byte crosses the socket.

Failure rule (the engine never waits on a sick server):

- Every data-plane call returns within ``timeout_s`` (waiting for another
  thread's call on the same connection included). A call that cannot finish in
  time, a broken connection or an unreachable server gives a miss: lookups find
  nothing, ``open_write``/``open_read`` return None, commits are dropped.
- A failed connection is closed (the server then releases everything this
  client held) and a background thread reconnects with exponential back-off
  (``backoff_min_s`` doubling to ``backoff_max_s``, with jitter), registering
  again and mapping the (possibly new) segment. Calls made meanwhile are misses
  without touching the network.
- Reservations and read handles belong to one connection (its generation): a
  commit or close for an older connection is dropped, never applied to a new one.

Not fork-safe: create the client in the process that uses it.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Sequence

import numpy as np

from kvtier.index.keys import KeyNamespace
from kvtier.service import protocol as P
from kvtier.service.shm import SharedSegment
from kvtier.storage.manager import LookupResult, RequestRecord

log = logging.getLogger(__name__)

_RECV_BYTES = 64 * 1024


class ServiceUnavailable(RuntimeError):
    """Raised only by :meth:`ServiceClient.wait_connected` when no connection came up in time."""


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


def parse_address(address: str) -> tuple[str, Any]:
    """``unix:///path``, ``/path``, or ``tcp://host:port`` -> (family, address).

    Raises:
        ValueError: anything else.
    """
    if address.startswith("unix://"):
        return "unix", address[len("unix://") :]
    if address.startswith("/"):
        return "unix", address
    if address.startswith("tcp://"):
        host, sep, port = address[len("tcp://") :].rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"TCP address must be tcp://host:port, got {address!r}")
        return "tcp", (host.strip("[]") or "127.0.0.1", int(port))
    raise ValueError(f"server address must be unix:///path or tcp://host:port, got {address!r}")


class _Conn:
    """One registered connection: socket, mapped segment and slot views."""

    def __init__(self, sock: socket.socket, segment: SharedSegment, slot_bytes: int, num_slots: int, gen: int):
        self.sock = sock
        self.segment = segment
        self.slots = segment.array[: slot_bytes * num_slots].reshape(num_slots, slot_bytes)
        self.num_slots = num_slots
        self.gen = gen
        self.next_id = 0
        self.buf = bytearray(_RECV_BYTES)

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            self.slots = np.empty((0, 0), dtype=np.uint8)
            self.segment.close()  # unmapped once the last view handed out is gone


class ServiceReadHandle:
    """A chunk held for reading in the server: ``buffer`` stays valid until ``close()``.

    Attributes:
        key: chunk key.
        buffer: ``uint8 [chunk_bytes]`` view of the slot in this process's mapping.
        source: tier that served it ("cpu", or "disk" if promoted for this load).
    """

    __slots__ = ("_client", "_gen", "_handle", "key", "buffer", "source")

    def __init__(self, client: "ServiceClient", gen: int, handle: int, key: bytes, buffer: np.ndarray, source: str):
        self._client: ServiceClient | None = client
        self._gen = gen
        self._handle = handle
        self.key = key
        self.buffer = buffer
        self.source = source

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client._unload(self._gen, self._handle)

    def __enter__(self) -> "ServiceReadHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ServiceClient:
    """Storage client of a ``kvtier server`` for one key namespace.

    Args:
        address: ``unix:///path/to.sock`` (or a bare path) or ``tcp://host:port``.
        namespace: this engine's key namespace; the server refuses a namespace it
            cannot host, and ``chunk_bytes`` must match its slots.
        client_id: engine identity (<= 256 chars). Connections with the same id
            share lease owners and request records (an engine's scheduler and
            worker); use a distinct id per engine. Default: unique per client.
        timeout_s: bound on each data-plane call, seconds.
        connect_timeout_s: bound on connecting and registering (in the
            background thread; the first registration may wait while the server
            allocates the namespace's pool).
        backoff_min_s / backoff_max_s: reconnect back-off range, seconds.
        token: secret for a TCP server (ignored on Unix sockets).
        wait_connected_s: if > 0, wait up to this long for the first connection
            (no error if it does not come; calls are then misses).
        sync_commit: wait for the server to acknowledge each commit. Default
            False: a commit is sent one-way (one round trip per stored chunk
            instead of two); it is applied before any later request of this
            client, and other clients see it microseconds later (until then a
            lookup misses it, which is safe: a chunk is never visible before
            its commit). :meth:`flush` waits for every commit sent before it.

    Raises:
        ValueError: malformed address or non-positive timeouts.
    """

    def __init__(
        self,
        address: str,
        namespace: KeyNamespace,
        client_id: str | None = None,
        *,
        timeout_s: float = 0.5,
        connect_timeout_s: float = 30.0,
        backoff_min_s: float = 0.05,
        backoff_max_s: float = 2.0,
        token: str | None = None,
        wait_connected_s: float = 0.0,
        sync_commit: bool = False,
    ):
        if timeout_s <= 0 or connect_timeout_s <= 0 or not 0 < backoff_min_s <= backoff_max_s:
            raise ValueError("timeouts and back-off must be positive (backoff_min_s <= backoff_max_s)")
        self.address = address
        self._family, self._addr = parse_address(address)
        self.namespace = namespace
        self.chunk_bytes = namespace.chunk_bytes
        self.chunk_size = namespace.chunk_size
        self.client_id = client_id or f"pid{os.getpid()}-{os.urandom(4).hex()}"
        if not 0 < len(self.client_id) <= P.MAX_NAME_CHARS:
            raise ValueError("client_id must have 1 to 256 characters")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self._token = token
        self.sync_commit = sync_commit
        self._digest = namespace.digest()
        self.counters = ClientCounters()
        self.server_pid: int | None = None
        self._lock = threading.Lock()  # serialises calls on the connection
        self._conn: _Conn | None = None
        self._gen = 0
        self._writes: dict[bytes, int] = {}  # key -> generation of the connection that reserved it
        self._writes_lock = threading.Lock()
        self._closed = threading.Event()
        self._need_connect = threading.Event()
        self._need_connect.set()
        self._connected = threading.Event()
        self._last_refusal = ""
        self._thread = threading.Thread(target=self._connect_loop, name="kvtier-service-connect", daemon=True)
        self._thread.start()
        if wait_connected_s > 0:
            self._connected.wait(wait_connected_s)

    # -- connection management ----------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._conn is not None

    def wait_connected(self, timeout_s: float) -> None:
        """Block until registered with the server.

        Raises:
            ServiceUnavailable: not connected within ``timeout_s``.
        """
        if not self._connected.wait(timeout_s):
            raise ServiceUnavailable(f"kvtier server at {self.address} not reachable within {timeout_s} s")

    def _connect_loop(self) -> None:
        delay = self.backoff_min_s
        while not self._closed.is_set():
            self._need_connect.wait()
            if self._closed.is_set():
                return
            try:
                conn = self._open()
            except Exception as exc:
                self.counters.connect_failures += 1
                msg = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, P.ProtocolError) and msg != self._last_refusal:
                    log.error("kvtier server %s refused this client: %s", self.address, exc)
                    self._last_refusal = msg
                else:
                    log.debug("kvtier server %s unreachable: %s", self.address, msg)
                self._closed.wait(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, self.backoff_max_s)
                continue
            with self._lock:
                if self._closed.is_set():
                    conn.close()
                    return
                self._gen += 1
                conn.gen = self._gen
                self._conn = conn
                self._need_connect.clear()
                self._connected.set()
            self.counters.connects += 1
            self._last_refusal = ""
            delay = self.backoff_min_s
            log.info("kvtier: connected to cache server %s (pid %s)", self.address, self.server_pid)

    def _open(self) -> _Conn:
        if self._family == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in self._addr[0] else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.settimeout(self.connect_timeout_s)
            sock.connect(self._addr)
            reg = P.Register(self.client_id, os.getpid(), self.namespace, self._digest, self.chunk_bytes, self._token)
            sock.sendall(P.encode_request(reg, 0))
            fds: list[int] = []
            if self._family == "unix":
                head, fds, _, _ = socket.recv_fds(sock, P.HEADER.size, 4)
            else:
                head = sock.recv(P.HEADER.size)
            try:
                head = head + _recv_n(sock, P.HEADER.size - len(head))
                (n,) = P.HEADER.unpack(head)
                if n > P.MAX_FRAME_BYTES:
                    raise P.ProtocolError("too_large", "register reply too large")
                reply = P.unpack_body(_recv_n(sock, n))
                if not reply.get("ok"):
                    raise P.ProtocolError(str(reply.get("code")), str(reply.get("error")))
                seg = reply.get("segment")
                size, slot_bytes, num_slots = (seg or {}).get("size"), (seg or {}).get("slot_bytes"), (seg or {}).get("num_slots")
                if not all(type(v) is int and v > 0 for v in (size, slot_bytes, num_slots)):
                    raise P.ProtocolError("bad_reply", "register reply lacks the segment geometry")
                if slot_bytes != self.chunk_bytes or size < slot_bytes * num_slots:
                    raise P.ProtocolError("bad_reply", "server slots do not match this namespace's chunk_bytes")
                if fds:
                    segment = SharedSegment.attach_fd(fds.pop(0), size)
                elif isinstance(seg.get("path"), str):
                    segment = SharedSegment.attach_path(seg["path"], size)
                else:
                    raise P.ProtocolError("bad_reply", "no shared segment received")
            finally:
                for fd in fds:
                    os.close(fd)
            self.server_pid = reply.get("server_pid")
            sock.settimeout(self.timeout_s)
            return _Conn(sock, segment, slot_bytes, num_slots, 0)
        except BaseException:
            sock.close()
            raise

    def _drop(self, conn: _Conn, why: object) -> None:
        """Close a failed connection (caller holds ``_lock``) and wake the reconnect thread."""
        if self._conn is conn:
            self._conn = None
            self._connected.clear()
            self.counters.disconnects += 1
            log.warning("kvtier: cache server connection lost (%s); calls are misses until it is back", why)
            try:
                conn.close()
            except Exception:
                pass
            if not self._closed.is_set():
                self._need_connect.set()

    def _rpc(
        self, req: P.Request, noreply: bool = False, gen: int | None = None, timeout_s: float | None = None
    ) -> tuple[dict[str, Any] | None, _Conn | None]:
        """Send ``req``; returns ``(reply, conn)``, reply None on any failure (a miss).

        ``gen``: only send on the connection of that generation.
        """
        if self._conn is None:
            self.counters.skipped_calls += 1
            return None, None
        budget = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        if not self._lock.acquire(timeout=budget):
            self.counters.timeouts += 1
            return None, None
        conn = self._conn
        retimed = False
        try:
            if conn is None or (gen is not None and conn.gen != gen):
                self.counters.skipped_calls += 1
                return None, None
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
                return {"ok": True}, conn
            reply, more = self._recv_reply(conn, deadline)
            retimed = retimed or more
            if reply.get("id") != rid:
                raise P.ProtocolError("desync", "reply for another request")
            if not reply.get("ok"):
                self.counters.error_replies += 1
                log.debug("kvtier server refused %s: %s %s", req.OP, reply.get("code"), reply.get("error"))
                return None, conn
            return reply, conn
        except (OSError, ValueError) as exc:  # timeouts are OSError; ProtocolError is a ValueError
            if isinstance(exc, socket.timeout):
                self.counters.timeouts += 1
            self._drop(conn, exc)  # type: ignore[arg-type]
            return None, None
        finally:
            if retimed and self._conn is conn and conn is not None:
                try:
                    conn.sock.settimeout(self.timeout_s)
                except OSError:
                    pass
            self._lock.release()

    @staticmethod
    def _recv_reply(conn: _Conn, deadline: float) -> tuple[dict[str, Any], bool]:
        """One reply frame; also says whether the socket timeout was changed."""
        view = memoryview(conn.buf)
        got = 0
        need = P.HEADER.size
        body_len = -1
        retimed = False
        while got < need:
            k = conn.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionResetError("server closed the connection")
            got += k
            if body_len < 0 and got >= P.HEADER.size:
                (body_len,) = P.HEADER.unpack_from(conn.buf)
                if body_len > len(conn.buf) - P.HEADER.size:
                    raise P.ProtocolError("too_large", "reply larger than the client's buffer")
                need = P.HEADER.size + body_len
            if got < need:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout("reply not complete within the timeout")
                conn.sock.settimeout(left)
                retimed = True
        if got > need:
            raise P.ProtocolError("desync", "unexpected bytes after the reply")
        return P.unpack_body(view[P.HEADER.size : need]), retimed

    # -- KVStore: lookups and leases --------------------------------------------------------------
    def lookup_keys(self, keys: Sequence[bytes], lease_owner: str | None = None) -> LookupResult:
        """Longest prefix of ``keys`` held by the server's tiers; leased to ``lease_owner`` if given.

        Returns ``LookupResult(0)`` on any failure.
        """
        keys = list(keys[: P.MAX_KEYS])
        reply, _ = self._rpc(P.Lookup(keys, lease_owner))
        if reply is None:
            return LookupResult(0)
        codes = reply.get("tiers")
        if not isinstance(codes, bytes) or len(codes) > len(keys):
            return LookupResult(0)
        tiers = [P.TIER_NAMES.get(c, "cpu") for c in codes]
        n = len(tiers)
        return LookupResult(n * self.chunk_size, keys[:n], tiers)

    def release(self, lease_owner: str) -> None:
        """End ``lease_owner``'s lease (no-op when unreachable: the server's TTL or disconnect ends it)."""
        self._rpc(P.ReleaseLease(lease_owner))

    def contains(self, key: bytes) -> bool:
        reply, _ = self._rpc(P.Contains(key))
        return bool(reply and reply.get("hit") is True)

    # -- KVStore: write path ------------------------------------------------------------------------
    def open_write(self, key: bytes) -> np.ndarray | None:
        """Reserve a slot for ``key``; returns its ``uint8 [chunk_bytes]`` view to fill, or None.

        None: already stored, no room, or the server is unreachable. Follow with
        :meth:`commit` or :meth:`abort`.
        """
        reply, conn = self._rpc(P.Reserve(key))
        if reply is None or conn is None:
            return None
        slot = reply.get("slot")
        if type(slot) is not int or not 0 <= slot < conn.num_slots:
            return None
        with self._writes_lock:
            self._writes[key] = conn.gen
        return conn.slots[slot]

    def open_write_many(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """:meth:`open_write` for many distinct keys in one round trip (None where skipped)."""
        if not keys:
            return []
        reply, conn = self._rpc(P.ReserveMany(list(keys)))
        slots = None if reply is None else reply.get("slots")
        if conn is None or not isinstance(slots, list) or len(slots) != len(keys):
            return [None] * len(keys)
        out: list[np.ndarray | None] = []
        with self._writes_lock:
            for key, slot in zip(keys, slots):
                if type(slot) is int and 0 <= slot < conn.num_slots:
                    self._writes[key] = conn.gen
                    out.append(conn.slots[slot])
                else:
                    out.append(None)
        return out

    def commit(self, key: bytes, parent: bytes | None = None) -> None:
        """Publish a filled slot (acknowledged only with ``sync_commit``; see the constructor)."""
        with self._writes_lock:
            gen = self._writes.pop(key, None)
        if gen is None:
            return
        reply, _ = self._rpc(P.Commit(key, parent), noreply=not self.sync_commit, gen=gen)
        if reply is None:
            self.counters.lost_stores += 1

    def abort(self, key: bytes) -> None:
        with self._writes_lock:
            gen = self._writes.pop(key, None)
        if gen is not None:
            self._rpc(P.Abort(key), gen=gen)

    # -- KVStore: read path ---------------------------------------------------------------------------
    def open_read(self, key: bytes, parent: bytes | None = None) -> ServiceReadHandle | None:
        """Hold ``key`` for reading in the server; None on a miss or failure."""
        reply, conn = self._rpc(P.Load(key, parent))
        if reply is None or conn is None:
            return None
        hid, slot, source = reply.get("handle"), reply.get("slot"), reply.get("source")
        if type(hid) is not int:
            return None
        if type(slot) is not int or not 0 <= slot < conn.num_slots or not isinstance(source, str):
            self._unload(conn.gen, hid)
            return None
        return ServiceReadHandle(self, conn.gen, hid, key, conn.slots[slot], source)

    def open_read_many(self, items: Sequence[tuple[bytes, bytes | None]]) -> list[ServiceReadHandle | None]:
        """:meth:`open_read` for many ``(key, parent)`` pairs in one round trip.

        Returns one handle or None per item, in order (close every handle); all
        None on a failure.
        """
        items = list(items)
        if not items:
            return []
        if len(items) > P.MAX_KEYS:
            return [*self.open_read_many(items[: P.MAX_KEYS]), *self.open_read_many(items[P.MAX_KEYS :])]
        reply, conn = self._rpc(P.LoadMany([k for k, _ in items], [p for _, p in items]))
        out: list[ServiceReadHandle | None] = [None] * len(items)
        got = reply.get("handles") if reply else None
        if conn is None or not isinstance(got, list) or len(got) != len(items):
            return out
        for i, entry in enumerate(got):
            if entry is None:
                continue
            hid, slot, source = (entry + [None, None, None])[:3] if isinstance(entry, list) else (None, None, None)
            if type(hid) is not int:
                continue
            if type(slot) is not int or not 0 <= slot < conn.num_slots or not isinstance(source, str):
                self._unload(conn.gen, hid)
                continue
            out[i] = ServiceReadHandle(self, conn.gen, hid, items[i][0], conn.slots[slot], source)
        return out

    def _unload(self, gen: int, handle: int) -> None:
        self._rpc(P.Unload(handle), noreply=True, gen=gen)

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Ask the server to promote these chunks from disk into CPU; returns how many were queued."""
        reply, _ = self._rpc(P.Prefetch(list(keys[: P.MAX_KEYS])))
        q = reply.get("queued") if reply else 0
        return q if type(q) is int else 0

    # -- KVStore: accounting -------------------------------------------------------------------------
    def record_request(self, request_id: str, record: RequestRecord) -> None:
        self._rpc(
            P.RecordRequest(
                request_id, record.prompt_tokens, record.engine_hit_tokens, record.kvtier_hit_tokens, dict(record.tiers)
            ),
            noreply=True,
        )

    def record_load(self, request_id: str, tier: str, num_tokens: int) -> None:
        self._rpc(P.RecordLoad(request_id, tier, num_tokens), noreply=True)

    def record_load_failure(self) -> None:
        self._rpc(P.RecordLoadFailure(), noreply=True)

    def request_record(self, request_id: str) -> dict[str, Any] | None:
        """Where ``request_id``'s prompt tokens came from (server's record), or None."""
        reply, _ = self._rpc(P.GetRequest(request_id))
        rec = reply.get("record") if reply else None
        return rec if isinstance(rec, dict) else None

    # -- KVStore: admin ---------------------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait (up to ``timeout_s``, default 10 s, at most 60 s) for the server's write-behind to disk."""
        t = min(60.0, 10.0 if timeout_s is None else max(0.0, timeout_s))
        reply, _ = self._rpc(P.Flush(t), timeout_s=t + self.timeout_s)
        return bool(reply and reply.get("done"))

    def clear(self, timeout_s: float = 60.0) -> dict[str, int]:
        """Remove every unreferenced chunk from every server tier; returns chunks removed per tier."""
        reply, _ = self._rpc(P.Clear(), timeout_s=timeout_s)
        removed = reply.get("removed") if reply else None
        return dict(removed) if isinstance(removed, dict) else {}

    def health(self) -> dict[str, Any] | None:
        reply, _ = self._rpc(P.Health())
        return reply

    def stats(self, timeout_s: float = 5.0) -> dict[str, int | float]:
        """The server's counters for this namespace plus this client's (``client_*``)."""
        reply, _ = self._rpc(P.Stats(), timeout_s=timeout_s)
        out: dict[str, int | float] = {}
        st = reply.get("stats") if reply else None
        if isinstance(st, dict):
            out.update({k: v for k, v in st.items() if isinstance(k, str) and type(v) in (int, float)})
        out["client_connected"] = int(self.connected)
        for f in fields(ClientCounters):
            out[f"client_{f.name}"] = getattr(self.counters, f.name)
        return out

    def close(self) -> None:
        """Disconnect (the server releases this client's reservations, reads and leases)."""
        self._closed.set()
        self._need_connect.set()
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()
        self._thread.join(timeout=self.connect_timeout_s + 1)

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _recv_n(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionResetError("server closed the connection")
        out += chunk
    return bytes(out)
