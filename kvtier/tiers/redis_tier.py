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
refreshes a whole chain tail first in one pipelined batch. **Capacity is Redis's
own**: set ``maxmemory`` and ``maxmemory-policy
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
from typing import Any, Iterator, Mapping, Sequence

from kvtier.serde.base import Buffer, Codec
from kvtier.serde.registry import decoders_with, make_codec
from kvtier.tiers.base import ChunkWrite, LowerTier, TierCounters, check_key, destination_views
from kvtier.tiers.redis_checks import store_problems
from kvtier.tiers.redis_nodes import NodeSettings, RedisNodes
from kvtier.tiers.redis_pipeline import GetTally, Handler, count_into, exists_known_into, ignore_reply, pipeline, value_into
from kvtier.tiers.redis_scan import scan_pages, unlink_on
from kvtier.tiers.redis_url import TIER_QUERY_OPTIONS, RedisTierOptions, parse_target, split_query_options
from kvtier.tiers.redis_writes import encode_writes, write_commands

log = logging.getLogger(__name__)

__all__ = ["TIER_QUERY_OPTIONS", "RedisTier", "RedisTierOptions"]


class RedisTier(LowerTier):
    """Chunk payloads in Redis (standalone or cluster). See the module doc for semantics.

    URL and option parsing live in :mod:`kvtier.tiers.redis_url`, connections and
    routing in :mod:`kvtier.tiers.redis_nodes`, command batching and reply handlers
    in :mod:`kvtier.tiers.redis_pipeline`, namespace listing in :mod:`kvtier.tiers.redis_scan`.

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
        self._key_prefix = opts.key_prefix
        self._prefix = self.namespace_prefix
        self._ns_tag = ns[:8]  # carried in each envelope's key field
        self._ttl_ms = None if opts.ttl_s is None else max(1, int(opts.ttl_s * 1000))
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._closed = False
        target = parse_target(url, opts, self.schemes)
        self.cluster = target.cluster
        settings = NodeSettings(
            opts.connect_timeout_s,
            opts.max_idle_connections,
            opts.breaker_failures,
            opts.breaker_backoff_s,
            opts.breaker_max_backoff_s,
        )
        conn = (target.connection_class, target.connection_kwargs)
        self._probe = (*conn, target.seeds[0] if target.seeds else None)
        #: Connections, cluster routing and pipelined round trips.
        self.nodes = RedisNodes(conn, settings, self.counters, target.seeds)
        #: The URL with any password masked (for logs).
        self.url = target.url


    @property
    def location(self) -> str:
        """The masked URL and key prefix (tiers with both equal share chunks)."""
        return f"{self.url}#{self._key_prefix}"
    def check_store(self) -> list[str]:
        """Problems an operator should fix, found with one ``INFO memory`` within ``timeout_s``
        (see :func:`kvtier.tiers.redis_checks.store_problems`). Never raises for a store failure."""
        cls, kwargs, seed = self._probe
        kw = dict(kwargs, socket_timeout=self.options.timeout_s, socket_connect_timeout=self.options.connect_timeout_s)
        if seed is not None:
            kw["host"], kw["port"] = seed
        return store_problems(lambda: cls(**kw), self.url, has_ttl=self._ttl_ms is not None)

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
        url = split_query_options(url, options)
        return cls(url, **options)

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

    def _run(
        self, rkeys: Sequence[bytes], commands: list[list[Any]], handlers: Sequence[Handler], deadline: float
    ) -> bool:
        """:func:`~kvtier.tiers.redis_pipeline.pipeline` on this tier's nodes."""
        return pipeline(self.nodes, rkeys, commands, handlers, deadline)

    def _deadline(self) -> float:
        return time.monotonic() + self.options.timeout_s

    # -- operations ----------------------------------------------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self.contains_many_known(keys)[0]

    def contains_many_known(self, keys: Sequence[bytes]) -> tuple[list[bool], list[bool]]:
        """``EXISTS`` per key in one pipelined round trip per node; ``answered[i]`` is True
        where the node replied (a key on a node that timed out or is down is unanswered)."""
        for k in keys:
            check_key(k)
        out = [False] * len(keys)
        answered = [False] * len(keys)
        if self._unavailable(len(keys)):
            return out, answered
        rkeys = [self._rkey(k) for k in keys]
        commands = [[b"EXISTS", rk] for rk in rkeys]
        handlers = [exists_known_into(self.nodes, out, answered, i) for i in range(len(keys))]
        if not self._run(rkeys, commands, handlers, self._deadline()):
            self.counters.add(skipped_calls=1)
        self.counters.add(contains_keys=len(keys), contains_hits=sum(out))
        return out, answered

    def put_many(self, items: Sequence[ChunkWrite]) -> list[bool]:
        return self._put_many(items, self.codec)

    def put_many_with_codec(self, items: Sequence[ChunkWrite], codec: Codec) -> list[bool]:
        """:meth:`put_many` with ``codec`` instead of the tier's codec (the envelope names it)."""
        return self._put_many(items, codec)

    def _put_many(self, items: Sequence[ChunkWrite], codec: Codec) -> list[bool]:
        for item in items:
            if not isinstance(item, ChunkWrite):
                raise TypeError(f"put_many takes ChunkWrite items, got {type(item).__name__}")
            check_key(item.key)
        out = [False] * len(items)
        if self._unavailable(len(items)):
            self.counters.add(puts=len(items), put_failed=len(items))
            return out
        deadline = self._deadline()
        encoded = encode_writes(items, codec, self.options.spec, self._ekey)
        rkeys, commands, handlers = write_commands(self.nodes, items, encoded, self._rkey, self._ttl_ms, out)
        written = 0
        if self._run(rkeys, commands, handlers, deadline):
            written = sum(ev.nbytes for ev, ok in zip(encoded, out) if ok and ev is not None)
        else:
            self.counters.add(skipped_calls=1)
        ok = sum(out)
        self.counters.add(puts=len(items), put_ok=ok, put_failed=len(items) - ok, bytes_written=written)
        return out

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
        rkeys = [self._rkey(k) for k in reversed(keys)]
        commands = [[b"PEXPIRE", rk, b"%d" % self._ttl_ms] for rk in rkeys]
        if not self._run(rkeys, commands, [ignore_reply(self.nodes)] * len(commands), self._deadline()):
            self.counters.add(skipped_calls=1)

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        views = destination_views(items)
        out = [False] * len(items)
        if self._unavailable(len(items)):
            self.counters.add(gets=len(items), get_misses=len(items))
            return out
        rkeys = [self._rkey(k) for k, _ in items]
        tally = GetTally()
        commands = [[b"GET", rk] for rk in rkeys]
        handlers = [
            value_into(self.nodes, out, i, k, rkeys[i], self._ekey(k), views[i], self.decoders, self._scratch, tally)
            for i, (k, _) in enumerate(items)
        ]
        if not self._run(rkeys, commands, handlers, self._deadline()):
            self.counters.add(skipped_calls=1)
        misses = len(items) - tally.hits
        self.counters.add(
            gets=len(items),
            get_hits=tally.hits,
            get_misses=misses - tally.corrupt,
            get_corrupt=tally.corrupt,
            bytes_read=tally.bytes,
        )
        if tally.absent:
            log.debug("kvtier redis: %d of %d chunks absent on get", tally.absent, len(items))
        if tally.corrupt_rkeys:
            self._delete_rkeys(tally.corrupt_rkeys, self._deadline())
        return out

    def _delete_rkeys(self, rkeys: Sequence[bytes], deadline: float) -> int:
        counts = [0] * len(rkeys)
        commands = [[b"UNLINK", rk] for rk in rkeys]
        self._run(rkeys, commands, [count_into(self.nodes, counts, i) for i in range(len(rkeys))], deadline)
        return sum(counts)

    def delete_many(self, keys: Sequence[bytes]) -> int:
        for k in keys:
            check_key(k)
        if self._unavailable(len(keys)):
            return 0
        n = self._delete_rkeys([self._rkey(k) for k in keys], self._deadline())
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
        removed = 0
        for addr, found in scan_pages(self.nodes, self._prefix, self.options.timeout_s):
            if found:
                removed += unlink_on(self.nodes, addr, found, self.options.timeout_s)
        self.counters.add(deletes=removed)
        return removed

    def scan_keys(self) -> Iterator[tuple[bytes, bytes | None]]:
        """``(key, None)`` of every chunk of this namespace (``SCAN MATCH`` on every primary;
        parents are not stored in Redis). A node that fails mid-way yields what it gave."""
        if self._unavailable(1):
            return
        plen = len(self._prefix)
        for _, found in scan_pages(self.nodes, self._prefix, self.options.timeout_s):
            for rk in found:
                try:
                    yield bytes.fromhex(bytes(rk[plen:]).decode("ascii")), None
                except ValueError:
                    continue  # not a chunk key of this tier

    def stored_sizes(self, keys: Sequence[bytes]) -> list[int]:
        """Stored value bytes (envelope included) of each key (``STRLEN``, one pipelined round
        trip per node); 0 where absent or on failure."""
        for k in keys:
            check_key(k)
        out = [0] * len(keys)
        if self._unavailable(len(keys)):
            return out
        rkeys = [self._rkey(k) for k in keys]
        commands = [[b"STRLEN", rk] for rk in rkeys]
        self._run(rkeys, commands, [count_into(self.nodes, out, i) for i in range(len(keys))], self._deadline())
        return out

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
