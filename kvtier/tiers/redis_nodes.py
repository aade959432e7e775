"""Redis nodes for the Redis tier: connections, the cluster slot map, pipelined round trips.

:class:`RedisNodes` owns one :class:`NodePool` (idle connections and a circuit
breaker) per node, routes keys to their node (standalone: one node; cluster:
the owner of the key's hash slot, from ``CLUSTER SLOTS``) and runs one call's
pipelines: every node's commands are sent before any reply is read, all under
one deadline. A node whose breaker is open, or that fails, leaves its reply
handlers unrun (their results keep the caller's default: a miss); transport
failures feed its breaker; MOVED/ASK replies or a node failure mark the slot
map stale so the next call refreshes it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import redis
from redis.crc import key_slot

from kvtier.serde.base import Buffer
from kvtier.tiers.base import TierCounters
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.resp import CommandPacker, ProtocolError, RespError, Wire

log = logging.getLogger(__name__)

Addr = tuple[str, int]  # (host, port); ("unix", 0) for a Unix socket
STANDALONE: Addr = ("", 0)
TRANSPORT_ERRORS = (OSError, ProtocolError, ValueError, redis.RedisError)
NUM_SLOTS = 16384


@dataclass(frozen=True)
class NodeSettings:
    """Connection and breaker settings of every node (seconds)."""

    connect_timeout_s: float
    max_idle_connections: int
    breaker_failures: int
    breaker_backoff_s: float
    breaker_max_backoff_s: float


class NodePool:
    """Idle connections to one node; connects lazily within the caller's deadline."""

    def __init__(self, factory: Callable[[], redis.connection.AbstractConnection], opts: NodeSettings, name: str = ""):
        self._factory = factory
        self._opts = opts
        self._idle: list[redis.connection.AbstractConnection] = []
        self._lock = threading.Lock()
        self.breaker = CircuitBreaker(
            opts.breaker_failures, opts.breaker_backoff_s, opts.breaker_max_backoff_s, name=name
        )

    def acquire(self, deadline: float) -> redis.connection.AbstractConnection:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._factory()
        if getattr(conn, "_sock", None) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise socket.timeout("kvtier: deadline passed before connecting")
            conn.socket_connect_timeout = min(self._opts.connect_timeout_s, remaining)
            conn.socket_timeout = remaining
            conn.connect()
        return conn

    def release(self, conn: redis.connection.AbstractConnection, healthy: bool) -> None:
        if healthy:
            with self._lock:
                if len(self._idle) < self._opts.max_idle_connections:
                    self._idle.append(conn)
                    return
        conn.disconnect()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.disconnect()


def _socket_of(conn: redis.connection.AbstractConnection) -> socket.socket:
    """The socket of a connected redis-py connection (its ``__init__`` sets ``_sock = None``
    untyped, which type checkers take as its only type)."""
    return conn._sock  # type: ignore[return-value]  # redis-py: _sock is inferred as None


class Batch:
    """Commands for one node in one call, with a reply handler per command."""

    __slots__ = ("addr", "commands", "handlers", "conn", "wire", "failed")

    def __init__(self, addr: Addr):
        self.addr = addr
        self.commands: list[list[Any]] = []
        self.handlers: list[Callable[[Wire], None]] = []
        self.conn: redis.connection.AbstractConnection | None = None
        self.wire: Wire | None = None
        self.failed = False


class RedisNodes:
    """The nodes one Redis tier talks to (see the module doc).

    Args:
        connection: ``(class, kwargs)`` of redis-py connections (from the URL).
        settings: per-node connection and breaker settings.
        counters: the tier's counters (``errors``, ``skipped_calls`` are counted here).
        seeds: cluster seed nodes; empty for a standalone server.
    """

    def __init__(
        self,
        connection: tuple[type, dict[str, Any]],
        settings: NodeSettings,
        counters: TierCounters,
        seeds: Sequence[Addr] = (),
    ):
        self._conn_class, self._conn_kwargs = connection
        self.settings = settings
        self.counters = counters
        self.cluster = bool(seeds)
        self._seeds = list(seeds)
        self._lock = threading.Lock()
        self._pools: dict[Addr, NodePool] = {}
        #: Owner of each hash slot (cluster); None until loaded.
        self.slots: list[Addr] | None = None
        self._slots_stale = True
        self._topology_breaker = CircuitBreaker(
            settings.breaker_failures, settings.breaker_backoff_s, settings.breaker_max_backoff_s
        )
        self.redirects = 0
        self.topology_refreshes = 0

    def pool(self, addr: Addr) -> NodePool:
        with self._lock:
            pool = self._pools.get(addr)
            if pool is None:
                kwargs = dict(self._conn_kwargs)
                if addr != STANDALONE:
                    kwargs["host"], kwargs["port"] = addr
                    kwargs.pop("orig_host_address", None)
                cls = self._conn_class
                where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}"
                pool = self._pools[addr] = NodePool(lambda: cls(**kwargs), self.settings, name=f"redis {where}")
            return pool

    def refresh_slots(self, deadline: float) -> bool:
        """Load the cluster slot map (CLUSTER SLOTS) from any reachable node."""
        if not self._topology_breaker.allow():
            return False
        with self._lock:
            candidates = list(dict.fromkeys(self._seeds + [a for a in self._pools if a != STANDALONE]))
        for addr in candidates:
            pool = self.pool(addr)
            conn = None
            try:
                conn = pool.acquire(deadline)
                wire = Wire(_socket_of(conn), deadline)
                wire.send(packed([[b"CLUSTER", b"SLOTS"]]))
                reply = wire.read_reply()
            except TRANSPORT_ERRORS as exc:
                log.debug("kvtier redis: CLUSTER SLOTS from %s:%d failed: %s", *addr, exc)
                if conn is not None:
                    pool.release(conn, healthy=False)
                continue
            pool.release(conn, healthy=True)
            if not isinstance(reply, list) or not reply:
                continue
            slots: list[Addr] = [STANDALONE] * NUM_SLOTS
            for entry in reply:
                start, end, primary = entry[0], entry[1], entry[2]
                host = primary[0].decode() if primary[0] else addr[0]
                node = (host, int(primary[1]))
                for s in range(int(start), int(end) + 1):
                    slots[s] = node
            with self._lock:
                self.slots = slots
                self._slots_stale = False
                self.topology_refreshes += 1
            self._topology_breaker.success()
            return True
        self._topology_breaker.failure()
        return False

    def group(self, rkeys: Sequence[bytes], deadline: float) -> dict[Addr, list[int]] | None:
        """Indices of ``rkeys`` per owning node; None if the cluster topology is unknown."""
        if not self.cluster:
            return {STANDALONE: list(range(len(rkeys)))}
        if self._slots_stale or self.slots is None:
            self.refresh_slots(deadline)
        slots = self.slots
        if slots is None:
            return None
        groups: dict[Addr, list[int]] = {}
        for i, rk in enumerate(rkeys):
            node = slots[key_slot(rk)]
            if node == STANDALONE:  # slot not served (cluster incomplete)
                return None
            groups.setdefault(node, []).append(i)
        return groups

    def run(self, batches: Sequence[Batch], deadline: float) -> None:
        """Send every node's pipeline, then read every node's replies.

        A node whose breaker is open, or that fails, leaves its handlers unrun
        (their results keep the default miss); transport failures feed its breaker.
        """
        live: list[tuple[Batch, redis.connection.AbstractConnection, Wire]] = []
        for b in batches:
            pool = self.pool(b.addr)
            if not pool.breaker.allow():
                b.failed = True
                self.counters.add(skipped_calls=1)
                continue
            try:
                conn = b.conn = pool.acquire(deadline)
                wire = b.wire = Wire(_socket_of(conn), deadline)
                wire.send(packed(b.commands))
            except Exception as exc:  # transport errors, and any bug: never raise to the engine
                self._node_failed(b, pool, exc)
                continue
            live.append((b, conn, wire))
        for b, conn, wire in live:
            pool = self.pool(b.addr)
            try:
                for handler in b.handlers:
                    handler(wire)
            except Exception as exc:  # the stream position is unknown: drop the connection
                self._node_failed(b, pool, exc)
                continue
            pool.release(conn, healthy=True)
            pool.breaker.success()

    def _node_failed(self, b: Batch, pool: NodePool, exc: BaseException) -> None:
        b.failed = True
        if b.conn is not None:
            pool.release(b.conn, healthy=False)
            b.conn = None
        pool.breaker.failure()
        self.counters.add(errors=1)
        if self.cluster:
            self._slots_stale = True
        if isinstance(exc, TRANSPORT_ERRORS):
            log.debug("kvtier redis: node %s failed: %r", b.addr, exc)
        else:
            log.error("kvtier redis: unexpected error talking to %s", b.addr, exc_info=exc)

    def note_error(self, reply: RespError) -> None:
        if reply.is_redirect:
            self._slots_stale = True
            with self._lock:
                self.redirects += 1
        else:
            log.debug("kvtier redis: error reply %s", reply.message)

    def primaries(self, deadline: float) -> list[Addr]:
        """Every node that owns slots (cluster: refreshed map), or the one standalone server."""
        if not self.cluster:
            return [STANDALONE]
        if not self.refresh_slots(deadline) and self.slots is None:
            return []
        return sorted(set(self.slots or ()) - {STANDALONE})

    def breaker_states(self) -> dict[str, str]:
        with self._lock:
            pools = dict(self._pools)
        return {("standalone" if a == STANDALONE else f"{a[0]}:{a[1]}"): p.breaker.state for a, p in pools.items()}

    def breaker_trips(self) -> int:
        with self._lock:
            return sum(p.breaker.trips for p in self._pools.values())

    def close(self) -> None:
        with self._lock:
            pools = list(self._pools.values())
        for pool in pools:
            pool.close()


def packed(commands: Sequence[Sequence[Any]]) -> list[Buffer]:
    packer = CommandPacker()
    for cmd in commands:
        packer.add(cmd)
    return packer.finish()


def glob_escape(prefix: bytes) -> bytes:
    out = bytearray()
    for ch in prefix:
        if ch in b"*?[]\\":
            out += b"\\"
        out.append(ch)
    return bytes(out)
