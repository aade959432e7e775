"""Settings of a Redis tier and the URLs that carry them.

:class:`RedisTierOptions` holds a :class:`~kvtier.tiers.redis_tier.RedisTier`'s
settings; :func:`split_query_options` takes the tier's own options out of a URL
query (``?ttl_s=3600&codec=shuffle-zstd``; the rest go to redis-py) and
:func:`parse_target` turns a URL into what the tier connects with (redis-py
connection class and arguments, cluster seeds). Nothing is contacted here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.serde.base import Codec, ValueSpec
from kvtier.tiers.redis_checks import connection_params
from kvtier.tiers.redis_nodes import Addr
from kvtier.urls import mask_url

__all__ = ["TIER_QUERY_OPTIONS", "RedisTarget", "RedisTierOptions", "masked", "parse_target", "split_query_options"]


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


def masked(url: str) -> str:
    """``url`` with its password (``user:PASSWORD@`` or ``?password=``) replaced by ``***`` (for
    logs, errors and the tier's :attr:`location`, which status routes show)."""
    return mask_url(url)


def split_query_options(url: str, options: dict[str, Any]) -> str:
    """Move the tier options of ``url``'s query (and extra ``redis+cluster://h1:p1,h2:p2``
    hosts, as ``seeds``) into ``options`` (explicit ``options`` win); returns the URL
    left for redis-py.

    Raises:
        ValueError: an option value of the wrong type (the message names the option).
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
                    f"Redis URL {masked(url)!r}: option {k}={v!r} is not a{'' if kind is float else 'n'} "
                    f"{kind.__name__}"
                ) from None
        elif k in _STR_OPTS:
            options.setdefault(k, v)
        elif k == "seeds":
            options.setdefault("seeds", tuple(s for s in v.split(",") if s))
        else:
            rest.append((k, v))
    base = url.split("?", 1)[0]
    return base + ("?" + urlencode(rest) if rest else "")


@dataclass(frozen=True)
class RedisTarget:
    """What a Redis tier connects to.

    Attributes:
        cluster: a ``+cluster`` scheme.
        connection_class: redis-py connection class (TCP, TLS or Unix socket).
        connection_kwargs: its keyword arguments (host, port, db, credentials, timeouts).
        seeds: cluster seed nodes, the URL's first (empty for a standalone Redis).
        url: the URL with any password masked (for logs).
    """

    cluster: bool
    connection_class: type
    connection_kwargs: dict[str, Any]
    seeds: list[Addr]
    url: str


def parse_target(url: str, opts: RedisTierOptions, schemes: tuple[str, ...]) -> RedisTarget:
    """Parse a tier URL whose tier options are already taken out (:func:`split_query_options`).

    Raises:
        ValueError: a scheme not in ``schemes``, a bad URL, a query option neither the
            tier nor redis-py knows (the message lists both), a cluster URL with a
            database or without host:port, or a bad seed.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in schemes:
        raise ValueError(f"RedisTier cannot open {url!r}: scheme must be one of {schemes}")
    cluster = scheme.endswith("+cluster")
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
        raise ValueError(f"bad Redis URL {masked(url)!r}: {exc}") from None
    conn_kwargs = dict(proto.connection_kwargs)
    accepted = connection_params(proto.connection_class)
    unknown = sorted({k for k, _ in parse_qsl(parts.query, keep_blank_values=True)} - accepted)
    if unknown:
        raise ValueError(
            f"Redis URL {masked(url)!r}: unknown option {', '.join(unknown)}; kvtier options: "
            f"{', '.join(sorted(TIER_QUERY_OPTIONS))}; redis-py options: {', '.join(sorted(accepted))}"
        )
    seeds: list[Addr] = []
    if cluster:
        if conn_kwargs.get("db", 0) != 0:
            raise ValueError("Redis Cluster has only database 0")
        if not parts.hostname:
            raise ValueError(f"cluster URL {url!r} needs host:port")
        seeds.append((parts.hostname, parts.port or 6379))
        for s in opts.seeds:
            host, _, port = s.rpartition(":")
            if not host or not (port.isascii() and port.isdigit()):
                raise ValueError(f"cluster seed {s!r} is not host:port")
            seeds.append((host, int(port)))
    return RedisTarget(cluster, proto.connection_class, conn_kwargs, seeds, masked(url))
