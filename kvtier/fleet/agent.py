"""The instance side of the fleet control plane: one agent per kvtier instance.

A :class:`FleetAgent` runs one daemon thread with one ZMQ ``DEALER`` socket connected to
the controller's ``ROUTER``; the wire protocol is :mod:`kvtier.protocol.fleet`. The socket
sets no routing identity (the controller assigns one per connection and binds the instance
to it: a claimed id proves nothing) and, with fleet credentials and ``controller_key``, is a
CURVE client that talks only to the controller holding that key and proves this instance's
own key. When the controller has been silent past the expiry the agent closes the socket and
opens a new one (a new connection) before registering again. What it does:

- **Register** at start, again whenever the controller answers ``Ack(known=False)``
  (a restarted controller), after silence longer than the expiry, and when a
  namespace is added or removed (:meth:`FleetAgent.add_namespace`).
- **Snapshot** every ``(namespace, tier)`` after each ``Ack(known=True)`` that
  answers a register, whenever an ``Ack`` asks ``resync``, and after a local loss
  (a queue overflow, a send refused). The pending changes are folded in first:
  the snapshot is read after they are discarded, its ``seq`` is the last
  ``Changes`` sent. Removals from a shared tier are never discarded (a snapshot
  repairs only this instance's view of it): those folded, overflowed or in a
  refused send go as one ``Changes`` right before the snapshot.
- **Changes**: tier changes from the storage managers' listeners (a bounded,
  coalescing :class:`~kvtier.fleet.changes.ChangeQueue`), numbered 1, 2, 3...
  per epoch.
- **Heartbeat** every ``heartbeat_s`` with the last ``seq`` and the last health
  report (health is computed on the op pool, never on the agent thread).
- **Operations**: ``OpRequest``\\ s run on a small thread pool against the
  namespace's :class:`~kvtier.storage.instance_ops.InstanceOps`; the answer is
  ``OpResult`` (``ok=False`` with the error text for any exception or a passed
  deadline).

Never blocks the engine: the engine's threads only append to the change queue;
every send is ``NOBLOCK`` on a socket with a small ``SNDHWM`` and
``ZMQ_IMMEDIATE`` (nothing queues for a controller that is not connected). A
refused send is dropped and counted; a lost ``Changes`` or ``Snapshot`` part is
repaired by a snapshot once the controller answers again.

The parts: :mod:`.identity` (ids, addresses, Register infos), :mod:`.namespaces`
(reported namespaces and their change subscriptions), :mod:`.snapshots` (Snapshot parts),
:mod:`.op_runner` (the op pool). Their public helpers are importable from here too.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from dataclasses import dataclass
from typing import Literal, Sequence

import zmq

from kvtier.fleet.changes import ChangeQueue
from kvtier.fleet.identity import (
    advertised_peer_url,
    default_instance_id,
    namespace_info,
    parse_controller,
    peer_url_of,
    tier_infos,
)
from kvtier.fleet.namespaces import NamespaceSet
from kvtier.fleet.op_runner import OpRunner, OpsLike
from kvtier.fleet.snapshots import snapshot_parts
from kvtier.protocol import fleet as F
from kvtier.protocol.curve import bound_messages, curve_client
from kvtier.protocol.trust import Credentials

log = logging.getLogger(__name__)

__all__ = ["AgentStats", "FleetAgent", "OpsLike", "default_instance_id", "namespace_info", "parse_controller",
           "tier_infos"]


@dataclass
class AgentStats:
    """Counters of one agent (monotonic; for tests and ``/metrics``)."""

    registers: int = 0
    snapshots: int = 0
    changes_sent: int = 0
    heartbeats: int = 0
    ops: int = 0
    dropped_sends: int = 0  # refused by ZMQ (controller absent or its queue full)
    injected_drops: int = 0  # Changes dropped by the fault-injection hook
    bad_frames: int = 0  # controller frames that did not decode
    ops_refused: int = 0  # OpRequests refused because the op pool was full
    refusals: int = 0  # Registers the controller refused (token, version, tiers), each logged once a minute


class FleetAgent:
    """Registers an instance with the controller and keeps its index in sync (see module doc).

    Args:
        controller_url: ``tcp://host:port`` of the controller's ROUTER.
        instance_id: this instance's id (default :func:`default_instance_id`).
        role: ``"embedded"`` (a vLLM connector's worker) or ``"server"`` (``kvtier server``).
        namespaces: namespace digest -> (its :class:`~kvtier.protocol.fleet.NamespaceInfo`,
            its :class:`~kvtier.storage.instance_ops.InstanceOps`). The agent subscribes to
            the storage manager behind each (``ops.m``) for its tier changes.
        tiers: the instance's tiers.
        token: bearer token sent in ``Register``.
        heartbeat_s: heartbeat period in seconds (an ``Ack`` may change it).
        expiry_s: silence from the controller after which the agent registers again.
        max_pending_keys: bound of the change queue (beyond: dropped, then a snapshot).
        op_workers: threads running operations.
        drop_fraction: fault injection: this fraction of ``Changes`` messages is dropped
            instead of sent (tests; 0 in production).
        port: the instance's port, for the default id.
        peer_url: the URL this instance's peer server listens on, sent in ``Register.peer_url`` (the
            controller then directs other instances' P2P pulls here). "" (default): the peer server of
            a reported namespace's storage manager (``manager.peer_server.url``), if any.
        credentials: this instance's fleet key (its members are not used here).
        controller_key: the controller's Z85 public key; with ``credentials`` the link is CURVE.

    Raises:
        ValueError: a bad controller address, role or fraction, or ``controller_key`` without credentials.
    """

    #: Seconds between Registers after the controller refused one (a wrong token does not fix itself).
    REFUSED_RETRY_S = 10.0

    def __init__(
        self,
        controller_url: str,
        instance_id: str | None = None,
        role: Literal["embedded", "server"] = "embedded",
        namespaces: dict[bytes, tuple[F.NamespaceInfo, OpsLike]] | None = None,
        tiers: Sequence[F.TierInfo] = (),
        token: str | None = None,
        heartbeat_s: float = F.DEFAULT_HEARTBEAT_S,
        expiry_s: float = 2 * F.DEFAULT_EXPIRY_S,
        max_pending_keys: int = 1 << 20,
        op_workers: int = 2,
        drop_fraction: float = 0.0,
        port: int | str | None = None,
        seed: int | None = None,
        peer_url: str = "",
        credentials: Credentials | None = None,
        controller_key: str | None = None,
    ):
        self.endpoint = parse_controller(controller_url)
        if role not in ("embedded", "server"):
            raise ValueError(f"role must be 'embedded' or 'server', got {role!r}")
        if not 0.0 <= drop_fraction <= 1.0:
            raise ValueError(f"drop_fraction must be in [0, 1], got {drop_fraction}")
        if not heartbeat_s > 0 or not expiry_s > 0:
            raise ValueError("heartbeat_s and expiry_s must be > 0 seconds")
        if controller_key and credentials is None:
            raise ValueError("controller_key needs this instance's fleet key (fleet_key / fleet_members)")
        self.credentials = credentials
        self.controller_key = controller_key or None
        self.instance_id = instance_id or default_instance_id(port)
        self.role = role
        self.tiers = list(tiers)
        self.token = token or ""
        self.peer_url = peer_url
        self.heartbeat_s = heartbeat_s
        self.expiry_s = expiry_s
        self.drop_fraction = drop_fraction
        self.epoch = os.urandom(8).hex()
        self.stats = AgentStats()
        self.changes = ChangeQueue(max_pending_keys, shared=[t.kind for t in self.tiers if t.shared])
        self._rng = random.Random(seed)
        self._spaces = NamespaceSet(self.changes)
        self._seq = 0  # last Changes seq sent (or dropped) in this epoch
        self._resync_id = 0
        self._registered = False  # the controller acked our last Register with known=True
        self._register_due = True  # send a Register (first, or namespaces changed)
        self._awaiting_ack = False  # a Register is in flight
        self._snapshot_due = False
        self._snapshot_retry_at = 0.0  # after a failed snapshot: wait a heartbeat before the next
        self._last_register = 0.0
        self._refused_until = 0.0  # after a refused Register: the next try, monotonic seconds
        self._last_refusal = ""
        self._refusal_logged_at = 0.0
        self._last_rx = 0.0
        self._last_hb = 0.0
        self._ops = OpRunner(self.namespaces, self.stats, op_workers)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reconnect = False  # open a new connection before the next Register
        self.reconnects = 0
        for digest, (info, ops) in (namespaces or {}).items():
            self._spaces.attach(digest, info, ops)

    # -- namespaces ----------------------------------------------------------------------------
    def add_namespace(self, digest: bytes, info: F.NamespaceInfo, ops: OpsLike) -> None:
        """Start reporting another namespace: a new Register, then a full snapshot (no-op if known)."""
        if digest in self._spaces:
            return
        self._spaces.attach(digest, info, ops)
        self._register_due = True

    def remove_namespace(self, digest: bytes) -> None:
        """Stop reporting a namespace (e.g. the server released it): unsubscribe, register again."""
        if self._spaces.detach(digest):
            self._register_due = True

    def namespaces(self) -> dict[bytes, tuple[F.NamespaceInfo, OpsLike]]:
        """A copy of the reported namespaces: digest -> (info, InstanceOps)."""
        return self._spaces.snapshot()

    @property
    def seq(self) -> int:
        """The last ``Changes`` seq of this epoch."""
        return self._seq

    @property
    def registered(self) -> bool:
        """True while the controller knows this instance (its last Ack said so)."""
        return self._registered

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> "FleetAgent":
        """Start the agent thread (idempotent); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvtier-fleet-agent", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop within ``timeout_s``: the thread ends, listeners are removed, running ops are abandoned."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._ops.close()
        self._spaces.unsubscribe_all()

    def __enter__(self) -> "FleetAgent":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the agent thread ----------------------------------------------------------------------
    def _socket(self, ctx: zmq.Context) -> zmq.Socket:
        """A new DEALER connected to the controller (no routing identity; CURVE with a controller key)."""
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.SNDHWM, 256)
            sock.setsockopt(zmq.RCVHWM, 1024)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            bound_messages(sock, F.MAX_MESSAGE_BYTES)
            if self.controller_key and self.credentials is not None:
                curve_client(sock, self.credentials.key, self.controller_key)
            sock.connect(self.endpoint)
        except BaseException:
            sock.close(0)
            raise
        return sock

    def _run(self) -> None:
        ctx = zmq.Context()
        holder: list[zmq.Socket] = []
        try:
            self._loop(ctx, holder)
        except Exception:
            log.exception("kvtier fleet agent: stopped by an error (the engine goes on without the controller)")
        finally:
            for sock in holder:
                sock.close(0)
            ctx.term()

    def _loop(self, ctx: zmq.Context, holder: list[zmq.Socket]) -> None:
        sock = self._socket(ctx)
        holder.append(sock)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            now = time.monotonic()
            if self._reconnect:  # the controller went silent: a new connection, then a Register
                self._reconnect = False
                poller.unregister(sock)
                sock.close(0)
                holder.remove(sock)
                sock = self._socket(ctx)
                holder.append(sock)
                poller.register(sock, zmq.POLLIN)
                self.reconnects += 1
            self._maybe_register(sock, now)
            if self._registered and self._snapshot_due and now >= self._snapshot_retry_at:
                self._send_snapshot(sock)
            if self._registered:
                if self.changes.overflowed:
                    self._snapshot_due = True
                else:
                    self._send_changes(sock)
            elif not self._awaiting_ack:
                self.changes.fold()  # the snapshot after the register covers them
            self._send_results(sock)
            if self._registered and now - self._last_hb >= self.heartbeat_s:
                self._last_hb = now
                self._ops.refresh_health(now)
                self._send(sock, F.Heartbeat(self.instance_id, self.epoch, self._seq, self._ops.health))
                self.stats.heartbeats += 1
            if self._registered and now - self._last_rx > self.expiry_s:
                log.info("kvtier fleet agent: controller silent for %.1f s; reconnecting and registering again",
                         now - self._last_rx)
                self._registered = False
                self._register_due = True
                self._reconnect = True
            timeout_ms = max(1, int(min(self.heartbeat_s, 0.05) * 1000))
            for s, _ in poller.poll(timeout_ms):
                while True:
                    try:
                        frame = s.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_frame(frame)

    def _maybe_register(self, sock: zmq.Socket, now: float) -> None:
        if now < self._refused_until and not self._register_due:
            return
        retry = max(0.2, self.heartbeat_s)
        if not (self._register_due or (not self._registered and now - self._last_register >= retry)):
            return
        if self._awaiting_ack and not self._register_due and now - self._last_register < retry:
            return
        infos = self._spaces.infos()
        msg = F.Register(
            self.instance_id, self.epoch, F.FLEET_PROTOCOL_VERSION, self.role, socket.gethostname(), os.getpid(),
            infos, list(self.tiers), self.token,
            advertised_peer_url(self.peer_url) if self.peer_url else peer_url_of(self.namespaces()),
        )
        self._last_register = now
        self._register_due = False
        self._registered = False
        if self._send(sock, msg):
            self._awaiting_ack = True
            self.stats.registers += 1

    def _on_frame(self, frame: bytes) -> None:
        try:
            msg = F.decode_controller_message(frame)
        except F.FleetProtocolError as exc:
            self.stats.bad_frames += 1
            log.warning("kvtier fleet agent: dropped a bad controller frame: %s", exc)
            return
        self._last_rx = time.monotonic()
        if isinstance(msg, F.Ack):
            if msg.heartbeat_s and msg.heartbeat_s > 0:
                self.heartbeat_s = float(msg.heartbeat_s)
            if msg.refused:  # our Register was refused: say why (not every retry), retry later
                self._registered = False
                self._awaiting_ack = False
                self._register_due = False
                self.stats.refusals += 1
                now = time.monotonic()
                self._refused_until = now + (msg.retry_s if msg.retry_s > 0 else self.REFUSED_RETRY_S)
                if msg.refused != self._last_refusal or now - self._refusal_logged_at >= 60.0:
                    self._last_refusal, self._refusal_logged_at = msg.refused, now
                    log.warning("kvtier fleet agent: the controller at %s refused this instance: %s "
                                "(retrying every %.0f s)", self.endpoint, msg.refused, self.REFUSED_RETRY_S)
                return
            if not msg.known:
                self._registered = False
                self._awaiting_ack = False
                self._register_due = True
                return
            if self._awaiting_ack:
                self._awaiting_ack = False
                self._snapshot_due = True  # a full resync after every (re)register
            self._registered = True
            if msg.resync:
                self._snapshot_due = True
        elif isinstance(msg, F.OpRequest):
            self._ops.submit(msg)

    # -- sending -------------------------------------------------------------------------------
    def _send(self, sock: zmq.Socket, msg: F.AgentMessage) -> bool:
        """Send without blocking; False (counted) if ZMQ refused it."""
        try:
            sock.send(F.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.stats.dropped_sends += 1
            return False

    def _send_changes(self, sock: zmq.Socket) -> None:
        while len(self.changes):
            batch = self.changes.drain()
            if not batch:
                return
            self._seq += 1
            if self.drop_fraction and self._rng.random() < self.drop_fraction:
                self.stats.injected_drops += 1
                self.changes.requeue(batch)  # a shared tier's removals still reach the other sharers
                continue
            if self._send(sock, F.Changes(self.instance_id, self.epoch, self._seq, batch)):
                self.stats.changes_sent += 1
            else:
                self.changes.requeue(batch)
                self._snapshot_due = True  # the gap is repaired by a snapshot
                return

    def _send_snapshot(self, sock: zmq.Socket) -> None:
        """Fold the pending changes, send the shared tiers' removals among them (and any set aside
        before) as changes, then read every (namespace, tier) and send it in parts."""
        self.changes.fold()
        while kept := self.changes.take_kept():
            self._seq += 1
            if self._send(sock, F.Changes(self.instance_id, self.epoch, self._seq, kept)):
                self.stats.changes_sent += 1
            else:
                self.changes.requeue(kept)
                self._snapshot_due = True
                self._snapshot_retry_at = time.monotonic() + 0.05
                return
        self._snapshot_due = False
        self._resync_id += 1
        rid = self._resync_id
        for digest, (_, ops) in self.namespaces().items():
            try:
                tiers = ops.snapshot()
                pinned = b"".join(sorted(ops.pinned_keys() or ()))
            except Exception:
                log.exception("kvtier fleet agent: snapshot of namespace %s failed", digest.hex()[:16])
                self._snapshot_due = True
                self._snapshot_retry_at = time.monotonic() + max(1.0, self.heartbeat_s)
                continue
            kinds = [t.kind for t in self.tiers]
            for msg in snapshot_parts(self.instance_id, self.epoch, rid, digest, tiers, kinds, pinned, self._seq):
                if not self._send(sock, msg):
                    self._snapshot_due = True  # retried soon
                    self._snapshot_retry_at = time.monotonic() + 0.05
                    return
        self.stats.snapshots += 1

    # -- operations (:mod:`kvtier.fleet.op_runner`) --------------------------------------------
    def execute(self, req: F.OpRequest) -> F.OpResult:
        """Run one operation against its namespace's InstanceOps (any failure is an ``ok=False`` result)."""
        return self._ops.execute(req)

    def _send_results(self, sock: zmq.Socket) -> None:
        for res in self._ops.results():
            self._send(sock, res)
