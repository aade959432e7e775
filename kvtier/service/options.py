"""Options of ``kvtier server``: how it listens, what it bounds, who may register what.

Every field has a default an engine-side deployment can live with; a value that
cannot work raises ``ValueError`` naming the option at construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.service.namespaces import NamespacePolicy

#: Largest frame body (bytes) a connection may send before it registers (a register is < 1 KiB).
HANDSHAKE_FRAME_BYTES = 64 * 1024


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
        max_clients: registered connections at once; a register beyond them
            gets ``busy`` and its connection is closed (connections still
            registering are bounded by ``max_unauthenticated``).
        max_namespaces: key namespaces hosted at once; they share
            ``cpu_capacity`` dynamically (a namespace alone may fill it; each
            gets back at least its fair share when others need room), while
            ``disk_capacity`` is split evenly between them.
        max_holds_per_client: reservations plus read references one connection
            may hold at once (and the most one client id may hold over all its
            connections; see ``client_hold_share``).
        prefetch_queue: chunks waiting for prefetch; more are dropped.
        handshake_timeout_s: seconds a new connection has to register; then it
            is closed.
        idle_timeout_s: seconds a registered connection may stay silent; then it
            is closed and what it holds released (None: never; clients
            reconnect by themselves).
        frame_timeout_s: seconds to receive the rest of a started frame and to
            send its reply.
        max_unauthenticated: connections not yet registered at once (on top of
            ``max_clients``); a new one beyond closes the oldest unregistered one.
        auth_backoff_s / auth_backoff_max_s: after a failed TCP token the
            connection is closed and its source address waits ``auth_backoff_s``
            seconds, doubling per failure up to ``auth_backoff_max_s``, before
            its next token is compared.
        auth_sources: source addresses the back-off table remembers.
        http_max_connections: HTTP (metrics/health) connections open at once;
            the longest-idle one is closed to make room.
        http_timeout_s: seconds an HTTP connection has to send its request and
            read the reply.
        allowed_models: shell-style patterns of model ids that may register
            (empty: any); others get ``not_allowed``.
        max_namespaces_per_client: namespaces one client id may bring into the
            table.
        namespace_idle_s: seconds a namespace with no client and no lease is
            kept before its memory is released.
        client_hold_share: fraction of a namespace's CPU slots one client id
            (all its connections together) may hold reserved or being read.
        client_lease_share: fraction of the slots one client id may pin with
            leases; a lookup beyond it answers the rest as a miss.
        reservation_timeout_s: an uncommitted reservation older than this is
            aborted and its slot freed; the late commit gets ``expired``.
        refusal_log_interval_s: a refused registration (or expired
            reservations) is logged at WARNING once per client id and reason
            per interval.
        verify_loads: check a chunk's commit checksum (xxh3) before serving it
            from the CPU tier; a chunk another client overwrote is then a miss,
            dropped and counted (:mod:`kvtier.service.integrity`).
        controller: ``tcp://host:port`` of a ``kvtier controller`` to register
            with (:mod:`kvtier.fleet.agent`); None: none.
        instance_id: this server's id at the controller (default
            ``host:tcp-port:pid``, ``host:server:pid`` without TCP).
        controller_token: bearer token sent to the controller.
        kv_events_endpoint: ZMQ endpoint where tier changes are published as
            vLLM KV events (``tcp://*:5557`` binds); None: not published.
        kv_events_replay_endpoint: ZMQ endpoint of the events' replay socket.
    """

    socket_path: str
    tcp_host: str | None = None
    tcp_port: int = 0
    token: str | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    max_clients: int = 256
    max_namespaces: int = 8
    max_holds_per_client: int = 1024
    prefetch_queue: int = 4096
    handshake_timeout_s: float = 5.0
    idle_timeout_s: float | None = 600.0
    frame_timeout_s: float = 10.0
    max_unauthenticated: int = 16
    auth_backoff_s: float = 0.5
    auth_backoff_max_s: float = 30.0
    auth_sources: int = 4096
    http_max_connections: int = 32
    http_timeout_s: float = 5.0
    allowed_models: tuple[str, ...] = ()
    max_namespaces_per_client: int = 4
    namespace_idle_s: float = 300.0
    client_hold_share: float = 0.5
    client_lease_share: float = 0.5
    reservation_timeout_s: float = 30.0
    refusal_log_interval_s: float = 60.0
    verify_loads: bool = True
    controller: str | None = None
    instance_id: str | None = None
    controller_token: str | None = None
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None

    def __post_init__(self) -> None:
        """Raises ValueError for a bound that cannot work (non-positive, or a port outside 0-65535)."""
        for name in (
            "max_clients", "max_namespaces", "max_holds_per_client", "prefetch_queue",
            "max_unauthenticated", "auth_sources", "http_max_connections",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"server option {name} must be >= 1, got {getattr(self, name)}")
        for name in ("handshake_timeout_s", "idle_timeout_s", "frame_timeout_s", "auth_backoff_s", "http_timeout_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"server option {name} must be > 0 seconds, got {v}")
        if self.auth_backoff_max_s < self.auth_backoff_s:
            raise ValueError(
                f"server option auth_backoff_max_s ({self.auth_backoff_max_s}) must be >= auth_backoff_s ({self.auth_backoff_s})"
            )
        for name in ("tcp_port", "metrics_port"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 65535:
                raise ValueError(f"server option {name} must be a port in 0-65535, got {v}")
        if not self.socket_path:
            raise ValueError("server option socket_path must not be empty")
        if self.controller is not None:
            scheme, sep, rest = self.controller.partition("://")
            host, colon, port = rest.rpartition(":")
            if scheme != "tcp" or not sep or not host or not colon or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
                raise ValueError(f"server option controller must be tcp://HOST:PORT, got {self.controller!r}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("server option kv_events_replay_endpoint needs kv_events_endpoint")
        self.namespace_policy()  # raises ValueError for a namespace/quota option that cannot work

    def namespace_policy(self) -> NamespacePolicy:
        """The namespace table's and client quotas' limits (see :mod:`kvtier.service.namespaces`)."""
        return NamespacePolicy(
            max_namespaces=self.max_namespaces,
            allowed_models=tuple(self.allowed_models),
            max_per_client=self.max_namespaces_per_client,
            idle_release_s=self.namespace_idle_s,
            hold_share=self.client_hold_share,
            lease_share=self.client_lease_share,
            max_holds_per_client=self.max_holds_per_client,
            reservation_timeout_s=self.reservation_timeout_s,
            log_interval_s=self.refusal_log_interval_s,
            verify_loads=self.verify_loads,
        )
