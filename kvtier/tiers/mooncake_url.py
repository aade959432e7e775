"""Settings of a Mooncake Store tier and the ``mooncake://`` URLs that carry them.

``mooncake://HOST:PORT`` names the Mooncake master's RPC address (``mooncake_master
--rpc_port``); tier options ride in the query, e.g.
``mooncake://127.0.0.1:50051?segment_bytes=1GiB&timeout_s=0.5``. Nothing is
contacted here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping
from urllib.parse import parse_qsl, urlsplit

from kvtier.serde.base import Codec, ValueSpec
from kvtier.urls import mask_url

__all__ = ["MooncakeTarget", "MooncakeTierOptions", "TIER_QUERY_OPTIONS", "parse_size", "parse_url"]

#: Metadata mode in which clients exchange transfer-engine metadata directly, so no metadata
#: server runs at all (the master's embedded HTTP one binds 0.0.0.0 whatever it is told).
P2P_HANDSHAKE = "P2PHANDSHAKE"
#: Smallest segment Mooncake mounts (0.3.13.post1 refuses less with -600).
MIN_SEGMENT_BYTES = 16 << 20
#: Longest duration option accepted (seconds): a bound, never "wait forever".
MAX_DURATION_S = 3600.0
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KB|KiB|MB|MiB|GB|GiB|TB|TiB)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1, "kb": 10**3, "kib": 1 << 10, "mb": 10**6, "mib": 1 << 20,
    "gb": 10**9, "gib": 1 << 30, "tb": 10**12, "tib": 1 << 40,
}


def parse_size(value: str | int, name: str) -> int:
    """Bytes of ``value`` (an int, or ``"512MiB"``, ``"1GB"``, ``"4096"``).

    Raises:
        ValueError: not a size (the message names the option ``name``).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ValueError(f"Mooncake tier option {name}={value!r} is not a size (e.g. 512MiB, 1GB, 4096)")
        n = int(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if n < 0:
        raise ValueError(f"Mooncake tier option {name} must be >= 0")
    return n


@dataclass(frozen=True)
class MooncakeTierOptions:
    """Settings of a :class:`~kvtier.tiers.mooncake_tier.MooncakeTier` (seconds, bytes).

    Attributes:
        codec / codec_options / spec: how bodies are encoded (as for the Redis tier).
        namespace: 32-byte namespace digest; part of every Mooncake key, and ``clear``
            removes only its keys.
        key_prefix: prefix of every Mooncake key this tier writes.
        timeout_s: bound on one call (``remote_timeout_s``), every Mooncake call included.
        setup_timeout_s: bound on opening the Mooncake client in the background (its
            ``setup()`` blocks ~90 s against a dead master); calls miss until it is open.
        breaker_failures / breaker_backoff_s / breaker_max_backoff_s: circuit breaker.
        segment_bytes: memory this process contributes to the pool (Mooncake's
            ``global_segment_size``), allocated by Mooncake inside this process; chunks
            stored there vanish when the process exits; 0 or at least 16 MiB. 0: contribute none (another
            process, e.g. a dedicated ``mooncake_client``, holds the pool).
        local_hostname: the address other clients reach this one at (its segment and
            transfer engine); 127.0.0.1 for one machine, the host's address for several.
        metadata: transfer-engine metadata: ``P2PHANDSHAKE`` (no metadata server) or an
            ``http://.../metadata`` / ``etcd://`` URL.
        protocol: transfer protocol; only ``tcp`` (zero-copy from unregistered memory).
        workers: Mooncake calls in flight at once (each on its own thread); a call that
            finds them all busy (a stalled store) is a miss at once.
        parallel: parts a batched put or get is split into, on idle workers; their transfers
            run one after another, so one part's checksums overlap the next part's transfer
            (1: one call per batch). Each part is one more Mooncake call (a master round trip
            and the transfer engine's per-batch cost): on 2 cores, 16 x 5.9 MB
            moved fastest with 1-2 parts and ~20% slower with 4 (``kvtier bench remote``).
        max_value_bytes: largest stored value a get reads (bounds what a store hands back).
        transfer_grace_s: how long a get waits past ``timeout_s`` for a transfer that had
            started (the master answered) to end: Mooncake cannot cancel a transfer into
            the caller's memory, and returning earlier would let it write into a CPU slot
            that has been reused.
        replicas: replicas Mooncake keeps of each chunk.
    """

    codec: str | Codec = "raw"
    codec_options: Mapping[str, Any] = field(default_factory=dict)
    spec: ValueSpec = ValueSpec()
    namespace: bytes = bytes(32)
    key_prefix: str = "kvtier:"
    timeout_s: float = 1.0
    setup_timeout_s: float = 10.0
    breaker_failures: int = 3
    breaker_backoff_s: float = 1.0
    breaker_max_backoff_s: float = 30.0
    segment_bytes: int = 512 << 20
    local_hostname: str = "127.0.0.1"
    metadata: str = P2P_HANDSHAKE
    protocol: str = "tcp"
    workers: int = 8
    parallel: int = 2
    max_value_bytes: int = 256 << 20
    transfer_grace_s: float = 5.0
    replicas: int = 1

    def __post_init__(self) -> None:
        for name in sorted(_FLOAT):  # nan passes every comparison below; inf is no bound at all
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_DURATION_S:
                raise ValueError(f"Mooncake tier option {name}={v!r}: a duration in seconds, 0..{MAX_DURATION_S:.0f}")
        if self.timeout_s <= 0 or self.setup_timeout_s <= 0 or self.transfer_grace_s < 0:
            raise ValueError("timeout_s and setup_timeout_s must be positive, transfer_grace_s >= 0")
        if self.breaker_max_backoff_s < self.breaker_backoff_s:
            raise ValueError("breaker_max_backoff_s must be >= breaker_backoff_s")
        if not isinstance(self.namespace, (bytes, bytearray)) or len(self.namespace) != 32:
            raise ValueError("namespace must be a 32-byte KeyNamespace digest")
        if self.protocol != "tcp":
            raise ValueError(f"Mooncake tier protocol {self.protocol!r}: only tcp is supported")
        if not 1 <= self.workers <= 64 or not 1 <= self.parallel <= 64:
            raise ValueError("workers and parallel must be 1..64")
        if not 1 <= self.replicas <= 8:
            raise ValueError("replicas must be 1..8")
        if self.max_value_bytes < 4096:
            raise ValueError("max_value_bytes must be >= 4096")
        if self.segment_bytes != 0 and self.segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"segment_bytes must be 0 or at least 16 MiB (Mooncake refuses less), "
                             f"got {self.segment_bytes}")
        if not self.local_hostname or any(c in self.local_hostname for c in "/?#@ "):
            raise ValueError(f"local_hostname {self.local_hostname!r} is not a host name or address")
        if not re.fullmatch(r"[A-Za-z0-9_.:-]*", self.key_prefix):
            raise ValueError(f"key_prefix {self.key_prefix!r}: letters, digits and _ . : - only")


_FLOAT = {"timeout_s", "setup_timeout_s", "breaker_backoff_s", "breaker_max_backoff_s", "transfer_grace_s"}
_INT = {"breaker_failures", "workers", "parallel", "replicas"}
_SIZES = {"segment_bytes", "max_value_bytes"}
_STR = {"codec", "key_prefix", "local_hostname", "metadata", "protocol"}
#: Options a ``mooncake://`` URL query may carry.
TIER_QUERY_OPTIONS = frozenset(_FLOAT | _INT | _SIZES | _STR)
assert TIER_QUERY_OPTIONS <= {f.name for f in fields(MooncakeTierOptions)}


@dataclass(frozen=True)
class MooncakeTarget:
    """The master a tier talks to: ``host:port`` of its RPC service, and the URL for logs."""

    master: str
    url: str


def parse_url(url: str, options: dict[str, Any]) -> MooncakeTarget:
    """Take ``url``'s query options into ``options`` (explicit ``options`` win).

    Raises:
        ValueError: another scheme, no ``host:port``, an unknown option (the message lists
            the accepted ones) or a value of the wrong type (the message names the option).
    """
    shown = mask_url(url)  # a metadata URL or a user:password@ may carry a secret
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed "[" of an IPv6 host
        raise ValueError(f"Mooncake URL {shown!r}: {exc}") from None
    if parts.scheme.lower() != "mooncake":
        raise ValueError(f"MooncakeTier cannot open {shown!r}: the scheme must be mooncake://")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"Mooncake URL {shown!r}: the port is not a number in 1-65535") from None
    if not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ValueError(f"Mooncake URL {shown!r} must be mooncake://HOST:PORT (the master's RPC address)")
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        if k in _FLOAT or k in _INT:
            kind = float if k in _FLOAT else int
            try:
                options.setdefault(k, kind(v))
            except ValueError:
                raise ValueError(f"Mooncake URL {shown!r}: option {k}={v!r} is not a{'n' if kind is int else ''} "
                                 f"{kind.__name__}") from None
        elif k in _SIZES:
            options.setdefault(k, parse_size(v, k))
        elif k in _STR:
            options.setdefault(k, v)
        else:
            raise ValueError(
                f"Mooncake URL {shown!r}: unknown option {k!r}; accepted: {', '.join(sorted(TIER_QUERY_OPTIONS))}"
            )
    for k in _SIZES & options.keys():
        options[k] = parse_size(options[k], k)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return MooncakeTarget(master=f"{host}:{port}", url=mask_url(url.split("?", 1)[0]))
