"""The peer server: serves one instance's locally held chunks to authenticated fleet members.

One reactor thread owns the listening socket and every connection that is not being served: it
accepts, runs each handshake without blocking (:mod:`kvtier.transfer.peer_auth`; a connection that
has not completed it within ``handshake_s`` is closed, and beyond ``max_pending`` unauthenticated
connections the oldest is closed), and watches idle authenticated links. When a request arrives on a
link, the link goes to a small worker pool (``workers`` threads) for that one request, then back to
the reactor. So silent or idle connections hold no thread: 20 connections that never say hello
cannot keep a real peer out, and 200 idle links cost 200 file descriptors, not 200 threads. A
request's I/O can still hold its worker up to ``timeout_s`` (a member that sends half a request,
or asks for chunks and never acknowledges them), so one member's requests run on at most
``member_workers`` workers at once (default half the pool); its further requests wait their turn,
and the other members keep the rest of the pool.

Admission: over TCP and NIXL a peer must prove a key of a current member with the ``peer`` role
(the server refuses to start without credentials); over shared memory (a Unix socket) a peer must
run as this user, and must also authenticate when the server has credentials. At most
``max_connections`` links in all and ``max_per_member`` per member key; a link idle for ``idle_s``
is closed (the peer tier redials). Before every request the member is looked up again, so a revoked
key's links are closed at their next request; keys outside the member's ``models``/``salts`` are
answered as not held (:func:`permitted`).
"""

from __future__ import annotations

import logging
import os
import queue
import selectors
import socket
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgspec

from kvtier.protocol.decoding import decode
from kvtier.protocol.trust import Credentials, Member
from kvtier.tiers.base import check_key
from kvtier.transfer.channel import TransferChannel
from kvtier.transfer.errors import PeerRefused, ProtocolError, TransferError
from kvtier.transfer.frames import PREFIX, Hello, Proof, Refused, decode_header, decode_prefix, encode_frame
from kvtier.transfer.peer_auth import ServerAuth
from kvtier.transfer.peer_wire import MAX_KEYS, PeerReply, PeerRequest
from kvtier.transfer.stream import peer_uid

log = logging.getLogger("kvtier.transfer.peer")
_REQUEST_DECODER = msgspec.msgpack.Decoder(PeerRequest)

#: Largest handshake frame accepted (bytes): a Hello or a Proof is ~100 bytes.
MAX_HANDSHAKE_FRAME = 4096


def permitted(store: Any, member: Member | None, keys: Sequence[bytes]) -> list[bool]:
    """Per key: may ``member`` have it? (namespace model in its ``models``, chain lineage in its ``salts``).

    ``store`` answers ``namespace_of(key)`` (the :class:`~kvtier.index.keys.KeyNamespace` holding the
    key, or None) and ``lineage_of(key)`` (the lineage marker the key's chain starts from, or None).
    ``member`` None (same-user shared memory) or unrestricted: every key.
    """
    if member is None or member.unrestricted:
        return [True] * len(keys)
    namespace_of = getattr(store, "namespace_of", None)
    lineage_of = getattr(store, "lineage_of", None)
    out: list[bool] = []
    lineages: dict[bytes, frozenset[bytes] | None] = {}
    for k in keys:
        ns = namespace_of(k) if namespace_of is not None else None
        if ns is None or not member.allows_model(ns.model):
            out.append(False)
            continue
        d = ns.digest()
        if d not in lineages:
            lineages[d] = member.lineages(ns)
        allowed = lineages[d]
        out.append(allowed is None or (lineage_of is not None and lineage_of(k) in allowed))
    return out


@dataclass(eq=False)
class _Pending:
    """One connection in its handshake."""

    sock: socket.socket
    deadline: float
    auth: ServerAuth | None
    buf: bytearray = field(default_factory=bytearray)
    need: int = PREFIX.size
    in_body: bool = False
    state: str = "hello"


@dataclass(eq=False)
class _Link:
    """One authenticated link."""

    sock: socket.socket
    member: Member | None
    chan: TransferChannel | None = None
    last: float = field(default_factory=time.monotonic)
    busy: bool = False


class PeerServer:
    """Serves ``manager``'s locally held chunks to peers (see the module docstring).

    Args:
        manager: a :class:`kvtier.storage.manager.StorageManager` (or the hosted view of a ``kvtier
            server``): ``where``, ``open_read_many``, and for member restrictions ``namespace_of`` /
            ``lineage_of``.
        listener: a TCP, shared-memory or NIXL listener (owned: closed by :meth:`stop`).
        timeout_s: bound of each request's I/O, seconds.
        credentials: this node's key and members (required unless ``listener`` is shared memory).
        handshake_s / max_pending / max_connections / max_per_member / workers / idle_s: see above.
        member_workers: most workers one member's requests hold at once (``None``: half of
            ``workers``, at least 1); a shared-memory link without a member key is not capped.

    Raises:
        ValueError: a TCP or NIXL listener without credentials.
    """

    def __init__(self, manager: Any, listener: Any, timeout_s: float = 5.0, credentials: Credentials | None = None,
                 handshake_s: float = 2.0, max_pending: int = 64, max_connections: int = 64,
                 max_per_member: int = 16, workers: int = 4, idle_s: float = 600.0,
                 member_workers: int | None = None):
        self.kind = getattr(listener, "kind", "tcp")
        if credentials is None and self.kind != "shm":
            listener.close()
            raise ValueError(f"a {self.kind} peer server admits fleet members only: set fleet_key and fleet_members "
                             "(tokenless P2P is shared memory between processes of one user: peer_listen shm:///PATH)")
        self.manager = manager
        self.listener = listener
        self.timeout_s = timeout_s
        self.credentials = credentials
        self.handshake_s = handshake_s
        self.max_pending, self.max_connections, self.max_per_member = max_pending, max_connections, max_per_member
        self.idle_s = idle_s
        self.member_workers = max(1, workers // 2) if member_workers is None else max(1, member_workers)
        self.counters = {"accepted": 0, "authenticated": 0, "refused": 0, "handshake_timeouts": 0,
                         "pending_evicted": 0, "requests": 0, "keys_refused": 0, "idle_closed": 0,
                         "deferred": 0}
        self._deferred: deque[_Link] = deque()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pending: OrderedDict[socket.socket, _Pending] = OrderedDict()
        self._links: dict[socket.socket, _Link] = {}
        self._returns: queue.SimpleQueue[_Link] = queue.SimpleQueue()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        lsock = listener.socket
        lsock.setblocking(False)
        self._sel.register(lsock, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="kvtier-peer-serve")
        self._acceptor = threading.Thread(target=self._run, name="kvtier-peer-accept", daemon=True)
        self._acceptor.start()

    # -- introspection -----------------------------------------------------------------------------
    @property
    def connections(self) -> int:
        """Authenticated links open now (a peer that left is dropped once its link failed or closed)."""
        with self._lock:
            return len(self._links)

    @property
    def pending(self) -> int:
        """Connections still in their handshake."""
        with self._lock:
            return len(self._pending)

    @property
    def channels(self) -> list[TransferChannel]:
        """The channels of the links served at least once."""
        with self._lock:
            return [ln.chan for ln in self._links.values() if ln.chan is not None]

    # -- the reactor -------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._sel.select(0.1)
            except (OSError, ValueError):
                if self._stop.is_set():
                    return
                continue
            for key, _ in events:
                what = key.data
                try:
                    if what == "listen":
                        self._accept()
                    elif what == "wake":
                        self._drain_wake()
                    elif isinstance(what, _Pending):
                        self._step(what)
                    elif isinstance(what, _Link):
                        self._dispatch(what)
                except Exception:  # noqa: BLE001 - one connection's bug must not stop the server
                    log.exception("kvtier peer server: unexpected error")
            self._take_returns()
            self._redispatch()
            self._sweep(time.monotonic())

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _ = self.listener.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self._stop.is_set():
                    return
                log.warning("kvtier peer server: accept failed: %s", exc)
                return
            self.counters["accepted"] += 1
            sock.setblocking(False)
            if sock.family == socket.AF_UNIX:
                uid = peer_uid(sock)
                if uid is not None and uid not in (os.geteuid(), 0):
                    self.counters["refused"] += 1
                    log.warning("kvtier peer server: refused a shared-memory peer running as uid %d", uid)
                    sock.close()
                    continue
            with self._lock:
                while len(self._pending) >= self.max_pending:
                    old, _ = self._pending.popitem(last=False)
                    self.counters["pending_evicted"] += 1
                    self._forget(old)
                p = _Pending(sock, time.monotonic() + self.handshake_s,
                             ServerAuth(self.credentials) if self.credentials is not None else None)
                self._pending[sock] = p
            self._sel.register(sock, selectors.EVENT_READ, p)

    def _forget(self, sock: socket.socket) -> None:
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def _refuse(self, p: _Pending, reason: str) -> None:
        self.counters["refused"] += 1
        log.info("kvtier peer server: refused a peer: %s", reason)
        try:
            p.sock.send(encode_frame(Refused(reason=reason[:300])), socket.MSG_DONTWAIT)
        except OSError:
            pass
        with self._lock:
            self._pending.pop(p.sock, None)
        self._forget(p.sock)

    def _step(self, p: _Pending) -> None:
        """Read what arrived of the handshake frame (never past it); act on a whole frame."""
        try:
            data = p.sock.recv(p.need - len(p.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            with self._lock:
                self._pending.pop(p.sock, None)
            self._forget(p.sock)
            return
        p.buf += data
        if len(p.buf) < p.need:
            return
        try:
            if not p.in_body:
                length = decode_prefix(bytes(p.buf))
                if length > MAX_HANDSHAKE_FRAME:
                    raise ProtocolError(f"handshake frame of {length} bytes")
                p.in_body, p.need, p.buf = True, length, bytearray()
                return
            msg = decode_header(bytes(p.buf))
            p.in_body, p.need, p.buf = False, PREFIX.size, bytearray()
            self._on_frame(p, msg)
        except (ProtocolError, PeerRefused) as exc:
            self._refuse(p, str(exc))

    def _on_frame(self, p: _Pending, msg: Any) -> None:
        if p.state == "hello":
            if not isinstance(msg, Hello) or msg.kind != self.kind:
                raise ProtocolError(f"expected a {self.kind} hello, got {type(msg).__name__}")
            if msg.version != Hello(kind=self.kind).version:
                raise ProtocolError(f"peer speaks protocol v{msg.version}")
            if p.auth is None:
                self._send(p, Hello(kind=self.kind))
                self._admit(p, None)
                return
            key, eph, mac = p.auth.hello(self.kind, msg.key, msg.eph)
            self._send(p, Hello(kind=self.kind, key=key, eph=eph, mac=mac))
            p.state = "proof"
            return
        if not isinstance(msg, Proof) or p.auth is None:
            raise ProtocolError(f"expected a proof, got {type(msg).__name__}")
        self._admit(p, p.auth.proof(msg.mac))

    def _send(self, p: _Pending, msg: Any) -> None:
        frame = encode_frame(msg)
        try:
            if p.sock.send(frame, socket.MSG_DONTWAIT) != len(frame):
                raise ProtocolError("handshake reply did not fit the socket buffer")
        except BlockingIOError:
            raise ProtocolError("handshake reply did not fit the socket buffer") from None
        except OSError as exc:
            raise ProtocolError(f"handshake reply failed: {exc}") from None

    def _admit(self, p: _Pending, member: Member | None) -> None:
        with self._lock:
            self._pending.pop(p.sock, None)
            mine = sum(1 for ln in self._links.values() if member is not None and ln.member is not None
                       and ln.member.public == member.public)
            full = len(self._links) >= self.max_connections
            if full or (member is not None and mine >= self.max_per_member):
                why = ("too many peer connections" if full or member is None
                       else f"member {member.name!r} has {mine} connections already")
            else:
                why = ""
                link = _Link(p.sock, member)
                self._links[p.sock] = link
        if why:
            self._refuse(p, why)
            return
        self.counters["authenticated"] += 1
        self._sel.modify(p.sock, selectors.EVENT_READ, link)

    def _dispatch(self, link: _Link) -> None:
        try:
            self._sel.unregister(link.sock)
        except (KeyError, ValueError):
            return
        self._submit(link)

    def _member_busy(self, member: Member) -> int:
        with self._lock:
            return sum(1 for ln in self._links.values()
                       if ln.busy and ln.member is not None and ln.member.public == member.public)

    def _redispatch(self) -> None:
        """Submit the deferred requests whose member has a worker free again."""
        for _ in range(len(self._deferred)):
            link = self._deferred.popleft()
            with self._lock:
                open_ = self._links.get(link.sock) is link
            if open_ and not self._stop.is_set():
                self._submit(link, again=True)

    def _submit(self, link: _Link, again: bool = False) -> None:
        if link.member is not None and self._member_busy(link.member) >= self.member_workers:
            self.counters["deferred"] += 0 if again else 1
            self._deferred.append(link)  # its request waits in the socket for a worker of its member
            return
        link.busy = True
        try:
            self._pool.submit(self._serve_one, link)
        except RuntimeError:  # the pool is shut down: stopping
            self._close_link(link)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError, OSError):
            pass

    def _take_returns(self) -> None:
        while True:
            try:
                link = self._returns.get_nowait()
            except queue.Empty:
                return
            link.busy = False
            link.last = time.monotonic()
            if self._stop.is_set() or link.sock.fileno() < 0:
                self._close_link(link)
                continue
            try:
                self._sel.register(link.sock, selectors.EVENT_READ, link)
            except (KeyError, ValueError, OSError):
                self._close_link(link)

    def _sweep(self, now: float) -> None:
        with self._lock:
            late = [p for p in self._pending.values() if now > p.deadline]
            idle = [ln for ln in self._links.values() if not ln.busy and now - ln.last > self.idle_s]
            for p in late:
                self._pending.pop(p.sock, None)
        for p in late:
            self.counters["handshake_timeouts"] += 1
            self._forget(p.sock)
        for ln in idle:
            self.counters["idle_closed"] += 1
            self._close_link(ln)

    def _close_link(self, link: _Link) -> None:
        with self._lock:
            self._links.pop(link.sock, None)
        if link.chan is not None:
            link.chan.close()
        self._forget(link.sock)

    # -- a worker: one request ---------------------------------------------------------------------
    def _serve_one(self, link: _Link) -> None:
        keep = False
        try:
            keep = self._request(link)
        except TransferError:
            keep = False
        except Exception:  # a bug or a local failure must not leave the peer waiting for a reply
            log.exception("kvtier peer server: dropping a peer after an unexpected error")
        if keep:
            self._returns.put(link)
        else:
            self._close_link(link)
        try:  # the reactor takes the link back, and serves a deferred request of its member
            self._wake_w.send(b"\x00")
        except OSError:
            pass

    def _request(self, link: _Link) -> bool:
        """Serve one request on ``link``; False when the link must close."""
        if link.chan is None:
            link.sock.setblocking(True)
            link.chan = self.listener.channel(link.sock)
            setup = getattr(link.chan, "exchange_metadata", None)
            if setup is not None:  # NIXL: each end's agent metadata, after the hellos
                setup(self.timeout_s)
                return True
            if not self._share_cpu_memory(link.chan):
                return False
        chan = link.chan
        member = link.member
        if member is not None and self.credentials is not None:
            current = self.credentials.members.get(member.public)
            if current is None or not current.may("peer"):
                log.info("kvtier peer server: closing the link of revoked member %r", member.name)
                return False
            link.member = member = current
        body = chan.recv_control(timeout_s=self.timeout_s)
        try:
            req = decode(_REQUEST_DECODER, body)
            if req.op not in ("contains", "get") or len(req.keys) > MAX_KEYS:
                raise ValueError(f"bad request {req.op!r} with {len(req.keys)} keys")
            for k in req.keys:
                check_key(k)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
            log.warning("kvtier peer server: dropping a peer that sent a bad request: %s", exc)
            return False
        self.counters["requests"] += 1
        self._answer(chan, req, member)
        return True

    def _share_cpu_memory(self, chan: TransferChannel) -> bool:
        """Over shared memory, let the peer map the manager's CPU tier (``cpu_segment``, when it
        has one): its chunks then go without a copy on this side. False: the peer is gone."""
        segment = getattr(self.manager, "cpu_segment", None)
        share = getattr(chan, "share_segment", None)
        if segment is None or share is None:
            return True
        try:
            share(segment, self.timeout_s)
        except TransferError as exc:
            log.warning("kvtier peer server: dropping a peer that did not take the CPU segment: %s", exc)
            return False
        return True

    def _answer(self, chan: TransferChannel, req: PeerRequest, member: Member | None) -> None:
        allowed = permitted(self.manager, member, req.keys)
        refused = len(allowed) - sum(allowed)
        if refused:
            self.counters["keys_refused"] += refused
        local = [ok and self.manager.where(k) is not None for k, ok in zip(req.keys, allowed)]
        if req.op == "contains":
            chan.send_control(msgspec.msgpack.encode(PeerReply(found=local)), self.timeout_s)
            return
        wanted = [k for k, held in zip(req.keys, local) if held]
        handles = self.manager.open_read_many([(k, None) for k in wanted]) if wanted else []
        try:
            got = {h.key: h for h in handles if h is not None}
            found = [k in got for k in req.keys]
            chan.send_control(msgspec.msgpack.encode(PeerReply(found=found)), self.timeout_s)
            chan.send([(k, got[k].buffer) for k in req.keys if k in got], self.timeout_s)
        finally:
            for h in handles:
                if h is not None:
                    h.close()

    def stop(self) -> None:
        """Stop accepting, close every link and handshake, join the threads (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._wake_w.send(b"\x00")
        except OSError:
            pass
        self._acceptor.join(5)
        with self._lock:
            links, pending = list(self._links.values()), list(self._pending.values())
            self._links.clear()
            self._pending.clear()
        for ln in links:
            if ln.chan is not None:
                ln.chan.close()
            self._forget(ln.sock)
        for p in pending:
            self._forget(p.sock)
        self._pool.shutdown(wait=True, cancel_futures=True)
        try:
            self._sel.close()
        except OSError:
            pass
        self.listener.close()
        self._wake_r.close()
        self._wake_w.close()
