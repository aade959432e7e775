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
(:mod:`.namespace_host`), registration, the namespace table and client quotas
(:mod:`.namespaces`, :mod:`.quotas`), the shared-memory checksums
(:mod:`.integrity`), the options (:mod:`.options`), copies addressed by engine block id for
engines that share their KV (:mod:`.kv_ops`). This module ties them together: the prefetch and
maintenance threads, metrics and health.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any

from kvtier import protocol as P
from kvtier.config import KVTierConfig
from kvtier.config_base import ConfigError
from kvtier.config_checks import validate_config
from kvtier.protocol import ErrorCode, ProtocolError
from kvtier.service.cuda_ipc import cuda_available
from kvtier.service.handlers import DataHandlers, prefetch_one
from kvtier.service.auth import AuthThrottle
from kvtier.service.http import MetricsHTTPServer
from kvtier.service.kv_ops import KV_OPS, KVOps
from kvtier.service.listener import LISTEN_BACKLOG, ConnLimits, FrameServer, Phase, UnixSocketFile, bind_unix
from kvtier.service.metrics import ServerMetrics
from kvtier.service.namespace_host import NamespaceHost, NamespaceStats
from kvtier.service.namespaces import NamespaceTable, maintenance_loop
from kvtier.service.peer_host import HostedChunks
from kvtier.service.options import HANDSHAKE_FRAME_BYTES
from kvtier.service.options import ServerOptions as ServerOptions  # re-exported
from kvtier.service.pinning import SegmentPins
from kvtier.service.session import Session, SessionTable
from kvtier.tiers.disk.fileops import FileOps
from kvtier.transfer.peer_open import start_peer_server
from kvtier.tiers.disk.scan import DiskTierLocked, take_ownership

log = logging.getLogger(__name__)


def _own_disk_root(path: Path) -> int | None:
    """Lock ``path/.lock`` for this server (see :func:`kvtier.tiers.disk.scan.take_ownership`).

    Raises:
        ConfigError: another live process holds it (a race lost after ``validate_config``).
    """
    try:
        fd, _ = take_ownership(path, FileOps())
    except DiskTierLocked as exc:
        raise ConfigError(f"invalid kvtier config: disk_path: {exc}") from None
    return fd


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
            capacity below the floor; see :func:`kvtier.config_checks.validate_config`).

    Fleet: with ``options.controller`` the server registers with that controller
    (:class:`kvtier.fleet.agent.FleetAgent`, role ``"server"``) and keeps it informed
    of every hosted namespace's tiers; with ``options.kv_events_endpoint`` it
    publishes its tier changes as vLLM KV events (:mod:`kvtier.service.fleet_link`).

    Raises (from ``start``):
        RuntimeError: another server listens on ``socket_path``.
        UnsafeSocketDir: the socket directory is not private to this user.
        OSError: a listener (or the KV events endpoint) cannot be bound.
    """

    def __init__(self, config: KVTierConfig, options: ServerOptions):
        if options.tcp_host is not None and not options.token:
            raise RuntimeError("the TCP listener requires a token (--token-file or server_token)")
        validate_config(config)
        #: flock of ``<disk_path>/.lock`` for the server's life: a second server (or an engine)
        #: on the same directory is refused at start, not at its first namespace.
        self._disk_lock: int | None = None
        if config.disk_path is not None:
            self._disk_lock = _own_disk_root(Path(config.disk_path))
        self.config = config
        self.options = options
        self.metrics = ServerMetrics(self._metric_snapshot, config,
                                     lambda: [t for h in self.hosts() for t in h.manager.lower],
                                     released=lambda: dict(self._namespaces.released_counters))
        self.instance = os.urandom(8)
        self.started_at = time.monotonic()
        # Registered connections reach max_clients even while max_unauthenticated wait to register;
        # registered ones are capped at max_clients when they register (_register).
        self.sessions = SessionTable(options.max_clients + options.max_unauthenticated, options.max_holds_per_client,
                                     max_registered=options.max_clients)
        limits = ConnLimits(
            handshake_timeout_s=options.handshake_timeout_s,
            idle_timeout_s=options.idle_timeout_s,
            frame_timeout_s=options.frame_timeout_s,
            max_unauthenticated=options.max_unauthenticated,
            handshake_frame_bytes=HANDSHAKE_FRAME_BYTES,
        )
        self._frames: FrameServer[Session] = FrameServer(self, "kvtier", limits)
        self._namespaces = NamespaceTable(config, options.namespace_policy(), self.sessions)
        self._auth = AuthThrottle(options.auth_backoff_s, options.auth_backoff_max_s, options.auth_sources)
        self._closing: set[int] = set()  # sids to close once their reply is sent
        self.auth_failures = 0
        self._closing_lock = threading.Lock()
        self._prefetch_q: queue.Queue[tuple[NamespaceHost, bytes]] = queue.Queue(maxsize=options.prefetch_queue)
        self._handlers = DataHandlers(self.metrics, self._prefetch_q, self._server_stats)
        if config.trace_capture_path is not None:
            from kvtier.service.trace_capture import ServerTraceCapture

            try:
                self._handlers.capture = ServerTraceCapture(Path(config.trace_capture_path), config.chunk_size,
                                                            int(config.trace_capture_max_bytes))
            except OSError as exc:
                raise ConfigError(f"invalid kvtier config: trace_capture_path: {exc}") from None
        self._kv = KVOps(self._handlers, SegmentPins())  # copies by engine block id (kvtier.service.kv_ops)
        self._http: MetricsHTTPServer | None = None
        self._started = False
        self._unix: UnixSocketFile | None = None  # the bound --socket (its file and lock), once started
        self.tcp_address: tuple[str, int] | None = None
        self.protocol_errors = 0
        self.fleet: Any = None  # kvtier.service.fleet_link.ServiceLink when a controller or KV events are set
        #: Serves every hosted namespace's chunks to peers on ``peer_listen`` (kvtier.service.peer_host); or None.
        self.peer_server: Any = None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> "CacheServer":
        """Bind the listeners and start serving (idempotent)."""
        if self._started:
            return self
        o = self.options
        self._unix = bind_unix(o.socket_path)  # PATH.lock held while it lives (listener.bind_unix)
        self._frames.listen(self._unix.sock)
        self._started = True
        if o.tcp_host is not None:
            try:
                tcp = socket.create_server((o.tcp_host, o.tcp_port), backlog=LISTEN_BACKLOG)
            except OSError as exc:
                raise OSError(exc.errno, f"--tcp-host/--tcp-port {o.tcp_host}:{o.tcp_port}: {exc.strerror}") from None
            self.tcp_address = tcp.getsockname()[:2]
            self._frames.listen(tcp)
        if self.config.peer_listen:
            try:
                self.peer_server = start_peer_server(self.config, HostedChunks(self._namespaces))
            except (OSError, ValueError) as exc:
                raise OSError(getattr(exc, "errno", None), f"peer_listen {self.config.peer_listen}: {exc}") from None
        self._frames.spawn(self._prefetch_loop, "kvtier-prefetch")
        self._frames.spawn(lambda: maintenance_loop(self._namespaces, lambda: self._frames.stopping), "kvtier-maintain")
        if o.metrics_port is not None:
            try:
                self._http = MetricsHTTPServer(
                    o.metrics_host, o.metrics_port, self.metrics, self._health_state,
                    max_connections=o.http_max_connections, request_timeout_s=o.http_timeout_s, backlog=LISTEN_BACKLOG,
                    token=o.token,
                )
            except OSError as exc:
                msg = f"--metrics-host/--metrics-port {o.metrics_host}:{o.metrics_port}: {exc.strerror}"
                if exc.errno == errno.EADDRINUSE:  # e.g. a second server on this machine (default port 9477)
                    msg += " (another kvtier server? give each its own --metrics-port, 0 for any free one, or --no-metrics)"
                raise OSError(exc.errno, msg) from None
        if o.controller or o.kv_events_endpoint:
            # The fleet layer sits above the service; imported only when asked for.
            import zmq

            from kvtier.service.fleet_link import ServiceLink

            try:
                self.fleet = ServiceLink(self).start()
            except zmq.ZMQError as exc:
                raise OSError(exc.errno, f"--kv-events-endpoint {o.kv_events_endpoint}: {exc}") from None
        log.info(
            "kvtier server pid %d on %s%s%s; %s",
            os.getpid(),
            o.socket_path,
            f", tcp {self.tcp_address}" if self.tcp_address else "",
            (f", metrics http://{o.metrics_host}:{self._http.port}/metrics, dashboard "
             f"http://{o.metrics_host}:{self._http.port}/") if self._http else "",
            self.config.describe("server"),
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
        if self.fleet is not None:
            self.fleet.close()  # first: unsubscribes from the managers before they close
        self._frames.close()
        deadline = time.monotonic() + 5
        while self.num_sessions() and time.monotonic() < deadline:
            time.sleep(0.01)  # connection threads release their holds
        if self._http is not None:
            self._http.close()
        if self.peer_server is not None:
            self.peer_server.stop()  # before the namespaces: no peer read outlives their segments
        self._kv.close()  # engine KV registrations and segment pins, before the segments are unmapped
        self._namespaces.close()
        if self._handlers.capture is not None:
            self._handlers.capture.close()
        if self._unix is not None:
            self._unix.remove()  # only the socket file this server created
            self._unix = None
        lock, self._disk_lock = self._disk_lock, None
        if lock is not None:
            os.close(lock)  # releases the flock
        log.info("kvtier server stopped")

    def __enter__(self) -> "CacheServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inspection (tests, stats) ---------------------------------------------------------
    def hosts(self) -> list[NamespaceHost]:
        return self._namespaces.hosts()

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

    def phase(self, s: Session) -> Phase:
        """Close after a failed token; the handshake ends at registration."""
        if s.sid in self._closing:
            return Phase.CLOSE
        return Phase.HANDSHAKE if s.registered is None else Phase.READY

    def handle(self, s: Session, body: bytearray) -> tuple[dict[str, Any] | None, int | None]:
        t0 = time.perf_counter()
        try:
            env, req = P.decode_request_body(body)
        except ProtocolError as exc:
            self.protocol_errors += 1
            self.metrics.observe("invalid", False, time.perf_counter() - t0)
            return (None if exc.noreply else P.error_reply(exc.req_id, exc.code, str(exc))), None
        op = req.OP
        fd = None
        try:
            if isinstance(req, P.Register):
                if s.kind == "tcp" and s.registered is None:
                    self._authenticate(s, req)
                out, fd = self._register(s, req)
            elif s.registered is None and s.kind == "tcp":
                raise ProtocolError(ErrorCode.NOT_REGISTERED, "register (with the token) first")
            elif isinstance(req, P.Health):
                out = self._health_state()[1]
            elif s.registered is None:
                raise ProtocolError(ErrorCode.NOT_REGISTERED, "register first")
            elif op in KV_OPS:
                out = self._kv.table[op](s, req)
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
            self._kv.release(s.sid)  # the engine KV it registered (kv_register), if any
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
            with self._closing_lock:
                self._closing.discard(s.sid)
            self._namespaces.detach(s)
            self.sessions.remove(s)

    # -- authentication (TCP) ------------------------------------------------------------------
    def _authenticate(self, s: Session, r: P.Register) -> None:
        """Check a TCP client's token, with per-source back-off; a failure closes the connection.

        Raises:
            ProtocolError: ``AUTH`` for a wrong or missing token, or while the
                source address is backing off (its token is then not compared).
        """
        source = _peer_host(s.sock)
        wait = self._auth.retry_after(source)
        if wait > 0:
            self._close_after_reply(s)
            raise ProtocolError(ErrorCode.AUTH, f"too many failed tokens from {source}; retry in {wait:.1f} s")
        expected = (self.options.token or "").encode()
        if r.token is not None and hmac.compare_digest(r.token.encode(), expected):
            self._auth.succeeded(source)
            return
        failures, delay = self._auth.failed(source)
        self.auth_failures += 1
        self._close_after_reply(s)
        if failures == 1 or failures % 100 == 0:  # rate-limited: a guesser must not flood the log
            log.warning("kvtier server: failed TCP token from %s (%d so far); backing off %.1f s", source, failures, delay)
        raise ProtocolError(ErrorCode.AUTH, f"a valid token is required on TCP; this address may retry in {delay:.1f} s")

    def _close_after_reply(self, s: Session) -> None:
        with self._closing_lock:
            self._closing.add(s.sid)

    # -- register ----------------------------------------------------------------------------
    def _register(self, s: Session, r: P.Register) -> tuple[dict[str, Any], int | None]:
        """Registration (validation, allow-list, namespace table, quotas): :mod:`kvtier.service.namespaces`.

        Raises:
            ProtocolError: ``BUSY`` when ``max_clients`` connections are registered
                (the connection is closed after the reply), or the table's refusal.
        """
        first = s.registered is None
        if first and not self.sessions.claim_registration(s):
            self._close_after_reply(s)
            raise ProtocolError(ErrorCode.BUSY, f"too many clients: {self.options.max_clients} connections are "
                                "registered (--max-clients); retry later")
        try:
            out = self._namespaces.register(s, r, self.options.token, self.instance)
        except BaseException:
            if first and s.registered is None:
                self.sessions.unclaim_registration(s)
            raise
        if self.fleet is not None:
            try:
                self.fleet.sync()  # a new namespace host reports from its first store
            except Exception:
                log.exception("kvtier server: fleet sync after a registration failed")
        return out

    def _cuda_register(self, r: P.CudaRegister) -> dict[str, Any]:
        # Guarded path (see kvtier.service.cuda_ipc): only machines with CUDA get past here.
        if not cuda_available():
            raise ProtocolError(ErrorCode.CUDA_UNAVAILABLE, "this server has no CUDA device; use the shared-memory path")
        from kvtier.service.cuda_ipc import import_handle

        try:
            mapped = import_handle(r)  # opened and checked, then unmapped (no copy path uses it yet)
            nbytes = mapped.untyped_storage().nbytes()
            del mapped
        except Exception as exc:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"cannot open the CUDA IPC handle: {exc}") from None
        if nbytes != r.size:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"CUDA IPC handle maps {nbytes} B, request says {r.size}")
        raise ProtocolError(ErrorCode.UNSUPPORTED, "CUDA IPC handle accepted, but cuda_register carries no KV "
                            "geometry: send kv_register (kind 'cuda') to copy by block id, or use the slot copies")

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

    def _connection_stats(self) -> dict[str, int]:
        """Counters of the connection guards (:mod:`.listener`, :mod:`.auth`); in ``/health`` as ``connections``.

        Not in the ``stats`` reply: that map is at the protocol's 64-entry bound.
        """
        f = self._frames
        return {
            "server_unregistered_connections": f.unauthenticated(),
            "server_evicted_unregistered": f.evicted_unauthenticated,
            "server_connection_timeouts": f.timeouts,
            "server_accept_failures": f.accept_failures,
            "server_thread_start_failures": f.thread_start_failures,
            "server_auth_failures": self.auth_failures,
        }

    def _health_state(self) -> tuple[bool, dict[str, Any]]:
        """``(healthy, details)``: ``stopping``, ``degraded`` (with ``reason``: cannot accept connections) or ``ok``."""
        stopping = self._frames.stopping
        reason = self._frames.degraded_reason()
        extra: dict[str, Any] = {} if reason is None else {"reason": reason}
        status = "stopping" if stopping else "degraded" if reason else "ok"
        return status == "ok", {
            "status": status,
            **extra,
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            "clients": self.num_sessions(),
            "namespaces": len(self.hosts()),
            "pid": os.getpid(),
            "connections": self._connection_stats(),
        }

    def _metric_snapshot(self) -> tuple[int, list[NamespaceStats]]:
        return self.num_sessions(), [h.typed_stats() for h in self.hosts()]


def _peer_host(sock: socket.socket) -> str:
    """The peer's host address ("?" once the peer is gone)."""
    try:
        peer = sock.getpeername()
    except OSError:
        return "?"
    return str(peer[0]) if isinstance(peer, tuple) else "unix"
