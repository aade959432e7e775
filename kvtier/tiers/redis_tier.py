"""Redis tier: chunk payloads in Redis or Redis Cluster, batched and failure-tolerant.

URLs: ``redis://[user:pass@]host:port/db``, ``rediss://`` (TLS), ``unix:///path.sock?db=N``,
``redis+cluster://host:port`` / ``rediss+cluster://`` (Redis Cluster; one seed node,
more via ``seeds=``). Tier options may also be given as query parameters
(``?ttl_s=3600&codec=shuffle-zstd``); other query parameters go to redis-py.

Data model: one string value per chunk under ``key_prefix + key.hex()``, holding
the checksummed envelope of :mod:`kvtier.serde.envelope`; optional TTL (``SET ..
PX``). **Capacity is Redis's own**: set ``maxmemory`` and ``maxmemory-policy
allkeys-lru`` (or ``volatile-lru`` with a TTL) on the server; kvtier does no
remote accounting. Under ``noeviction`` a full Redis answers writes with an OOM
error: those writes are dropped and counted (``put_failed``).

Round trips: every batched call is one pipelined round trip per node (cluster
keys are grouped by hash slot owner; all nodes are sent to before any reply is
read). ``contains_many`` pipelines one ``EXISTS`` per key.

Copies (raw codec): a put sends the envelope header and the caller's payload
buffer with ``sendmsg`` scatter-gather (0 user-space copies; the kernel copies
into the socket). A get parses the header from a 64 KiB read buffer and
``recv_into``s the payload straight into the caller's buffer (0 user-space copies
beyond at most one 64 KiB read-ahead). Plain redis-py with hiredis would make 3
(see :mod:`kvtier.tiers.resp`). Non-raw codecs receive into a per-thread scratch
buffer and decode into the caller's buffer.

Failure model:
- every call has one deadline, ``timeout_s`` after it starts, covering connects
  (at most ``connect_timeout_s`` each), sends and replies of all nodes;
- a timeout, refused connection or broken stream counts as a failure for that
  node; after ``breaker_failures`` consecutive failures the node's circuit breaker
  opens and calls report misses without touching it for ``breaker_backoff_s``
  (doubling up to ``breaker_max_backoff_s``), then one probe call reconnects;
- error replies (OOM, MOVED, WRONGTYPE) are per-key misses/failed writes, not
  node failures; MOVED/ASK or a node failure make the cluster slot map refresh;
- a corrupt/foreign value is a miss, counted, and deleted best-effort.

redis-py provides URL parsing and connection set-up (TCP/TLS/Unix, AUTH, SELECT,
with its retries disabled); kvtier speaks RESP on the connected socket.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from kvtier.serde.base import Buffer, Codec, ValueSpec
from kvtier.serde.envelope import ValueMiss, encode_value, read_value_into
from kvtier.serde.registry import decoders_with, make_codec
from kvtier.tiers.base import RemoteTier, TierCounters, check_key, writable_view
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.resp import CommandPacker, ProtocolError, RespError, Wire

log = logging.getLogger(__name__)

Addr = tuple[str, int]  # (host, port); ("unix", 0) for a Unix socket
_STANDALONE: Addr = ("", 0)
_TRANSPORT_ERRORS = (OSError, ProtocolError, ValueError, redis.RedisError)
_NUM_SLOTS = 16384


@dataclass(frozen=True)
class RedisTierOptions:
    """Settings of a :class:`RedisTier` (units: seconds, bytes).

    Attributes:
        codec: codec name for writes (``raw``, ``shuffle-zstd``, ``int8``) or instance.
        codec_options: options of the named codec, e.g. ``{"level": 3}``.
        spec: dtype and shape hint of the payloads (for codecs).
        ttl_s: expiry of stored chunks in Redis; None keeps them until Redis evicts.
        key_prefix: prefix of every Redis key this tier writes; ``clear`` removes only these.
        timeout_s: bound on one call, all round trips included.
        connect_timeout_s: bound on opening one connection (within ``timeout_s``).
        breaker_failures: consecutive failures that open a node's circuit breaker.
        breaker_backoff_s / breaker_max_backoff_s: first and largest back-off.
        max_idle_connections: idle connections kept per node.
        seeds: extra cluster seed nodes ``"host:port"``.
    """

    codec: str | Codec = "raw"
    codec_options: Mapping[str, Any] = field(default_factory=dict)
    spec: ValueSpec = ValueSpec()
    ttl_s: float | None = None
    key_prefix: str = "kvtier:"
    timeout_s: float = 1.0
    connect_timeout_s: float = 0.5
    breaker_failures: int = 3
    breaker_backoff_s: float = 1.0
    breaker_max_backoff_s: float = 30.0
    max_idle_connections: int = 8
    seeds: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeout_s and connect_timeout_s must be positive")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError("ttl_s must be positive (or None for no expiry)")


_FLOAT_OPTS = {"ttl_s", "timeout_s", "connect_timeout_s", "breaker_backoff_s", "breaker_max_backoff_s"}
_INT_OPTS = {"breaker_failures", "max_idle_connections"}
_STR_OPTS = {"codec", "key_prefix"}


class _NodePool:
    """Idle connections to one node; connects lazily within the caller's deadline."""

    def __init__(self, factory: Callable[[], redis.connection.AbstractConnection], opts: RedisTierOptions):
        self._factory = factory
        self._opts = opts
        self._idle: list[redis.connection.AbstractConnection] = []
        self._lock = threading.Lock()
        self.breaker = CircuitBreaker(opts.breaker_failures, opts.breaker_backoff_s, opts.breaker_max_backoff_s)

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


class _Batch:
    """Commands for one node in one call, with a reply handler per command."""

    __slots__ = ("addr", "commands", "handlers", "conn", "wire", "failed")

    def __init__(self, addr: Addr):
        self.addr = addr
        self.commands: list[list[Any]] = []
        self.handlers: list[Callable[[Wire], None]] = []
        self.conn = None
        self.wire: Wire | None = None
        self.failed = False


class RedisTier(RemoteTier):
    """Chunk payloads in Redis (standalone or cluster). See the module doc for semantics.

    Args:
        url: ``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://`` or ``rediss+cluster://``.
        options: :class:`RedisTierOptions` fields as keywords.
        decoders: extra codecs readers may decode (name -> instance).

    Raises:
        ValueError: bad URL or options (nothing is contacted at construction; an
            unreachable Redis only makes calls miss).
    """

    name = "redis"
    schemes = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")

    def __init__(self, url: str, decoders: Mapping[str, Codec] | None = None, **options: Any):
        try:
            self.options = opts = RedisTierOptions(**options)
        except TypeError as exc:
            raise ValueError(f"bad Redis tier option: {exc}") from None
        self.codec = make_codec(opts.codec, **dict(opts.codec_options))
        self.decoders = decoders_with(decoders)
        self.counters = TierCounters()
        self._prefix = opts.key_prefix.encode()
        self._ttl_ms = None if opts.ttl_s is None else max(1, int(opts.ttl_s * 1000))
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._closed = False
        self.redirects = 0
        self.topology_refreshes = 0
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in self.schemes:
            raise ValueError(f"RedisTier cannot open {url!r}: scheme must be one of {self.schemes}")
        self.cluster = scheme.endswith("+cluster")
        # String surgery, not urlunsplit: that drops the "//" of unix:///path URLs.
        base_url = scheme.split("+")[0] + url[len(parts.scheme) :]
        try:
            proto = redis.ConnectionPool.from_url(
                base_url,
                socket_timeout=opts.timeout_s,
                socket_connect_timeout=opts.connect_timeout_s,
                retry=Retry(NoBackoff(), 0),  # kvtier's deadline and breaker decide, not redis-py retries
                protocol=2,  # the data path speaks RESP2 (kvtier.tiers.resp)
            )
        except (ValueError, TypeError) as exc:
            raise ValueError(f"bad Redis URL {url!r}: {exc}") from None
        self._conn_class = proto.connection_class
        self._conn_kwargs = dict(proto.connection_kwargs)
        self._pools: dict[Addr, _NodePool] = {}
        self._slots: list[Addr] | None = None
        self._slots_stale = True
        self._seeds: list[Addr] = []
        if self.cluster:
            if self._conn_kwargs.get("db", 0) != 0:
                raise ValueError("Redis Cluster has only database 0")
            if not parts.hostname:
                raise ValueError(f"cluster URL {url!r} needs host:port")
            self._seeds.append((parts.hostname, parts.port or 6379))
            for s in opts.seeds:
                host, _, port = s.rpartition(":")
                if not host or not port.isdigit():
                    raise ValueError(f"cluster seed {s!r} is not host:port")
                self._seeds.append((host, int(port)))
            self._topology_breaker = CircuitBreaker(
                opts.breaker_failures, opts.breaker_backoff_s, opts.breaker_max_backoff_s
            )
        #: The URL with any password masked (for logs).
        self.url = url.replace(f":{parts.password}@", ":***@") if parts.password else url

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "RedisTier":
        """Open from a URL; kvtier option query parameters are taken out of it (see module doc)."""
        parts = urlsplit(url)
        rest: list[tuple[str, str]] = []
        for k, v in parse_qsl(parts.query, keep_blank_values=True):
            if k in _FLOAT_OPTS:
                options.setdefault(k, float(v))
            elif k in _INT_OPTS:
                options.setdefault(k, int(v))
            elif k in _STR_OPTS:
                options.setdefault(k, v)
            elif k == "seeds":
                options.setdefault("seeds", tuple(s for s in v.split(",") if s))
            else:
                rest.append((k, v))
        base = url.split("?", 1)[0]
        return cls(base + ("?" + urlencode(rest) if rest else ""), **options)

    # -- plumbing ----------------------------------------------------------------
    def _rkey(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    def _pool(self, addr: Addr) -> _NodePool:
        with self._lock:
            pool = self._pools.get(addr)
            if pool is None:
                kwargs = dict(self._conn_kwargs)
                if addr != _STANDALONE:
                    kwargs["host"], kwargs["port"] = addr
                    kwargs.pop("orig_host_address", None)
                cls = self._conn_class
                pool = self._pools[addr] = _NodePool(lambda: cls(**kwargs), self.options)
            return pool

    def _scratch(self, n: int) -> memoryview:
        buf = getattr(self._tls, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._tls.buf = bytearray(n)
        return memoryview(buf)

    def _refresh_slots(self, deadline: float) -> bool:
        """Load the cluster slot map (CLUSTER SLOTS) from any reachable node."""
        if not self._topology_breaker.allow():
            return False
        with self._lock:
            candidates = list(dict.fromkeys(self._seeds + [a for a in self._pools if a != _STANDALONE]))
        for addr in candidates:
            pool = self._pool(addr)
            conn = None
            try:
                conn = pool.acquire(deadline)
                wire = Wire(conn._sock, deadline)
                wire.send(_packed([[b"CLUSTER", b"SLOTS"]]))
                reply = wire.read_reply()
            except _TRANSPORT_ERRORS as exc:
                log.debug("kvtier redis: CLUSTER SLOTS from %s:%d failed: %s", *addr, exc)
                if conn is not None:
                    pool.release(conn, healthy=False)
                continue
            pool.release(conn, healthy=True)
            if not isinstance(reply, list) or not reply:
                continue
            slots: list[Addr] = [_STANDALONE] * _NUM_SLOTS
            for entry in reply:
                start, end, primary = entry[0], entry[1], entry[2]
                host = primary[0].decode() if primary[0] else addr[0]
                node = (host, int(primary[1]))
                for s in range(int(start), int(end) + 1):
                    slots[s] = node
            with self._lock:
                self._slots = slots
                self._slots_stale = False
                self.topology_refreshes += 1
            self._topology_breaker.success()
            return True
        self._topology_breaker.failure()
        return False

    def _group(self, rkeys: Sequence[bytes], deadline: float) -> dict[Addr, list[int]] | None:
        """Indices of ``rkeys`` per owning node; None if the cluster topology is unknown."""
        if not self.cluster:
            return {_STANDALONE: list(range(len(rkeys)))}
        if self._slots_stale or self._slots is None:
            self._refresh_slots(deadline)
        slots = self._slots
        if slots is None:
            return None
        groups: dict[Addr, list[int]] = {}
        for i, rk in enumerate(rkeys):
            node = slots[key_slot(rk)]
            if node == _STANDALONE:  # slot not served (cluster incomplete)
                return None
            groups.setdefault(node, []).append(i)
        return groups

    def _run(self, batches: Sequence[_Batch], deadline: float) -> None:
        """Send every node's pipeline, then read every node's replies.

        A node whose breaker is open, or that fails, leaves its handlers unrun
        (their results keep the default miss); transport failures feed its breaker.
        """
        live: list[_Batch] = []
        for b in batches:
            pool = self._pool(b.addr)
            if not pool.breaker.allow():
                b.failed = True
                self.counters.add(skipped_calls=1)
                continue
            try:
                b.conn = pool.acquire(deadline)
                b.wire = Wire(b.conn._sock, deadline)
                b.wire.send(_packed(b.commands))
            except Exception as exc:  # transport errors, and any bug: never raise to the engine
                self._node_failed(b, pool, exc)
                continue
            live.append(b)
        for b in live:
            pool = self._pool(b.addr)
            try:
                for handler in b.handlers:
                    handler(b.wire)
            except Exception as exc:  # the stream position is unknown: drop the connection
                self._node_failed(b, pool, exc)
                continue
            pool.release(b.conn, healthy=True)
            pool.breaker.success()

    def _node_failed(self, b: _Batch, pool: _NodePool, exc: BaseException) -> None:
        b.failed = True
        if b.conn is not None:
            pool.release(b.conn, healthy=False)
            b.conn = None
        pool.breaker.failure()
        self.counters.add(errors=1)
        if self.cluster:
            self._slots_stale = True
        if isinstance(exc, _TRANSPORT_ERRORS):
            log.debug("kvtier redis: node %s failed: %r", b.addr, exc)
        else:
            log.error("kvtier redis: unexpected error talking to %s", b.addr, exc_info=exc)

    def _note_error(self, reply: RespError) -> None:
        if reply.is_redirect:
            self._slots_stale = True
            with self._lock:
                self.redirects += 1
        else:
            log.debug("kvtier redis: error reply %s", reply.message)

    def _unavailable(self, n: int) -> bool:
        if self._closed:
            self.counters.add(skipped_calls=1)
            return True
        return n == 0

    # -- operations ----------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        for k in keys:
            check_key(k)
        out = [False] * len(keys)
        if self._unavailable(len(keys)):
            return out
        deadline = time.monotonic() + self.options.timeout_s
        rkeys = [self._rkey(k) for k in keys]
        groups = self._group(rkeys, deadline)
        if groups is not None:
            batches = []
            for addr, idx in groups.items():
                b = _Batch(addr)
                for i in idx:
                    b.commands.append([b"EXISTS", rkeys[i]])
                    b.handlers.append(self._exists_handler(out, i))
                batches.append(b)
            self._run(batches, deadline)
        else:
            self.counters.add(skipped_calls=1)
        self.counters.add(contains_keys=len(keys), contains_hits=sum(out))
        return out

    def _exists_handler(self, out: list[bool], i: int) -> Callable[[Wire], None]:
        def handle(wire: Wire) -> None:
            reply = wire.read_reply()
            if isinstance(reply, RespError):
                self._note_error(reply)
            else:
                out[i] = reply == 1

        return handle

    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        for k, _ in items:
            check_key(k)
        out = [False] * len(items)
        if self._unavailable(len(items)):
            self.counters.add(puts=len(items), put_failed=len(items))
            return out
        deadline = time.monotonic() + self.options.timeout_s
        rkeys = [self._rkey(k) for k, _ in items]
        encoded: list[Any] = []
        for key, payload in items:
            try:
                encoded.append(encode_value(key, payload, self.codec, self.options.spec))
            except ValueError as exc:  # CodecError is a ValueError: bad payload, not a store failure
                log.warning("kvtier redis: chunk %s not stored: %s", key.hex()[:16], exc)
                encoded.append(None)
        groups = self._group(rkeys, deadline)
        written = 0
        if groups is not None:
            batches = []
            for addr, idx in groups.items():
                b = _Batch(addr)
                for i in idx:
                    ev = encoded[i]
                    if ev is None:
                        continue
                    cmd: list[Any] = [b"SET", rkeys[i], ev.parts]
                    if self._ttl_ms is not None:
                        cmd += [b"PX", b"%d" % self._ttl_ms]
                    b.commands.append(cmd)
                    b.handlers.append(self._set_handler(out, i))
                if b.commands:
                    batches.append(b)
            self._run(batches, deadline)
            written = sum(encoded[i].nbytes for i in range(len(items)) if out[i])
        else:
            self.counters.add(skipped_calls=1)
        ok = sum(out)
        self.counters.add(puts=len(items), put_ok=ok, put_failed=len(items) - ok, bytes_written=written)
        return out

    def _set_handler(self, out: list[bool], i: int) -> Callable[[Wire], None]:
        def handle(wire: Wire) -> None:
            reply = wire.read_reply()
            if isinstance(reply, RespError):
                self._note_error(reply)  # e.g. OOM under noeviction: the write is dropped
            else:
                out[i] = reply == b"OK"

        return handle

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        views = []
        for k, buf in items:
            check_key(k)
            views.append(writable_view(buf))
        out = [False] * len(items)
        if self._unavailable(len(items)):
            self.counters.add(gets=len(items), get_misses=len(items))
            return out
        deadline = time.monotonic() + self.options.timeout_s
        rkeys = [self._rkey(k) for k, _ in items]
        groups = self._group(rkeys, deadline)
        stats = {"hits": 0, "absent": 0, "corrupt": 0, "bytes": 0}
        corrupt: list[bytes] = []
        if groups is not None:
            batches = []
            for addr, idx in groups.items():
                b = _Batch(addr)
                for i in idx:
                    b.commands.append([b"GET", rkeys[i]])
                    b.handlers.append(self._get_handler(out, i, items[i][0], views[i], stats, corrupt))
                batches.append(b)
            self._run(batches, deadline)
        else:
            self.counters.add(skipped_calls=1)
        misses = len(items) - stats["hits"]
        self.counters.add(
            gets=len(items),
            get_hits=stats["hits"],
            get_misses=misses - stats["corrupt"],
            get_corrupt=stats["corrupt"],
            bytes_read=stats["bytes"],
        )
        if stats["absent"]:
            log.debug("kvtier redis: %d of %d chunks absent on get", stats["absent"], len(items))
        if corrupt:
            self._delete_rkeys(corrupt, time.monotonic() + self.options.timeout_s)
        return out

    def _get_handler(
        self, out: list[bool], i: int, key: bytes, dst: memoryview, stats: dict, corrupt: list[bytes]
    ) -> Callable[[Wire], None]:
        def handle(wire: Wire) -> None:
            n = wire.read_bulk_len()
            if isinstance(n, RespError):
                self._note_error(n)
                return
            if n < 0:
                stats["absent"] += 1
                return
            try:
                read_value_into(wire.read_exact_into, n, key, dst, self.decoders, self._scratch)
            except ValueMiss as miss:
                wire.skip(n - miss.consumed)
                wire.expect_crlf()
                stats["corrupt"] += 1
                corrupt.append(self._rkey(key))
                log.warning("kvtier redis: chunk %s is a miss: %s", key.hex()[:16], miss.reason)
                return
            wire.expect_crlf()
            out[i] = True
            stats["hits"] += 1
            stats["bytes"] += n

        return handle

    def _delete_rkeys(self, rkeys: Sequence[bytes], deadline: float) -> int:
        groups = self._group(rkeys, deadline)
        if groups is None:
            return 0
        counts = [0] * len(rkeys)
        batches = []
        for addr, idx in groups.items():
            b = _Batch(addr)
            for i in idx:
                b.commands.append([b"UNLINK", rkeys[i]])
                b.handlers.append(self._count_handler(counts, i))
            batches.append(b)
        self._run(batches, deadline)
        return sum(counts)

    def _count_handler(self, counts: list[int], i: int) -> Callable[[Wire], None]:
        def handle(wire: Wire) -> None:
            reply = wire.read_reply()
            if isinstance(reply, RespError):
                self._note_error(reply)
            elif isinstance(reply, int):
                counts[i] = reply

        return handle

    def delete_many(self, keys: Sequence[bytes]) -> int:
        for k in keys:
            check_key(k)
        if self._unavailable(len(keys)):
            return 0
        n = self._delete_rkeys([self._rkey(k) for k in keys], time.monotonic() + self.options.timeout_s)
        self.counters.add(deletes=n)
        return n

    def clear(self) -> int:
        """Remove every key under ``key_prefix`` on every node (SCAN + UNLINK).

        Each round trip has its own ``timeout_s`` deadline; a node that fails
        mid-way keeps its remaining keys (the count says how many went).
        """
        if self._unavailable(1):
            return 0
        if self.cluster:
            if not self._refresh_slots(time.monotonic() + self.options.timeout_s) and self._slots is None:
                return 0
            nodes = sorted(set(self._slots or ()) - {_STANDALONE})
        else:
            nodes = [_STANDALONE]
        pattern = _glob_escape(self._prefix) + b"*"
        removed = 0
        for addr in nodes:
            cursor = b"0"
            while True:
                reply: list[Any] = []
                b = _Batch(addr)
                b.commands.append([b"SCAN", cursor, b"MATCH", pattern, b"COUNT", b"1000"])
                b.handlers.append(lambda wire, r=reply: r.append(wire.read_reply()))
                self._run([b], time.monotonic() + self.options.timeout_s)
                if b.failed or not reply or not isinstance(reply[0], list):
                    break
                cursor, found = reply[0][0], reply[0][1]
                if found:
                    counts = [0] * len(found)
                    d = _Batch(addr)
                    for i, rk in enumerate(found):
                        d.commands.append([b"UNLINK", rk])
                        d.handlers.append(self._count_handler(counts, i))
                    self._run([d], time.monotonic() + self.options.timeout_s)
                    removed += sum(counts)
                if cursor == b"0":
                    break
        self.counters.add(deletes=removed)
        return removed

    def close(self) -> None:
        self._closed = True
        with self._lock:
            pools = list(self._pools.values())
        for pool in pools:
            pool.close()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self.counters.snapshot()
        with self._lock:
            pools = dict(self._pools)
        out["breakers"] = {
            ("standalone" if a == _STANDALONE else f"{a[0]}:{a[1]}"): p.breaker.state for a, p in pools.items()
        }
        out["breaker_trips"] = sum(p.breaker.trips for p in pools.values())
        out["redirects"] = self.redirects
        out["topology_refreshes"] = self.topology_refreshes
        out["codec"] = self.codec.name
        return out


def _packed(commands: Sequence[Sequence[Any]]) -> list[Buffer]:
    packer = CommandPacker()
    for cmd in commands:
        packer.add(cmd)
    return packer.finish()


def _glob_escape(prefix: bytes) -> bytes:
    out = bytearray()
    for ch in prefix:
        if ch in b"*?[]\\":
            out += b"\\"
        out.append(ch)
    return bytes(out)
