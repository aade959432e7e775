"""``kvtier server``: one cache service shared by every engine process on a machine.

The server owns the tiers: per key namespace a :class:`NamespaceHost` (a
shared-memory CPU pool plus a :class:`StorageManager`). Engines connect with
:class:`kvtier.service.client.ServiceClient`.

Data plane: a store reserves a slot (the reply names its index), the client
copies the chunk into its mapping of that slot and commits; a load takes a read
reference (the reply names the slot), the client copies out and unloads. No
payload byte crosses the socket. Control plane: :mod:`kvtier.protocol`.

Pieces: listeners and connection threads (:mod:`.listener`), sessions and what
each holds, with their invariants (:mod:`.session`), the op handlers
(:mod:`.handlers`, leases in :mod:`.lease_ops`), namespace hosts
(:mod:`.namespace_host`). This module ties them together: registration, the
namespace table, the prefetch thread, metrics and health.
"""

from __future__ import annotations

import hmac
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvtier import protocol as P
from kvtier.config import KVTierConfig, validate_config
from kvtier.index.keys import KeyNamespace
from kvtier.protocol import ErrorCode, ProtocolError
from kvtier.service.cuda_ipc import cuda_available
from kvtier.service.handlers import DataHandlers, prefetch_one
from kvtier.service.listener import FrameServer, bind_unix, unlink_socket
from kvtier.service.metrics import MetricsHTTPServer, ServerMetrics
from kvtier.service.namespace_host import NamespaceHost
from kvtier.service.session import Registered, Session, SessionTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerOptions:
    """How the server listens and what it bounds.

    Attributes:
        socket_path: Unix socket path (created owner-only, 0600, in a 0700
            directory owned by this user; any other directory is refused).
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

    def __post_init__(self) -> None:
        """Raises ValueError for a bound that cannot work (non-positive, or a port outside 0-65535)."""
        for name in ("max_clients", "max_namespaces", "max_holds_per_client", "prefetch_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"server option {name} must be >= 1, got {getattr(self, name)}")
        for name in ("tcp_port", "metrics_port"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 65535:
                raise ValueError(f"server option {name} must be a port in 0-65535, got {v}")
        if not self.socket_path:
            raise ValueError("server option socket_path must not be empty")


class CacheServer:
    """The cache service. ``start()`` binds and serves in background threads.

    Args:
        config: tier settings (``cpu_capacity``, ``disk_path``, ``disk_capacity``,
            eviction policies, ``lease_ttl_s``...); ``chunk_size`` is taken from
            each client's namespace.
        options: listeners and bounds.

    Raises (from the constructor):
        RuntimeError: TCP without a token.
        ConfigError: a setting that cannot work (disk path not writable,
            capacity below the floor; see :func:`kvtier.config.validate_config`).

    Raises (from ``start``):
        RuntimeError: another server listens on ``socket_path``.
        UnsafeSocketDir: the socket directory is not private to this user.
        OSError: a listener cannot be bound.
    """

    def __init__(self, config: KVTierConfig, options: ServerOptions):
        if options.tcp_host is not None and not options.token:
            raise RuntimeError("the TCP listener requires a token (--token)")
        validate_config(config)
        self.config = config
        self.options = options
        self.metrics = ServerMetrics(self._metric_snapshot)
        self.instance = os.urandom(8)
        self.started_at = time.monotonic()
        self._hosts: dict[bytes, NamespaceHost] = {}
        self._hosts_lock = threading.Lock()
        self.sessions = SessionTable(options.max_clients, options.max_holds_per_client)
        self._frames: FrameServer[Session] = FrameServer(self, "kvtier")
        self._prefetch_q: queue.Queue[tuple[NamespaceHost, bytes]] = queue.Queue(maxsize=options.prefetch_queue)
        self._handlers = DataHandlers(self.metrics, self._prefetch_q, self._server_stats)
        self._http: MetricsHTTPServer | None = None
        self._started = False
        self.tcp_address: tuple[str, int] | None = None
        self.protocol_errors = 0

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> "CacheServer":
        """Bind the listeners and start serving (idempotent)."""
        if self._started:
            return self
        o = self.options
        self._frames.listen(bind_unix(o.socket_path))
        self._started = True
        if o.tcp_host is not None:
            tcp = socket.create_server((o.tcp_host, o.tcp_port), backlog=128)
            self.tcp_address = tcp.getsockname()[:2]
            self._frames.listen(tcp)
        self._frames.spawn(self._prefetch_loop, "kvtier-prefetch")
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
        self._frames.wait_stopped()

    def close(self) -> None:
        """Stop listening, drop every connection (releasing what it holds), flush and close the tiers."""
        if self._frames.stopping:
            return
        self._frames.close()
        deadline = time.monotonic() + 5
        while self.num_sessions() and time.monotonic() < deadline:
            time.sleep(0.01)  # connection threads release their holds
        if self._http is not None:
            self._http.close()
        with self._hosts_lock:
            hosts, self._hosts = list(self._hosts.values()), {}
        for h in hosts:
            h.close()
        if self._started:
            unlink_socket(self.options.socket_path)
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
        return len(self.sessions)

    def total_holds(self) -> int:
        return self.sessions.total_holds()

    def check_invariants(self) -> None:
        """Assert the session/holds invariants (:mod:`kvtier.service.session`) of every live connection."""
        self.sessions.check_invariants()

    # -- Endpoint (called by the connection threads) ----------------------------------------
    def open(self, sock: socket.socket, kind: str) -> Session | None:
        return self.sessions.open(sock, kind)

    def frame_too_large(self, session: Session) -> None:
        self.protocol_errors += 1

    def handle(self, s: Session, body: bytearray) -> tuple[dict[str, Any] | None, int | None]:
        t0 = time.perf_counter()
        try:
            env, req = P.decode_request(P.unpack_body(body))
        except ProtocolError as exc:
            self.protocol_errors += 1
            self.metrics.observe("invalid", False, time.perf_counter() - t0)
            return P.error_reply(exc.req_id, exc.code, str(exc)), None
        op = req.OP
        fd = None
        try:
            if isinstance(req, P.Register):
                out, fd = self._register(s, req)
            elif isinstance(req, P.Health):
                out = self._health_state()[1]
            elif s.registered is None:
                raise ProtocolError(ErrorCode.NOT_REGISTERED, "register first")
            elif isinstance(req, P.CudaRegister):
                out = self._cuda_register(req)
            else:
                out = self._handlers.table[op](s.holds, s.registered, req)
            reply, ok = P.ok_reply(env.req_id, **out), True
        except ProtocolError as exc:
            self.protocol_errors += 1
            reply, ok = P.error_reply(env.req_id, exc.code, str(exc)), False
        except Exception as exc:  # a bug or tier failure must not take the server down
            log.exception("kvtier server: %s failed", op)
            reply, ok = P.error_reply(env.req_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"), False
        self.metrics.observe(op, ok, time.perf_counter() - t0)
        return (None if env.noreply else reply), fd

    def drop(self, s: Session) -> None:
        """Release everything ``s`` holds (session invariant); runs once per connection.

        The session leaves the table last, so a session count of zero means every
        hold is already released.
        """
        try:
            reg = s.registered
            if reg is not None:
                writes, reads, owners = s.holds.release_all(reg.host.manager)
                rel = self.metrics.disconnect_releases
                for kind, n in (("reservation", writes), ("read_reference", reads), ("lease", owners)):
                    if n:
                        rel.labels(kind).inc(n)
                if writes or reads:
                    log.info(
                        "kvtier server: client %s (pid %d) left holding %d reservations and %d reads; released",
                        reg.client_id, reg.pid, writes, reads,
                    )
        finally:
            self.sessions.remove(s)

    # -- register ----------------------------------------------------------------------------
    def _register(self, s: Session, r: P.Register) -> tuple[dict[str, Any], int | None]:
        if s.registered is not None:
            raise ProtocolError(ErrorCode.BAD_STATE, "already registered")
        if s.kind == "tcp":
            expected = self.options.token or ""
            if r.token is None or not hmac.compare_digest(r.token.encode(), expected.encode()):
                raise ProtocolError(ErrorCode.AUTH, "a valid token is required on TCP")
        digest = r.namespace.digest()
        if digest != r.namespace_digest:
            raise ProtocolError(ErrorCode.NAMESPACE_MISMATCH, "namespace digest does not match its fields")
        if r.chunk_bytes != r.namespace.chunk_bytes:
            raise ProtocolError(
                ErrorCode.NAMESPACE_MISMATCH,
                f"chunk_bytes {r.chunk_bytes} differs from the namespace's {r.namespace.chunk_bytes}",
            )
        host = self._host_for(r.namespace, digest)
        s.registered = Registered(host, r.client_id, r.pid, f"{len(r.client_id)}:{r.client_id}/")
        seg: dict[str, Any] = {
            "size": host.segment.size, "slot_bytes": host.pool.slot_bytes, "num_slots": host.pool.num_slots,
        }
        out: dict[str, Any] = {
            "segment": seg, "server_pid": os.getpid(), "instance": self.instance,
            "chunk_size": r.namespace.chunk_size,
        }
        fd = None
        if s.kind == "unix":
            seg["fd"] = True
            fd = host.segment.fd
        else:
            seg["path"] = f"/proc/{os.getpid()}/fd/{host.segment.fd}"
        log.info("kvtier server: client %s (pid %d, %s) registered", r.client_id, r.pid, s.kind)
        return out, fd

    def _host_for(self, ns: KeyNamespace, digest: bytes) -> NamespaceHost:
        with self._hosts_lock:
            host = self._hosts.get(digest)
            if host is not None:
                return host
            n = self.options.max_namespaces
            if len(self._hosts) >= n:
                raise ProtocolError(
                    ErrorCode.NAMESPACE_MISMATCH,
                    f"this server hosts {n} other key namespace(s) (model/layout/chunk size/rank) and no more; "
                    "start it with a larger --max-namespaces or use another server",
                )
            try:
                host = NamespaceHost(
                    self.config, ns, int(self.config.cpu_capacity) // n, int(self.config.disk_capacity) // n
                )
            except ValueError as exc:
                raise ProtocolError(ErrorCode.CAPACITY, str(exc)) from None
            self._hosts[digest] = host
            log.info("kvtier server: hosting namespace %s (%s, %d slots)", digest.hex()[:16], ns.model, host.pool.num_slots)
            return host

    def _cuda_register(self, r: P.CudaRegister) -> dict[str, Any]:
        # Guarded path (see kvtier.service.cuda_ipc): only machines with CUDA get past here.
        if not cuda_available():
            raise ProtocolError(ErrorCode.CUDA_UNAVAILABLE, "this server has no CUDA device; use the shared-memory path")
        raise ProtocolError(ErrorCode.UNSUPPORTED, "CUDA IPC copies are designed but not implemented in protocol v1")

    # -- prefetch ------------------------------------------------------------------------------
    def _prefetch_loop(self) -> None:
        """Promote chunks held only below the CPU tier into it ahead of their load."""
        while not self._frames.stopping:
            try:
                host, key = self._prefetch_q.get(timeout=0.2)
            except queue.Empty:
                continue
            prefetch_one(host, key)

    # -- metrics / health ---------------------------------------------------------------------
    def _server_stats(self) -> dict[str, int]:
        return {
            "server_clients": self.num_sessions(),
            "server_holds": self.total_holds(),
            "server_namespaces": len(self.hosts()),
            "server_protocol_errors": self.protocol_errors,
        }

    def _health_state(self) -> tuple[bool, dict[str, Any]]:
        stopping = self._frames.stopping
        return (not stopping), {
            "status": "stopping" if stopping else "ok",
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            "clients": self.num_sessions(),
            "namespaces": len(self.hosts()),
            "pid": os.getpid(),
        }

    def _metric_snapshot(self) -> tuple[int, list[dict[str, Any]]]:
        return self.num_sessions(), [h.manager.stats() for h in self.hosts()]
