"""``kvtier server``'s link to the fleet: its agent and its KV event publisher.

:class:`ServiceLink` follows the server's namespace hosts (``sync`` at each
registration and every ``poll_s``): a new host's manager is added to the
:class:`~kvtier.fleet.agent.FleetAgent` (role ``"server"``) and its tier changes
are published as vLLM KV events (:mod:`kvtier.events`: chunk keys as block hashes,
``block_size`` = the namespace's chunk size, vLLM 0.32 media and localities, ownership ``kvtier``);
a released host is removed.

The managers' listeners only append to a bounded deque; a relay thread turns the
changes into events and queues them on the publisher (which never blocks
either). Beyond ``max_pending`` changes, new ones are dropped and counted.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Protocol

from kvtier.fleet.agent import FleetAgent, default_instance_id, namespace_info, tier_infos
from kvtier.protocol.fleet import TierInfo
from kvtier.protocol.trust import credentials_from_config
from kvtier.storage.tier_events import TierChange

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.config import KVTierConfig
    from kvtier.service.namespace_host import NamespaceHost
    from kvtier.service.options import ServerOptions

log = logging.getLogger(__name__)


class LinkedServer(Protocol):
    """What the link reads of the server it wires into the fleet (:class:`kvtier.service.server.CacheServer`).

    A Protocol rather than the class: the server starts its link, so naming the class here made the two
    modules a cycle (issue 25).
    """

    config: KVTierConfig
    options: ServerOptions
    tcp_address: tuple[str, int] | None
    peer_server: Any

    def hosts(self) -> list[NamespaceHost]:
        """The server's namespace hosts now."""
        ...


class ServiceLink:
    """The fleet agent and KV event publisher of one :class:`~kvtier.service.server.CacheServer`.

    Args:
        server: the cache server (its ``options`` name the controller and the endpoints).
        poll_s: period of the namespace sync and of the event relay (seconds).
        max_pending: tier changes waiting for the publisher; more are dropped (counted).

    Raises:
        ValueError: a bad controller address.
        zmq.ZMQError: the events endpoint cannot be bound.
    """

    def __init__(self, server: LinkedServer, poll_s: float = 0.02, max_pending: int = 65536):
        o = server.options
        self.server = server
        self.poll_s = poll_s
        self.max_pending = max_pending
        self.dropped_changes = 0
        self._lower_reported = False
        self.untranslatable = 0
        self.agent: FleetAgent | None = None
        self.publisher: Any = None
        self._hosts: dict[bytes, tuple[Any, Callable[[TierChange], None] | None]] = {}
        self._pending: deque[tuple[int, TierChange]] = deque()
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()  # one sync at a time (connection threads and the relay)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        cfg = server.config
        creds = credentials_from_config(cfg)  # TrustError (a ValueError): unusable fleet key or members
        if o.kv_events_endpoint:
            from kvtier.events.publisher import EventPublisher

            plain = bool(getattr(cfg, "kv_events_plain", False))
            self.publisher = EventPublisher(o.kv_events_endpoint, o.kv_events_replay_endpoint,
                                            credentials=None if plain else creds, plain=plain)
            if self.publisher.public_key:
                log.info("kvtier server: KV events on %s for fleet members with the events role (CURVE; server "
                         "key %s)", self.publisher.endpoint, self.publisher.public_key)
        if o.controller:
            port = server.tcp_address[1] if server.tcp_address else "server"
            self.agent = FleetAgent(
                o.controller, o.instance_id or default_instance_id(port), "server", token=o.controller_token,
                tiers=server_tiers(server.config), peer_url=getattr(server.peer_server, "url", "") or "",
                credentials=creds, controller_key=getattr(cfg, "controller_key", None),
            )

    def start(self) -> "ServiceLink":
        self.sync()
        if self.agent is not None:
            self.agent.start()
        self._thread = threading.Thread(target=self._run, name="kvtier-fleet-link", daemon=True)
        self._thread.start()
        return self

    def sync(self) -> None:
        """Follow the server's namespace hosts: add new ones, drop released ones."""
        with self._sync_lock:
            self._sync()

    def _sync(self) -> None:
        from kvtier.storage.instance_ops import InstanceOps

        hosts = {h.digest: h for h in self.server.hosts()}
        with self._lock:
            known = dict(self._hosts)
        for digest, host in hosts.items():
            if digest in known and known[digest][0] is host:
                continue
            if digest in known:
                self._drop(digest)
            listener = None
            if self.publisher is not None:
                listener = self._listener(host.namespace.chunk_size)
                host.manager.subscribe(listener)
            with self._lock:
                self._hosts[digest] = (host, listener)
            if self.agent is not None:
                if not self._lower_reported:
                    self._lower_reported = True
                    cpu = self.agent.tiers[0] if self.agent.tiers else None
                    self.agent.tiers = [cpu or TierInfo("cpu", "cpu", 0), *tier_infos(host.manager)[1:]]
                self.agent.add_namespace(digest, namespace_info(host.namespace), InstanceOps(host.manager))
        for digest in set(known) - set(hosts):
            self._drop(digest)

    def _drop(self, digest: bytes) -> None:
        with self._lock:
            host, listener = self._hosts.pop(digest, (None, None))
        if host is not None and listener is not None:
            host.manager.unsubscribe(listener)
        if self.agent is not None:
            self.agent.remove_namespace(digest)

    def _listener(self, chunk_size: int) -> Callable[[TierChange], None]:
        def on_change(change: TierChange) -> None:
            if len(self._pending) >= self.max_pending:
                self.dropped_changes += 1
                return
            self._pending.append((chunk_size, change))

        return on_change

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(self.poll_s):
            n += 1
            if n % 10 == 0:
                try:
                    self.sync()
                except Exception:
                    log.exception("kvtier server: fleet namespace sync failed")
            self._relay()

    def _relay(self) -> None:
        """Publish the pending tier changes as KV events (batches of at most ~4096 events)."""
        from kvtier.events.from_tiers import tier_change_events

        while self._pending:
            events: list[Any] = []
            while self._pending and len(events) < 4096:
                chunk_size, ch = self._pending.popleft()
                try:
                    events.extend(tier_change_events(ch.op, ch.tier, ch.keys, ch.parents, chunk_size))
                except ValueError:
                    self.untranslatable += 1
            if events and self.publisher is not None:
                self.publisher.publish(events)

    def close(self) -> None:
        """Stop the relay, the agent and the publisher; unsubscribe from every manager (within ~1 s)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
        self._relay()  # what the tiers changed up to now
        with self._lock:
            entries, self._hosts = list(self._hosts.values()), {}
        for host, listener in entries:
            if listener is not None:
                host.manager.unsubscribe(listener)
        if self.agent is not None:
            self.agent.close()
        if self.publisher is not None:
            self.publisher.close()


def server_tiers(config: Any) -> list[TierInfo]:
    """The server's local tiers as configured, known before any namespace registers (the CPU pool and
    the disk tier, the server's totals); the first namespace's manager then reports every tier."""
    tiers = [TierInfo("cpu", "cpu", int(config.cpu_capacity), False)]
    if config.disk_path is not None:
        tiers.append(TierInfo("disk", str(config.disk_path), int(config.disk_capacity), False))
    return tiers
