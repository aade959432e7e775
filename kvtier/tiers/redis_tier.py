"""Redis tier: chunk payloads in Redis or Redis Cluster, batched and failure-tolerant.

URLs: ``redis://[user:pass@]host:port/db``, ``rediss://`` (TLS), ``unix:///path.sock?db=N``,
``redis+cluster://host:port`` / ``rediss+cluster://`` (Redis Cluster; one seed node,
more via ``seeds=``). Tier options may also be given as query parameters
(``?ttl_s=3600&codec=shuffle-zstd``); other query parameters go to redis-py.

Data model: one string value per chunk under
``<key_prefix><namespace-hex[:16]>:<key.hex()>`` (e.g.
``kvtier:3fa9c0d1e2b4a577:9c41...``), holding the checksummed envelope of
:mod:`kvtier.serde.envelope` whose key field is the first 8 bytes of the
namespace digest followed by the chunk key (so a value copied under another
namespace's name is a miss); optional TTL (``SET .. PX``). ``clear`` removes
only this namespace's keys (``SCAN MATCH <key_prefix><namespace-hex[:16]>:*`` on
every primary), never other models sharing the Redis.

To wipe every kvtier key deliberately (all models), use Redis itself:
``redis-cli --scan --pattern 'kvtier:*' | xargs -r redis-cli unlink`` (each
primary of a cluster), or ``FLUSHDB`` when the database holds nothing else.

Prefix closure under TTLs (``ttl_s``): a chunk must not expire before the chunks
that extend it. ``put_many`` sends a batch tail first and refreshes each written
chunk's parent right after it (``PEXPIRE parent``), so a head gets the later
expiry; ``touch_many`` (the manager calls it for every lookup's hit chain)
refreshes a whole chain tail first in one pipelined batch. **Capacity is Redis's own**: set ``maxmemory`` and ``maxmemory-policy
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
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.serde.base import Buffer, Codec, ValueSpec
from kvtier.serde.envelope import ValueMiss, encode_value, read_value_into
from kvtier.serde.registry import decoders_with, make_codec
from kvtier.tiers.base import ChunkWrite, LowerTier, TierCounters, check_key, writable_view
from kvtier.tiers.redis_checks import connection_params, store_problems
from kvtier.tiers.redis_nodes import Addr, Batch, NodeSettings, RedisNodes, glob_escape
from kvtier.tiers.resp import RespError, Wire

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class RedisTierOptions:
    """Settings of a :class:`RedisTier` (units: seconds, bytes).

    Attributes:
        codec: codec name for writes (``raw``, ``shuffle-zstd``, ``int8``) or instance.
        codec_options: options of the named codec, e.g. ``{"level": 3}``.
        spec: dtype and shape hint of the payloads (for codecs).
        ttl_s: expiry of stored chunks in Redis; None keeps them until Redis evicts.
        key_prefix: prefix of every Redis key this tier writes.
        namespace: key namespace digest (32 bytes,
            :meth:`kvtier.index.keys.KeyNamespace.digest`); part of every Redis key,
            and ``clear`` removes only its keys. Default: 32 zero bytes.
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
    namespace: bytes = bytes(32)
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
        if not isinstance(self.namespace, (bytes, bytearray)) or not 8 <= len(self.namespace) <= 64:
            raise ValueError("namespace must be 8..64 bytes (a KeyNamespace digest)")


_FLOAT_OPTS = {"ttl_s", "timeout_s", "connect_timeout_s", "breaker_backoff_s", "breaker_max_backoff_s"}
_INT_OPTS = {"breaker_failures", "max_idle_connections"}
_STR_OPTS = {"codec", "key_prefix"}
#: Options a URL query may carry for the tier itself (the others go to redis-py).
TIER_QUERY_OPTIONS = frozenset(_FLOAT_OPTS | _INT_OPTS | _STR_OPTS | {"seeds"})


class RedisTier(LowerTier):
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
    kind = "remote"
    schemes = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")

    def __init__(self, url: str, decoders: Mapping[str, Codec] | None = None, **options: Any):
        try:
            self.options = opts = RedisTierOptions(**options)
        except TypeError as exc:
            raise ValueError(f"bad Redis tier option: {exc}") from None
        self.codec = make_codec(opts.codec, **dict(opts.codec_options))
        self.decoders = decoders_with(decoders)
        self.counters = TierCounters()
        ns = bytes(opts.namespace)
        #: Prefix of every Redis key of this tier's namespace (``clear`` scans it).
        self.namespace_prefix = opts.key_prefix.encode() + ns.hex()[:16].encode() + b":"
        self._prefix = self.namespace_prefix
        self._ns_tag = ns[:8]  # carried in each envelope's key field
        self._ttl_ms = None if opts.ttl_s is None else max(1, int(opts.ttl_s * 1000))
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._closed = False
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
            raise ValueError(f"bad Redis URL {self._masked(url)!r}: {exc}") from None
        conn_kwargs = dict(proto.connection_kwargs)
        accepted = connection_params(proto.connection_class)
        unknown = sorted({k for k, _ in parse_qsl(parts.query, keep_blank_values=True)} - accepted)
        if unknown:
            raise ValueError(
                f"Redis URL {self._masked(url)!r}: unknown option {', '.join(unknown)}; kvtier options: "
                f"{', '.join(sorted(TIER_QUERY_OPTIONS))}; redis-py options: {', '.join(sorted(accepted))}"
            )
        seeds: list[Addr] = []
        if self.cluster:
            if conn_kwargs.get("db", 0) != 0:
                raise ValueError("Redis Cluster has only database 0")
            if not parts.hostname:
                raise ValueError(f"cluster URL {url!r} needs host:port")
            seeds.append((parts.hostname, parts.port or 6379))
            for s in opts.seeds:
                host, _, port = s.rpartition(":")
                if not host or not port.isdigit():
                    raise ValueError(f"cluster seed {s!r} is not host:port")
                seeds.append((host, int(port)))
        settings = NodeSettings(
            opts.connect_timeout_s,
            opts.max_idle_connections,
            opts.breaker_failures,
            opts.breaker_backoff_s,
            opts.breaker_max_backoff_s,
        )
        self._probe = (proto.connection_class, conn_kwargs, seeds[0] if seeds else None)
        #: Connections, cluster routing and pipelined round trips.
        self.nodes = RedisNodes((proto.connection_class, conn_kwargs), settings, self.counters, seeds)
        #: The URL with any password masked (for logs).
        self.url = url.replace(f":{parts.password}@", ":***@") if parts.password else url

    def check_store(self) -> list[str]:
        """Problems an operator should fix, found with one ``INFO memory`` within ``timeout_s``
        (see :func:`kvtier.tiers.redis_checks.store_problems`). Never raises for a store failure."""
        cls, kwargs, seed = self._probe
        kw = dict(kwargs, socket_timeout=self.options.timeout_s, socket_connect_timeout=self.options.connect_timeout_s)
        if seed is not None:
            kw["host"], kw["port"] = seed
        return store_problems(lambda: cls(**kw), self.url, has_ttl=self._ttl_ms is not None)

    @staticmethod
    def _masked(url: str) -> str:
        password = urlsplit(url).password
        return url.replace(f":{password}@", ":***@") if password else url

    @classmethod
    def check_url(cls, url: str) -> None:
        """Validate ``url`` and its query options at config time; nothing is contacted.

        Raises:
            ValueError: bad URL, unknown option (the message lists the accepted
                ones) or an option value of the wrong type.
        """
        cls.from_url(url).close()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "RedisTier":
        """Open from a URL; kvtier option query parameters are taken out of it (see module doc).

        Raises:
            ValueError: see the class doc; an option value of the wrong type names the option.
        """
        scheme, _, after = url.partition("://")
        netloc = after.split("/", 1)[0].split("?", 1)[0]
        if scheme.lower().endswith("+cluster") and "," in netloc:  # redis+cluster://h1:p1,h2:p2: more seeds
            cred, at, hosts = netloc.rpartition("@")
            first, *more = [h for h in hosts.split(",") if h]
            options.setdefault("seeds", tuple(more))
            url = f"{scheme}://{cred}{at}{first}{after[len(netloc):]}"
        parts = urlsplit(url)
        rest: list[tuple[str, str]] = []
        for k, v in parse_qsl(parts.query, keep_blank_values=True):
            if k in _FLOAT_OPTS or k in _INT_OPTS:
                kind = float if k in _FLOAT_OPTS else int
                try:
                    options.setdefault(k, kind(v))
                except ValueError:
                    raise ValueError(
                        f"Redis URL {cls._masked(url)!r}: option {k}={v!r} is not a{'' if kind is float else 'n'} "
                        f"{kind.__name__}"
                    ) from None
            elif k in _STR_OPTS:
                options.setdefault(k, v)
            elif k == "seeds":
                options.setdefault("seeds", tuple(s for s in v.split(",") if s))
            else:
                rest.append((k, v))
        base = url.split("?", 1)[0]
        return cls(base + ("?" + urlencode(rest) if rest else ""), **options)

    # -- plumbing ----------------------------------------------------------------
    def redis_key(self, key: bytes) -> bytes:
        """The Redis key that holds chunk ``key`` of this tier's namespace."""
        return self._prefix + key.hex().encode()

    _rkey = redis_key

    def _ekey(self, key: bytes) -> bytes:
        """The key field of ``key``'s envelope: namespace tag + chunk key."""
        return self._ns_tag + key

    def _scratch(self, n: int) -> memoryview:
        buf = getattr(self._tls, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._tls.buf = bytearray(n)
        return memoryview(buf)

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
        groups = self.nodes.group(rkeys, deadline)
        if groups is not None:
            batches = []
            for addr, idx in groups.items():
                b = Batch(addr)
                for i in idx:
                    b.commands.append([b"EXISTS", rkeys[i]])
                    b.handlers.append(self._exists_handler(out, i))
                batches.append(b)
            self.nodes.run(batches, deadline)
        else:
            self.counters.add(skipped_calls=1)
        self.counters.add(contains_keys=len(keys), contains_hits=sum(out))
        return out

    def _exists_handler(self, out: list[bool], i: int) -> Callable[[Wire], None]:
        def handle(wire: Wire) -> None:
            reply = wire.read_reply()
            if isinstance(reply, RespError):
                self.nodes.note_error(reply)
            else:
                out[i] = reply == 1

        return handle

    def put_many(self, items: Sequence[ChunkWrite]) -> list[bool]:
        for item in items:
            if not isinstance(item, ChunkWrite):
                raise TypeError(f"put_many takes ChunkWrite items, got {type(item).__name__}")
            check_key(item.key)
        out = [False] * len(items)
        if self._unavailable(len(items)):
            self.counters.add(puts=len(items), put_failed=len(items))
            return out
        deadline = time.monotonic() + self.options.timeout_s
        encoded: list[Any] = []
        for item in items:
            try:
                encoded.append(encode_value(self._ekey(item.key), item.payload, self.codec, self.options.spec))
            except ValueError as exc:  # CodecError is a ValueError: bad payload, not a store failure
                log.warning("kvtier redis: chunk %s not stored: %s", item.key.hex()[:16], exc)
                encoded.append(None)
        # Tail first, each write followed by a TTL refresh of its parent: a chain's
        # head always expires after its tails (prefix closure under TTLs).
        rkeys: list[bytes] = []
        commands: list[list[Any]] = []
        handlers: list[Callable[[Wire], None]] = []
        px = [b"PX", b"%d" % self._ttl_ms] if self._ttl_ms is not None else []
        for i in reversed(range(len(items))):
            ev = encoded[i]
            if ev is None:
                continue
            rkeys.append(self._rkey(items[i].key))
            commands.append([b"SET", rkeys[-1], ev.parts, *px])
            handlers.append(self._set_handler(out, i))
            parent = items[i].parent
            if self._ttl_ms is not None and parent is not None and len(parent) and len(parent) <= 255:
                rkeys.append(self._rkey(parent))
                commands.append([b"PEXPIRE", rkeys[-1], b"%d" % self._ttl_ms])
                handlers.append(self._ignore_handler)
        groups = self.nodes.group(rkeys, deadline) if rkeys else {}
        written = 0
        if groups is not None:
            self.nodes.run(self._batches(groups, commands, handlers), deadline)
            written = sum(encoded[i].nbytes for i in range(len(items)) if out[i])
        else:
            self.counters.add(skipped_calls=1)
        ok = sum(out)
        self.counters.add(puts=len(items), put_ok=ok, put_failed=len(items) - ok, bytes_written=written)
        return out

    @staticmethod
    def _batches(
        groups: dict[Addr, list[int]], commands: list[list[Any]], handlers: list[Callable[[Wire], None]]
    ) -> list[Batch]:
        batches = []
        for addr, idx in groups.items():
            b = Batch(addr)
            for i in idx:
                b.commands.append(commands[i])
                b.handlers.append(handlers[i])
            batches.append(b)
        return batches

    def _ignore_handler(self, wire: Wire) -> None:
        reply = wire.read_reply()
        if isinstance(reply, RespError):
            self.nodes.note_error(reply)

    @property
    def touch_needed(self) -> bool:
        """True if :meth:`touch_many` does anything (only with ``ttl_s``); the manager skips it otherwise."""
        return self._ttl_ms is not None

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """Refresh the TTL of a prompt's chunks (prompt order), tail first, in one
        pipelined round trip per node. Nothing without ``ttl_s``; never raises for a
        store failure."""
        for k in keys:
            check_key(k)
        if self._ttl_ms is None or self._unavailable(len(keys)):
            return
        deadline = time.monotonic() + self.options.timeout_s
        rkeys = [self._rkey(k) for k in reversed(keys)]
        commands = [[b"PEXPIRE", rk, b"%d" % self._ttl_ms] for rk in rkeys]
        groups = self.nodes.group(rkeys, deadline)
        if groups is None:
            self.counters.add(skipped_calls=1)
            return
        self.nodes.run(self._batches(groups, commands, [self._ignore_handler] * len(commands)), deadline)

    def _set_handler(self, out: list[bool], i: int) -> Callable[[Wire], None]:
        def handle(wire: Wire) -> None:
            reply = wire.read_reply()
            if isinstance(reply, RespError):
                self.nodes.note_error(reply)  # e.g. OOM under noeviction: the write is dropped
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
        groups = self.nodes.group(rkeys, deadline)
        stats = {"hits": 0, "absent": 0, "corrupt": 0, "bytes": 0}
        corrupt: list[bytes] = []
        if groups is not None:
            batches = []
            for addr, idx in groups.items():
                b = Batch(addr)
                for i in idx:
                    b.commands.append([b"GET", rkeys[i]])
                    b.handlers.append(self._get_handler(out, i, items[i][0], views[i], stats, corrupt))
                batches.append(b)
            self.nodes.run(batches, deadline)
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
                self.nodes.note_error(n)
                return
            if n < 0:
                stats["absent"] += 1
                return
            try:
                read_value_into(wire.read_exact_into, n, self._ekey(key), dst, self.decoders, self._scratch)
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
        groups = self.nodes.group(rkeys, deadline)
        if groups is None:
            return 0
        counts = [0] * len(rkeys)
        batches = []
        for addr, idx in groups.items():
            b = Batch(addr)
            for i in idx:
                b.commands.append([b"UNLINK", rkeys[i]])
                b.handlers.append(self._count_handler(counts, i))
            batches.append(b)
        self.nodes.run(batches, deadline)
        return sum(counts)

    def _count_handler(self, counts: list[int], i: int) -> Callable[[Wire], None]:
        def handle(wire: Wire) -> None:
            reply = wire.read_reply()
            if isinstance(reply, RespError):
                self.nodes.note_error(reply)
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
        """Remove every key of this tier's namespace on every primary (SCAN MATCH + UNLINK).

        Other namespaces (other models) sharing the Redis keep theirs; see the
        module doc for wiping everything deliberately.

        Each round trip has its own ``timeout_s`` deadline; a node that fails
        mid-way keeps its remaining keys (the count says how many went).
        """
        if self._unavailable(1):
            return 0
        nodes = self.nodes.primaries(time.monotonic() + self.options.timeout_s)
        pattern = glob_escape(self._prefix) + b"*"
        removed = 0
        for addr in nodes:
            cursor = b"0"
            while True:
                reply: list[Any] = []
                b = Batch(addr)
                b.commands.append([b"SCAN", cursor, b"MATCH", pattern, b"COUNT", b"1000"])
                b.handlers.append(lambda wire, r=reply: r.append(wire.read_reply()))
                self.nodes.run([b], time.monotonic() + self.options.timeout_s)
                if b.failed or not reply or not isinstance(reply[0], list):
                    break
                cursor, found = reply[0][0], reply[0][1]
                if found:
                    counts = [0] * len(found)
                    d = Batch(addr)
                    for i, rk in enumerate(found):
                        d.commands.append([b"UNLINK", rk])
                        d.handlers.append(self._count_handler(counts, i))
                    self.nodes.run([d], time.monotonic() + self.options.timeout_s)
                    removed += sum(counts)
                if cursor == b"0":
                    break
        self.counters.add(deletes=removed)
        return removed

    def close(self) -> None:
        self._closed = True
        self.nodes.close()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self.counters.snapshot()
        out["breakers"] = self.nodes.breaker_states()
        out["breaker_trips"] = self.nodes.breaker_trips()
        out["redirects"] = self.nodes.redirects
        out["topology_refreshes"] = self.nodes.topology_refreshes
        out["codec"] = self.codec.name
        return out
