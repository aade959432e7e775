"""``kvtier server``: one cache service shared by every engine process on a machine.

The server owns the tiers: per key namespace, a :class:`StorageManager` whose
CPU pool lives in a shared-memory segment (:mod:`kvtier.service.shm`) and whose
disk tier lives in ``<disk_path>/ns-<namespace digest>``; the server is the
single owner of that directory. Engines connect with
:class:`kvtier.service.client.ServiceClient`.

Data plane: a store reserves a slot (the reply names its index), the client
copies the chunk into its mapping of that slot and commits; a load takes a read
reference (the reply names the slot), the client copies out and unloads. No
payload byte crosses the socket. Control plane: :mod:`kvtier.service.protocol`.

Threads: one acceptor per listener, one thread per client connection (a slow
disk promotion delays only its own client), one prefetcher, and the optional
metrics HTTP server.

Invariants (each kept by the connection's own thread; ``_drop_session`` runs
exactly once per connection):
- Everything a connection holds is listed in its :class:`Session`: slots it
  reserved (``writes``), read references (``reads``) and lease owners it
  granted (``owners``). When the connection ends, for whatever reason (clean
  close, crash, SIGKILL, protocol abuse), each is released: reservations are
  aborted, read references dropped, leases ended. Committed chunks stay.
- A client can commit, abort or unload only what its own connection holds.
- A client never holds more than ``max_holds_per_client`` reservations plus
  read references, so one client cannot pin the whole pool.
- Lease owners and request ids are prefixed with the registering client id, so
  two engines' request ids never collide, while an engine's scheduler and worker
  connections (same client id) share leases.
"""

from __future__ import annotations

import hmac
import logging
import os
import queue
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvtier.config import KVTierConfig
from kvtier.index.keys import KeyNamespace
from kvtier.memory.pool import ChunkPool
from kvtier.service import protocol as P
from kvtier.service.cuda_ipc import cuda_available
from kvtier.service.metrics import MetricsHTTPServer, ServerMetrics
from kvtier.service.shm import SharedSegment
from kvtier.storage.manager import ReadHandle, RequestRecord, StorageManager

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerOptions:
    """How the server listens and what it bounds.

    Attributes:
        socket_path: Unix socket path (created owner-only, 0600).
        tcp_host: opt-in TCP listener address (None: no TCP). Loopback unless
            told otherwise.
        tcp_port: TCP port (0: any free port).
        token: shared secret TCP clients must present at register (required
            when TCP is on; compared in constant time).
        metrics_host: address of the HTTP metrics/health endpoint.
        metrics_port: its port (None: off; 0: any free port).
        max_clients: concurrent connections; more are refused.
        max_namespaces: key namespaces hosted at once; ``cpu_capacity`` and
            ``disk_capacity`` are split evenly between them.
        max_holds_per_client: reservations plus read references one connection
            may hold at once.
        prefetch_queue: chunks waiting for prefetch; more are dropped.
    """

    socket_path: str
    tcp_host: str | None = None
    tcp_port: int = 0
    token: str | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    max_clients: int = 256
    max_namespaces: int = 1
    max_holds_per_client: int = 1024
    prefetch_queue: int = 4096


class NamespaceHost:
    """The tiers of one key namespace: a shared-memory CPU pool plus a StorageManager.

    Raises:
        ValueError: the CPU share is below one chunk.
        DiskTierLocked: the namespace's disk directory is owned by another process.
    """

    def __init__(self, config: KVTierConfig, namespace: KeyNamespace, cpu_bytes: int, disk_bytes: int):
        cb = namespace.chunk_bytes
        num_slots = cpu_bytes // cb
        if num_slots < 1:
            raise ValueError(f"CPU capacity per namespace ({cpu_bytes} B) is below one chunk ({cb} B)")
        self.namespace = namespace
        self.digest = namespace.digest()
        self.segment = SharedSegment.create(num_slots * cb, f"kvtier-{self.digest.hex()[:12]}")
        self.pool = ChunkPool(cb, num_slots, buffer=self.segment.array)
        disk_path = None if config.disk_path is None else Path(config.disk_path) / f"ns-{self.digest.hex()[:32]}"
        cfg = config.model_copy(
            update=dict(
                chunk_size=namespace.chunk_size,
                cpu_capacity=num_slots * cb,
                disk_path=disk_path,
                disk_capacity=disk_bytes,
            )
        )
        try:
            self.manager = StorageManager(cfg, namespace, pool=self.pool)
        except BaseException:
            self.segment.close()
            raise

    def close(self) -> None:
        self.manager.close()
        self.segment.close()


@dataclass
class Session:
    """One client connection and everything it holds (see module invariants)."""

    sid: int
    sock: socket.socket
    kind: str  # "unix" or "tcp"
    host: NamespaceHost | None = None
    client_id: str = ""
    pid: int = 0
    prefix: str = ""
    writes: dict[bytes, int] = field(default_factory=dict)  # key -> slot
    reads: dict[int, ReadHandle] = field(default_factory=dict)  # handle -> read reference
    owners: set[str] = field(default_factory=set)  # prefixed lease owners granted here
    next_handle: int = 1

    @property
    def holds(self) -> int:
        return len(self.writes) + len(self.reads)


class CacheServer:
    """The cache service. ``start()`` binds and serves in background threads.

    Args:
        config: tier settings (``cpu_capacity``, ``disk_path``, ``disk_capacity``,
            eviction policies, ``lease_ttl_s``...); ``chunk_size`` is taken from
            each client's namespace.
        options: listeners and bounds.

    Raises (from ``start``):
        RuntimeError: another server listens on ``socket_path``, or TCP without a token.
        OSError: a listener cannot be bound.
    """

    def __init__(self, config: KVTierConfig, options: ServerOptions):
        if options.tcp_host is not None and not options.token:
            raise RuntimeError("the TCP listener requires a token (--token)")
        self.config = config
        self.options = options
        self.metrics = ServerMetrics(self._metric_snapshot)
        self.instance = os.urandom(8)
        self.started_at = time.monotonic()
        self._hosts: dict[bytes, NamespaceHost] = {}
        self._hosts_lock = threading.Lock()
        self._sessions: dict[int, Session] = {}
        self._sessions_lock = threading.Lock()
        self._next_sid = 1
        self._stop = threading.Event()
        self._listeners: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._prefetch_q: queue.Queue = queue.Queue(maxsize=options.prefetch_queue)
        self._http: MetricsHTTPServer | None = None
        self.tcp_address: tuple[str, int] | None = None
        self.protocol_errors = 0
        self._handlers: dict[str, Callable[[Session, Any], dict[str, Any]]] = {
            "register": self._register,
            "lookup": self._lookup,
            "contains": self._contains,
            "release": self._release,
            "reserve": self._reserve,
            "reserve_many": self._reserve_many,
            "commit": self._commit,
            "abort": self._abort,
            "load": self._load,
            "load_many": self._load_many,
            "unload": self._unload,
            "prefetch": self._prefetch,
            "record_request": self._record_request,
            "record_load": self._record_load,
            "record_load_failure": self._record_load_failure,
            "get_request": self._get_request,
            "flush": self._flush,
            "stats": self._stats,
            "clear": self._clear,
            "health": self._health,
            "cuda_register": self._cuda_register,
        }

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> "CacheServer":
        """Bind the listeners and start serving (idempotent)."""
        if self._listeners:
            return self
        o = self.options
        self._listeners.append(self._bind_unix(o.socket_path))
        if o.tcp_host is not None:
            tcp = socket.create_server((o.tcp_host, o.tcp_port), backlog=128)
            self.tcp_address = tcp.getsockname()[:2]
            self._listeners.append(tcp)
        for lsock in self._listeners:
            kind = "unix" if lsock.family == socket.AF_UNIX else "tcp"
            self._spawn(self._accept_loop, f"kvtier-accept-{kind}", lsock, kind)
        self._spawn(self._prefetch_loop, "kvtier-prefetch")
        if o.metrics_port is not None:
            self._http = MetricsHTTPServer(o.metrics_host, o.metrics_port, self.metrics, self._health_state)
        log.info(
            "kvtier server pid %d on %s%s%s; %s",
            os.getpid(),
            o.socket_path,
            f", tcp {self.tcp_address}" if self.tcp_address else "",
            f", metrics http://{o.metrics_host}:{self._http.port}/metrics" if self._http else "",
            self.config.describe(),
        )
        return self

    @property
    def metrics_port(self) -> int | None:
        return None if self._http is None else self._http.port

    def serve_forever(self) -> None:
        """Block until :meth:`close` (e.g. from a signal handler)."""
        self._stop.wait()

    def close(self) -> None:
        """Stop listening, drop every connection (releasing what it holds), flush and close the tiers."""
        if self._stop.is_set():
            return
        self._stop.set()
        for lsock in self._listeners:
            _quiet(lambda: lsock.shutdown(socket.SHUT_RDWR))  # wakes the thread blocked in accept()
            _quiet(lsock.close)
        with self._sessions_lock:
            sessions = list(self._sessions.values())
        for s in sessions:
            _quiet(lambda: s.sock.shutdown(socket.SHUT_RDWR))
        for t in self._threads:
            t.join(timeout=5)
        deadline = time.monotonic() + 5
        while self.num_sessions() and time.monotonic() < deadline:
            time.sleep(0.01)  # connection threads release their holds
        if self._http is not None:
            self._http.close()
        with self._hosts_lock:
            hosts, self._hosts = list(self._hosts.values()), {}
        for h in hosts:
            h.close()
        try:
            if stat.S_ISSOCK(os.lstat(self.options.socket_path).st_mode):
                os.unlink(self.options.socket_path)
        except OSError:
            pass
        log.info("kvtier server stopped")

    def __enter__(self) -> "CacheServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inspection (tests, stats) ---------------------------------------------------------
    def hosts(self) -> list[NamespaceHost]:
        with self._hosts_lock:
            return list(self._hosts.values())

    def num_sessions(self) -> int:
        with self._sessions_lock:
            return len(self._sessions)

    def total_holds(self) -> int:
        with self._sessions_lock:
            return sum(s.holds for s in self._sessions.values())

    # -- listeners ---------------------------------------------------------------------------
    def _bind_unix(self, path: str) -> socket.socket:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, mode=0o700, exist_ok=True)
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

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> threading.Thread:
        t = threading.Thread(target=target, name=name, args=args, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def _accept_loop(self, lsock: socket.socket, kind: str) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = lsock.accept()
            except OSError:
                return  # listener closed
            if kind == "tcp":
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            with self._sessions_lock:
                if len(self._sessions) >= self.options.max_clients:
                    full = True
                else:
                    full = False
                    sid = self._next_sid
                    self._next_sid += 1
                    session = Session(sid, conn, kind)
                    self._sessions[sid] = session
            if full:
                _quiet(lambda: conn.sendall(P.pack(P.error_reply(-1, "busy", "too many clients"))))
                conn.close()
                continue
            threading.Thread(
                target=self._serve_session, args=(session,), name=f"kvtier-client-{sid}", daemon=True
            ).start()

    # -- one connection ------------------------------------------------------------------------
    def _serve_session(self, s: Session) -> None:
        sock = s.sock
        header = bytearray(P.HEADER.size)
        try:
            while not self._stop.is_set():
                if not _recv_exact(sock, memoryview(header)):
                    return
                (n,) = P.HEADER.unpack(header)
                if n > P.MAX_FRAME_BYTES:
                    # The stream cannot be resynchronised: answer and hang up.
                    self.protocol_errors += 1
                    sock.sendall(P.pack(P.error_reply(-1, "too_large", f"frame of {n} B exceeds the bound")))
                    return
                body = bytearray(n)
                if not _recv_exact(sock, memoryview(body)):
                    return
                reply, fd = self._handle_frame(s, body)
                if reply is None:
                    continue
                frame = P.pack(reply)
                if fd is not None:
                    socket.send_fds(sock, [frame], [fd])
                else:
                    sock.sendall(frame)
        except OSError:
            return  # connection reset, or the server is closing
        finally:
            self._drop_session(s)

    def _handle_frame(self, s: Session, body: bytearray) -> tuple[dict[str, Any] | None, int | None]:
        t0 = time.perf_counter()
        op = "invalid"
        try:
            env, req = P.decode_request(P.unpack_body(body))
        except P.ProtocolError as exc:
            self.protocol_errors += 1
            self.metrics.observe(op, False, time.perf_counter() - t0)
            return P.error_reply(exc.req_id, exc.code, str(exc)), None
        op = req.OP
        fd = None
        try:
            if s.host is None and op not in ("register", "health"):
                raise P.ProtocolError("not_registered", "register first")
            out = self._handlers[op](s, req)
            fd = out.pop("_fd", None)
            reply = P.ok_reply(env.req_id, **out)
            ok = True
        except P.ProtocolError as exc:
            self.protocol_errors += 1
            reply, ok = P.error_reply(env.req_id, exc.code, str(exc)), False
        except Exception as exc:  # a bug or tier failure must not take the server down
            log.exception("kvtier server: %s failed", op)
            reply, ok = P.error_reply(env.req_id, "internal", f"{type(exc).__name__}: {exc}"), False
        self.metrics.observe(op, ok, time.perf_counter() - t0)
        return (None if env.noreply else reply), fd

    def _drop_session(self, s: Session) -> None:
        """Release everything ``s`` holds (module invariant); runs once per connection.

        The session leaves the session table last, so a session count of zero means
        every hold is already released.
        """
        _quiet(s.sock.close)
        host = s.host
        try:
            if host is not None:
                self._release_holds(s, host.manager)
        finally:
            with self._sessions_lock:
                self._sessions.pop(s.sid, None)

    def _release_holds(self, s: Session, m: Any) -> None:
        for key in list(s.writes):
            _quiet(lambda: m.abort(key))
        for handle in list(s.reads.values()):
            _quiet(handle.close)
        for owner in list(s.owners):
            _quiet(lambda: m.release(owner))
        rel = self.metrics.disconnect_releases
        if s.writes:
            rel.labels("reservation").inc(len(s.writes))
        if s.reads:
            rel.labels("read_reference").inc(len(s.reads))
        if s.owners:
            rel.labels("lease").inc(len(s.owners))
        if s.writes or s.reads:
            log.info(
                "kvtier server: client %s (pid %d) left holding %d reservations and %d reads; released",
                s.client_id, s.pid, len(s.writes), len(s.reads),
            )
        s.writes.clear()
        s.reads.clear()
        s.owners.clear()

    # -- handlers ----------------------------------------------------------------------------------
    def _register(self, s: Session, r: P.Register) -> dict[str, Any]:
        if s.host is not None:
            raise P.ProtocolError("bad_state", "already registered")
        if s.kind == "tcp":
            expected = self.options.token or ""
            if r.token is None or not hmac.compare_digest(r.token.encode(), expected.encode()):
                raise P.ProtocolError("auth", "a valid token is required on TCP")
        digest = r.namespace.digest()
        if digest != r.namespace_digest:
            raise P.ProtocolError("namespace_mismatch", "namespace digest does not match its fields")
        if r.chunk_bytes != r.namespace.chunk_bytes:
            raise P.ProtocolError(
                "namespace_mismatch", f"chunk_bytes {r.chunk_bytes} differs from the namespace's {r.namespace.chunk_bytes}"
            )
        host = self._host_for(r.namespace, digest)
        s.host = host
        s.client_id, s.pid = r.client_id, r.pid
        s.prefix = f"{len(r.client_id)}:{r.client_id}/"
        seg: dict[str, Any] = {
            "size": host.segment.size, "slot_bytes": host.pool.slot_bytes, "num_slots": host.pool.num_slots,
        }
        out: dict[str, Any] = {
            "segment": seg, "server_pid": os.getpid(), "instance": self.instance,
            "chunk_size": r.namespace.chunk_size,
        }
        if s.kind == "unix":
            seg["fd"] = True
            out["_fd"] = host.segment.fd
        else:
            seg["path"] = f"/proc/{os.getpid()}/fd/{host.segment.fd}"
        log.info("kvtier server: client %s (pid %d, %s) registered", r.client_id, r.pid, s.kind)
        return out

    def _host_for(self, ns: KeyNamespace, digest: bytes) -> NamespaceHost:
        with self._hosts_lock:
            host = self._hosts.get(digest)
            if host is not None:
                return host
            n = self.options.max_namespaces
            if len(self._hosts) >= n:
                raise P.ProtocolError(
                    "namespace_mismatch",
                    f"this server hosts {n} other key namespace(s) (model/layout/chunk size/rank) and no more; "
                    "start it with a larger --max-namespaces or use another server",
                )
            try:
                host = NamespaceHost(
                    self.config, ns, int(self.config.cpu_capacity) // n, int(self.config.disk_capacity) // n
                )
            except ValueError as exc:
                raise P.ProtocolError("capacity", str(exc)) from None
            self._hosts[digest] = host
            log.info("kvtier server: hosting namespace %s (%s, %d slots)", digest.hex()[:16], ns.model, host.pool.num_slots)
            return host

    def _lookup(self, s: Session, r: P.Lookup) -> dict[str, Any]:
        owner = None
        if r.owner is not None:
            owner = s.prefix + r.owner
            if len(s.owners) >= 65536:  # prune owners whose lease ended elsewhere
                s.owners = {o for o in s.owners if s.host.manager.leases.holds(o)}  # type: ignore[union-attr]
            s.owners.add(owner)
        res = s.host.manager.lookup_keys(r.keys, owner)  # type: ignore[union-attr]
        m = self.metrics
        m.lookups.inc()
        cs = s.host.namespace.chunk_size  # type: ignore[union-attr]
        for tier in set(res.tiers):
            m.lookup_hit_tokens.labels(tier).inc(cs * res.tiers.count(tier))
        return {"tiers": b"".join(P.TIER_CODES.get(t, b"?") for t in res.tiers)}

    def _contains(self, s: Session, r: P.Contains) -> dict[str, Any]:
        return {"hit": s.host.manager.contains(r.key)}  # type: ignore[union-attr]

    def _release(self, s: Session, r: P.ReleaseLease) -> dict[str, Any]:
        owner = s.prefix + r.owner
        s.host.manager.release(owner)  # type: ignore[union-attr]
        s.owners.discard(owner)
        return {}

    def _check_holds(self, s: Session) -> None:
        if s.holds >= self.options.max_holds_per_client:
            raise P.ProtocolError("too_many_holds", f"at most {self.options.max_holds_per_client} reservations+reads")

    def _reserve(self, s: Session, r: P.Reserve) -> dict[str, Any]:
        self._check_holds(s)
        if r.key in s.writes:
            raise P.ProtocolError("bad_state", "key already reserved by this client")
        host = s.host
        buf = host.manager.open_write(r.key)  # type: ignore[union-attr]
        if buf is None:
            return {"slot": None, "present": host.manager.contains(r.key)}  # type: ignore[union-attr]
        slot = host.pool.slot_of(buf)  # type: ignore[union-attr]
        s.writes[r.key] = slot
        return {"slot": slot}

    def _reserve_many(self, s: Session, r: P.ReserveMany) -> dict[str, Any]:
        if s.holds + len(r.keys) > self.options.max_holds_per_client:
            raise P.ProtocolError("too_many_holds", f"at most {self.options.max_holds_per_client} reservations+reads")
        if any(k in s.writes for k in r.keys):
            raise P.ProtocolError("bad_state", "key already reserved by this client")
        host = s.host
        slots: list[int | None] = []
        for key in r.keys:
            buf = host.manager.open_write(key)  # type: ignore[union-attr]
            if buf is None:
                slots.append(None)
                continue
            slot = host.pool.slot_of(buf)  # type: ignore[union-attr]
            s.writes[key] = slot
            slots.append(slot)
        return {"slots": slots}

    def _commit(self, s: Session, r: P.Commit) -> dict[str, Any]:
        if s.writes.pop(r.key, None) is None:
            raise P.ProtocolError("not_reserved", "commit of a key this client has not reserved")
        host = s.host
        host.manager.commit(r.key, r.parent)  # type: ignore[union-attr]
        self.metrics.bytes_in.inc(host.pool.slot_bytes)  # type: ignore[union-attr]
        return {}

    def _abort(self, s: Session, r: P.Abort) -> dict[str, Any]:
        if s.writes.pop(r.key, None) is None:
            raise P.ProtocolError("not_reserved", "abort of a key this client has not reserved")
        s.host.manager.abort(r.key)  # type: ignore[union-attr]
        return {}

    def _load(self, s: Session, r: P.Load) -> dict[str, Any]:
        self._check_holds(s)
        host = s.host
        handle = host.manager.open_read(r.key, r.parent)  # type: ignore[union-attr]
        if handle is None:
            return {"handle": None}
        hid = s.next_handle
        s.next_handle += 1
        s.reads[hid] = handle
        self.metrics.bytes_out.inc(host.pool.slot_bytes)  # type: ignore[union-attr]
        return {"handle": hid, "slot": host.pool.slot_of(handle.buffer), "source": handle.source}  # type: ignore[union-attr]

    def _load_many(self, s: Session, r: P.LoadMany) -> dict[str, Any]:
        if s.holds + len(r.keys) > self.options.max_holds_per_client:
            raise P.ProtocolError("too_many_holds", f"at most {self.options.max_holds_per_client} reservations+reads")
        host = s.host
        handles = host.manager.open_read_many(list(zip(r.keys, r.parents)))  # type: ignore[union-attr]
        out: list[Any] = []
        for handle in handles:
            if handle is None:
                out.append(None)
                continue
            hid = s.next_handle
            s.next_handle += 1
            s.reads[hid] = handle
            out.append([hid, host.pool.slot_of(handle.buffer), handle.source])  # type: ignore[union-attr]
        self.metrics.bytes_out.inc(host.pool.slot_bytes * (len(out) - out.count(None)))  # type: ignore[union-attr]
        return {"handles": out}

    def _unload(self, s: Session, r: P.Unload) -> dict[str, Any]:
        handle = s.reads.pop(r.handle, None)
        if handle is None:
            raise P.ProtocolError("unknown_handle", "unload of a handle this client does not hold")
        handle.close()
        return {}

    def _prefetch(self, s: Session, r: P.Prefetch) -> dict[str, Any]:
        queued = 0
        for key in r.keys:
            try:
                self._prefetch_q.put_nowait((s.host, key))
                queued += 1
            except queue.Full:
                break
        return {"queued": queued}

    def _prefetch_loop(self) -> None:
        """Promote disk-only chunks into the CPU tier ahead of their load."""
        while not self._stop.is_set():
            try:
                host, key = self._prefetch_q.get(timeout=0.2)
            except queue.Empty:
                continue
            m = host.manager
            try:
                if not m.cpu.contains(key):
                    for handle in m.open_read_many([(key, None)]):  # disk or remote promotion
                        if handle is not None:
                            handle.close()
            except Exception:  # a failing tier is a miss
                log.exception("kvtier server: prefetch failed")

    def _record_request(self, s: Session, r: P.RecordRequest) -> dict[str, Any]:
        rec = RequestRecord(r.prompt_tokens, r.engine_hit_tokens, r.kvtier_hit_tokens, dict(r.tiers))
        s.host.manager.record_request(s.prefix + r.request_id, rec)  # type: ignore[union-attr]
        return {}

    def _record_load(self, s: Session, r: P.RecordLoad) -> dict[str, Any]:
        s.host.manager.record_load(s.prefix + r.request_id, r.tier, r.num_tokens)  # type: ignore[union-attr]
        self.metrics.load_tokens.labels(r.tier if r.tier in P.TIER_CODES else "other").inc(r.num_tokens)
        return {}

    def _record_load_failure(self, s: Session, r: P.RecordLoadFailure) -> dict[str, Any]:
        s.host.manager.record_load_failure()  # type: ignore[union-attr]
        return {}

    def _get_request(self, s: Session, r: P.GetRequest) -> dict[str, Any]:
        m = s.host.manager  # type: ignore[union-attr]
        with m._lock:  # noqa: SLF001 - the manager's record log has no public getter
            rec = m.requests.get(s.prefix + r.request_id)
            out = None if rec is None else {
                "prompt_tokens": rec.prompt_tokens,
                "engine_hit_tokens": rec.engine_hit_tokens,
                "kvtier_hit_tokens": rec.kvtier_hit_tokens,
                "tiers": dict(rec.tiers),
            }
        return {"record": out}

    def _flush(self, s: Session, r: P.Flush) -> dict[str, Any]:
        return {"done": bool(s.host.manager.flush(r.timeout_s))}  # type: ignore[union-attr]

    def _stats(self, s: Session, r: P.Stats) -> dict[str, Any]:
        host = s.host
        out: dict[str, Any] = dict(host.manager.stats())  # type: ignore[union-attr]
        out.update(
            server_clients=self.num_sessions(),
            server_holds=self.total_holds(),
            server_namespaces=len(self.hosts()),
            server_protocol_errors=self.protocol_errors,
            cpu_num_slots=host.pool.num_slots,  # type: ignore[union-attr]
            cpu_free_slots=host.pool.num_free,  # type: ignore[union-attr]
        )
        return {"stats": out}

    def _clear(self, s: Session, r: P.Clear) -> dict[str, Any]:
        return {"removed": s.host.manager.clear()}  # type: ignore[union-attr]

    def _health(self, s: Session, r: P.Health) -> dict[str, Any]:
        _, details = self._health_state()
        return details

    def _cuda_register(self, s: Session, r: P.CudaRegister) -> dict[str, Any]:
        # Guarded path (see kvtier.service.cuda_ipc): only machines with CUDA get past here.
        if not cuda_available():
            raise P.ProtocolError("cuda_unavailable", "this server has no CUDA device; use the shared-memory path")
        raise P.ProtocolError("unsupported", "CUDA IPC copies are designed but not implemented in protocol v1")

    # -- metrics / health ---------------------------------------------------------------------
    def _health_state(self) -> tuple[bool, dict[str, Any]]:
        return (not self._stop.is_set()), {
            "status": "stopping" if self._stop.is_set() else "ok",
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            "clients": self.num_sessions(),
            "namespaces": len(self.hosts()),
            "pid": os.getpid(),
        }

    def _metric_snapshot(self) -> tuple[int, list[dict[str, Any]]]:
        return self.num_sessions(), [h.manager.stats() for h in self.hosts()]


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False on a clean EOF before it is full."""
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return False
        got += k
    return True


def _quiet(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:
        pass
