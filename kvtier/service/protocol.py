"""Wire protocol of the kvtier cache service (control plane only).

Transport: a byte stream (Unix socket, or opt-in TCP on loopback) carrying
frames. A frame is a 4-byte big-endian unsigned body length followed by a
msgpack body (https://github.com/msgpack/msgpack/blob/master/spec.md); never
pickle. Chunk payloads never travel here: they move through the shared-memory
segment (:mod:`kvtier.service.shm`); messages carry keys and slot indices.

Every request body is a map with an envelope and the op's fields::

    {"v": 1, "op": "<name>", "id": <int>, "noreply": <bool, optional>, ...fields}

and every reply a map ``{"v": 1, "id": <request id>, "ok": true, ...fields}``
or ``{"v": 1, "id": <id or -1>, "ok": false, "code": <str>, "error": <str>}``.
Requests with ``"noreply": true`` (only the one-way ops in :data:`ONE_WAY_OPS`)
get no reply, even on error, so the stream stays in step.

Chunk keys are 32-byte binaries; a list of keys travels as one binary of
``n * 32`` bytes. Every size is bounded (:data:`MAX_FRAME_BYTES`,
:data:`MAX_KEYS`, :data:`MAX_NAME_CHARS`); a message outside the bounds, of the
wrong type or of an unknown op raises :class:`ProtocolError` with a ``code``
that the server sends back before carrying on.

Version 1 ops (fields; reply fields):

==================  =====================================================  =================================
op                  request fields                                         reply fields
==================  =====================================================  =================================
register            client_id, pid, namespace, namespace_digest,           segment {size, slot_bytes,
                    chunk_bytes, token?                                    num_slots, fd|path}, server_pid,
                                                                           instance, chunk_size
lookup              keys, owner?                                           tiers (1 byte per hit: c/d/r)
contains            key                                                    hit
release             owner                                                  -
reserve             key                                                    slot (nil: skipped), present
reserve_many        keys                                                   slots [slot|nil per key]
commit              key, parent?                                           - (one-way allowed)
abort               key                                                    -
load                key, parent?                                           handle, slot, source (nil: miss)
load_many           keys, parents [bin32|nil per key]                      handles [[handle, slot, source]|nil]
unload              handle                                                 - (one-way allowed)
prefetch            keys                                                   queued
record_request      request_id, prompt_tokens, engine_hit_tokens,          - (one-way allowed)
                    kvtier_hit_tokens, tiers {tier: tokens}
record_load         request_id, tier, num_tokens                           - (one-way allowed)
record_load_failure -                                                      - (one-way allowed)
get_request         request_id                                             record (nil if unknown)
flush               timeout_s                                              done
stats               -                                                      stats {name: number}
clear               -                                                      removed {tier: chunks}
health              -                                                      status, uptime_s, clients
cuda_register       handle, size, dtype, device (CUDA only, see cuda_ipc)  -
==================  =====================================================  =================================
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import msgpack

from kvtier.index.keys import KEY_BYTES, KeyNamespace, LayoutSignature

PROTOCOL_VERSION = 1
#: Largest frame body either side accepts (bytes); 1 MiB holds 32,000 keys.
MAX_FRAME_BYTES = 1 << 20
#: Keys in one lookup or prefetch (256 tokens each: 4M tokens).
MAX_KEYS = 16_384
#: Longest client id, lease owner, request id or tier name (characters).
MAX_NAME_CHARS = 256
#: Frame header: body length, big-endian uint32.
HEADER = struct.Struct(">I")
#: Ops a client may send with ``"noreply": true``.
ONE_WAY_OPS = frozenset({"commit", "unload", "record_request", "record_load", "record_load_failure"})
#: One-byte tier codes in lookup replies.
TIER_CODES = {"cpu": b"c", "disk": b"d", "remote": b"r"}
TIER_NAMES = {v[0]: k for k, v in TIER_CODES.items()}

_INT64_MAX = (1 << 63) - 1


class ProtocolError(ValueError):
    """A frame or message that breaks the protocol.

    Attributes:
        code: short machine-readable reason sent back in the error reply.
        req_id: the request id if it could be read, else -1.
    """

    def __init__(self, code: str, message: str, req_id: int = -1):
        super().__init__(message)
        self.code = code
        self.req_id = req_id


# -- encoding ------------------------------------------------------------------------
def pack(obj: dict[str, Any]) -> bytes:
    """One frame (header + msgpack body) for ``obj``.

    Raises:
        ProtocolError: the body would exceed :data:`MAX_FRAME_BYTES`.
    """
    body = msgpack.packb(obj, use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError("too_large", f"message of {len(body)} B exceeds {MAX_FRAME_BYTES} B")
    return HEADER.pack(len(body)) + body


def unpack_body(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Decode a frame body with hard limits on every container and string.

    Raises:
        ProtocolError: not msgpack, not a map, extension types, or over a bound.
    """
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_bin_len=MAX_FRAME_BYTES,
            max_str_len=64 * 1024,
            max_array_len=4096,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several types (ValueError, ExtraData, UnicodeDecodeError...)
        raise ProtocolError("bad_msgpack", f"body is not a valid bounded msgpack document: {type(exc).__name__}")
    if not isinstance(obj, dict):
        raise ProtocolError("bad_message", "a message must be a msgpack map")
    return obj


# -- field checks ----------------------------------------------------------------------
def _int(obj: dict, name: str, lo: int = 0, hi: int = _INT64_MAX, default: Any = ...) -> int:
    v = obj.get(name, default)
    if v is ...:
        raise ProtocolError("bad_message", f"missing field {name!r}")
    if type(v) is not int or not lo <= v <= hi:
        raise ProtocolError("bad_message", f"field {name!r} must be an integer in [{lo}, {hi}]")
    return v


def _float(obj: dict, name: str, lo: float, hi: float) -> float:
    v = obj.get(name)
    if type(v) not in (int, float) or not lo <= v <= hi:
        raise ProtocolError("bad_message", f"field {name!r} must be a number in [{lo}, {hi}]")
    return float(v)


def _str(obj: dict, name: str, optional: bool = False, max_chars: int = MAX_NAME_CHARS) -> str | None:
    v = obj.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, str) or not 0 < len(v) <= max_chars:
        raise ProtocolError("bad_message", f"field {name!r} must be a non-empty string of <= {max_chars} chars")
    return v


def _key(obj: dict, name: str, optional: bool = False) -> bytes | None:
    v = obj.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, bytes) or len(v) != KEY_BYTES:
        raise ProtocolError("bad_message", f"field {name!r} must be a {KEY_BYTES}-byte binary key")
    return v


def _keys(obj: dict, name: str) -> list[bytes]:
    v = obj.get(name)
    if not isinstance(v, bytes) or len(v) % KEY_BYTES or len(v) > MAX_KEYS * KEY_BYTES:
        raise ProtocolError(
            "bad_message", f"field {name!r} must be a binary of n*{KEY_BYTES} bytes, n <= {MAX_KEYS}"
        )
    return [v[i : i + KEY_BYTES] for i in range(0, len(v), KEY_BYTES)]


def _key_and_parent(o: dict) -> tuple[bytes, bytes | None]:
    key, parent = _key(o, "key"), _key(o, "parent", optional=True)
    if parent == key:
        # Tiers refuse a chunk that is its own parent (a prefix chain has no cycles).
        raise ProtocolError("bad_message", "a chunk cannot be its own parent")
    return key, parent  # type: ignore[return-value]


def join_keys(keys: list[bytes]) -> bytes:
    """Keys as one binary (the wire form of a key list)."""
    return b"".join(keys)


def namespace_to_wire(ns: KeyNamespace) -> dict[str, Any]:
    return asdict(ns)


def namespace_from_wire(v: Any) -> KeyNamespace:
    """Rebuild a :class:`KeyNamespace` from its wire map.

    Raises:
        ProtocolError: missing/extra fields, wrong types or invalid values.
    """
    if not isinstance(v, dict) or not isinstance(v.get("layout"), dict):
        raise ProtocolError("bad_message", "namespace must be a map with a layout map")
    lay = v["layout"]
    lf = {f.name: f.type for f in fields(LayoutSignature)}
    if set(lay) != set(lf) or set(v) != {"model", "layout", "chunk_size", "world_size", "rank"}:
        raise ProtocolError("bad_message", "namespace or layout has missing or unknown fields")
    try:
        layout = LayoutSignature(
            **{k: (_str(lay, k) if lf[k] == "str" else _int(lay, k, 1, 1 << 20)) for k in lf}
        )
        return KeyNamespace(
            model=_str(v, "model", max_chars=1024),  # type: ignore[arg-type]
            layout=layout,
            chunk_size=_int(v, "chunk_size", 1, 1 << 20),
            world_size=_int(v, "world_size", 1, 1 << 16),
            rank=_int(v, "rank", 0, 1 << 16),
        )
    except ProtocolError:
        raise
    except (TypeError, ValueError) as exc:
        raise ProtocolError("bad_message", f"invalid namespace: {exc}") from None


# -- requests ----------------------------------------------------------------------------
@dataclass
class Request:
    """Base of every request; subclasses set ``OP`` and their fields."""

    OP: ClassVar[str] = ""

    def fields_to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_fields(cls, obj: dict[str, Any]) -> "Request":
        """Build from validated wire fields; requests without fields take none."""
        return cls()


def encode_request(req: Request, req_id: int, noreply: bool = False) -> bytes:
    """One frame for ``req`` with envelope ``id``/``noreply``."""
    obj = {"v": PROTOCOL_VERSION, "op": req.OP, "id": req_id}
    if noreply:
        obj["noreply"] = True
    obj.update(req.fields_to_wire())
    return pack(obj)


@dataclass
class Register(Request):
    OP: ClassVar[str] = "register"
    client_id: str
    pid: int
    namespace: KeyNamespace
    namespace_digest: bytes
    chunk_bytes: int
    token: str | None = None

    def fields_to_wire(self) -> dict[str, Any]:
        d = super().fields_to_wire()
        d["namespace"] = namespace_to_wire(self.namespace)
        return d

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Register":
        digest = o.get("namespace_digest")
        if not isinstance(digest, bytes) or len(digest) != 32:
            raise ProtocolError("bad_message", "namespace_digest must be 32 bytes")
        return cls(
            _str(o, "client_id"),  # type: ignore[arg-type]
            _int(o, "pid", 0, 1 << 31),
            namespace_from_wire(o.get("namespace")),
            digest,
            _int(o, "chunk_bytes", 1, 1 << 34),
            _str(o, "token", optional=True),
        )


@dataclass
class Lookup(Request):
    OP: ClassVar[str] = "lookup"
    keys: list[bytes]
    owner: str | None = None

    def fields_to_wire(self) -> dict[str, Any]:
        return {"keys": join_keys(self.keys), "owner": self.owner}

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Lookup":
        return cls(_keys(o, "keys"), _str(o, "owner", optional=True))


@dataclass
class Prefetch(Request):
    OP: ClassVar[str] = "prefetch"
    keys: list[bytes]

    def fields_to_wire(self) -> dict[str, Any]:
        return {"keys": join_keys(self.keys)}

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Prefetch":
        return cls(_keys(o, "keys"))


@dataclass
class Contains(Request):
    OP: ClassVar[str] = "contains"
    key: bytes

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Contains":
        return cls(_key(o, "key"))  # type: ignore[arg-type]


@dataclass
class ReleaseLease(Request):
    OP: ClassVar[str] = "release"
    owner: str

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "ReleaseLease":
        return cls(_str(o, "owner"))  # type: ignore[arg-type]


@dataclass
class Reserve(Request):
    OP: ClassVar[str] = "reserve"
    key: bytes

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Reserve":
        return cls(_key(o, "key"))  # type: ignore[arg-type]


@dataclass
class ReserveMany(Request):
    """Slots for many chunks in one round trip (prompt order); nil where skipped."""

    OP: ClassVar[str] = "reserve_many"
    keys: list[bytes]

    def fields_to_wire(self) -> dict[str, Any]:
        return {"keys": join_keys(self.keys)}

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "ReserveMany":
        keys = _keys(o, "keys")
        if len(set(keys)) != len(keys):
            raise ProtocolError("bad_message", "keys must be distinct")
        return cls(keys)


@dataclass
class Commit(Request):
    OP: ClassVar[str] = "commit"
    key: bytes
    parent: bytes | None = None

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Commit":
        return cls(*_key_and_parent(o))


@dataclass
class Abort(Request):
    OP: ClassVar[str] = "abort"
    key: bytes

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Abort":
        return cls(_key(o, "key"))  # type: ignore[arg-type]


@dataclass
class Load(Request):
    OP: ClassVar[str] = "load"
    key: bytes
    parent: bytes | None = None

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Load":
        return cls(*_key_and_parent(o))


@dataclass
class LoadMany(Request):
    """Read references on many chunks in one round trip (prompt order)."""

    OP: ClassVar[str] = "load_many"
    keys: list[bytes]
    parents: list[bytes | None]

    def fields_to_wire(self) -> dict[str, Any]:
        return {"keys": join_keys(self.keys), "parents": list(self.parents)}

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "LoadMany":
        keys = _keys(o, "keys")
        parents = o.get("parents")
        if not isinstance(parents, list) or len(parents) != len(keys):
            raise ProtocolError("bad_message", "parents must be a list with one entry per key")
        for p in parents:
            if p is not None and (not isinstance(p, bytes) or len(p) != KEY_BYTES):
                raise ProtocolError("bad_message", f"each parent must be nil or a {KEY_BYTES}-byte key")
        if any(p == k for k, p in zip(keys, parents)):
            raise ProtocolError("bad_message", "a chunk cannot be its own parent")
        return cls(keys, parents)


@dataclass
class Unload(Request):
    OP: ClassVar[str] = "unload"
    handle: int

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Unload":
        return cls(_int(o, "handle"))


@dataclass
class RecordRequest(Request):
    OP: ClassVar[str] = "record_request"
    request_id: str
    prompt_tokens: int
    engine_hit_tokens: int = 0
    kvtier_hit_tokens: int = 0
    tiers: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "RecordRequest":
        tiers = o.get("tiers", {})
        if not isinstance(tiers, dict) or len(tiers) > 8:
            raise ProtocolError("bad_message", "tiers must be a map of at most 8 entries")
        clean = {}
        for k in tiers:
            if not isinstance(k, str) or not 0 < len(k) <= 16:
                raise ProtocolError("bad_message", "tier names must be short strings")
            clean[k] = _int(tiers, k, 0, 1 << 40)
        return cls(
            _str(o, "request_id"),  # type: ignore[arg-type]
            _int(o, "prompt_tokens", 0, 1 << 40),
            _int(o, "engine_hit_tokens", 0, 1 << 40, default=0),
            _int(o, "kvtier_hit_tokens", 0, 1 << 40, default=0),
            clean,
        )


@dataclass
class RecordLoad(Request):
    OP: ClassVar[str] = "record_load"
    request_id: str
    tier: str
    num_tokens: int

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "RecordLoad":
        tier = _str(o, "tier", max_chars=16)
        return cls(_str(o, "request_id"), tier, _int(o, "num_tokens", 0, 1 << 40))  # type: ignore[arg-type]


@dataclass
class RecordLoadFailure(Request):
    OP: ClassVar[str] = "record_load_failure"


@dataclass
class GetRequest(Request):
    OP: ClassVar[str] = "get_request"
    request_id: str

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "GetRequest":
        return cls(_str(o, "request_id"))  # type: ignore[arg-type]


@dataclass
class Flush(Request):
    OP: ClassVar[str] = "flush"
    timeout_s: float = 10.0

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Flush":
        return cls(_float(o, "timeout_s", 0.0, 60.0))


@dataclass
class Stats(Request):
    OP: ClassVar[str] = "stats"


@dataclass
class Clear(Request):
    OP: ClassVar[str] = "clear"


@dataclass
class Health(Request):
    OP: ClassVar[str] = "health"


@dataclass
class CudaRegister(Request):
    """Share an engine's CUDA KV buffer with the server (see :mod:`kvtier.service.cuda_ipc`)."""

    OP: ClassVar[str] = "cuda_register"
    handle: bytes
    size: int
    dtype: str
    device: int

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "CudaRegister":
        h = o.get("handle")
        if not isinstance(h, bytes) or not 0 < len(h) <= 256:
            raise ProtocolError("bad_message", "handle must be a binary of <= 256 bytes")
        return cls(h, _int(o, "size", 1), _str(o, "dtype", max_chars=32), _int(o, "device", 0, 1024))  # type: ignore[arg-type]


REQUESTS: dict[str, type[Request]] = {
    cls.OP: cls
    for cls in (
        Register, Lookup, Prefetch, Contains, ReleaseLease, Reserve, ReserveMany, Commit, Abort, Load, LoadMany, Unload,
        RecordRequest, RecordLoad, RecordLoadFailure, GetRequest, Flush, Stats, Clear, Health, CudaRegister,
    )
}


@dataclass(frozen=True)
class Envelope:
    """The envelope of a request: its id and whether it wants a reply."""

    req_id: int
    noreply: bool


def decode_request(obj: dict[str, Any]) -> tuple[Envelope, Request]:
    """Validate an unpacked request map.

    Raises:
        ProtocolError: wrong version, unknown op, bad envelope or bad fields.
            ``req_id`` is set when the id itself was valid, so the error reply
            can name the request.
    """
    rid = obj.get("id")
    if type(rid) is not int or not 0 <= rid <= _INT64_MAX:
        raise ProtocolError("bad_message", "id must be a non-negative integer")
    if obj.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"protocol version must be {PROTOCOL_VERSION}", rid)
    op = obj.get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError("unknown_op", f"unknown op {str(op)[:40]!r}", rid)
    noreply = obj.get("noreply", False)
    if type(noreply) is not bool or (noreply and op not in ONE_WAY_OPS):
        raise ProtocolError("bad_message", f"noreply is only allowed for {sorted(ONE_WAY_OPS)}", rid)
    try:
        req = cls.from_fields(obj)
    except ProtocolError as exc:
        exc.req_id = rid
        raise
    return Envelope(rid, noreply), req


def ok_reply(req_id: int, **fields_: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": req_id, "ok": True, **fields_}


def error_reply(req_id: int, code: str, message: str) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": req_id, "ok": False, "code": code, "error": message[:500]}
