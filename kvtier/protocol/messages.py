"""Every message that crosses a kvtier process boundary (protocol version 1).

Transport: a byte stream (Unix socket, or opt-in TCP on loopback) carrying
frames (:mod:`kvtier.protocol.framing`). Chunk payloads never travel here: they
move through the cache service's shared-memory segment; messages carry keys and
slot indices.

Every request body is a map with an envelope and the op's fields::

    {"v": 1, "op": "<name>", "id": <int>, "noreply": <bool, optional>, ...fields}

and every reply a map ``{"v": 1, "id": <request id>, "ok": true, ...fields}``
or ``{"v": 1, "id": <id or -1>, "ok": false, "code": <ErrorCode>, "error": <str>}``.
Requests with ``"noreply": true`` (only the one-way ops in :data:`ONE_WAY_OPS`)
get no reply, even on error, so the stream stays in step.

Chunk keys are 32-byte binaries; a list of keys travels as one binary of
``n * 32`` bytes. Every size is bounded (``MAX_FRAME_BYTES``, ``MAX_KEYS``,
``MAX_NAME_CHARS``); a message outside the bounds, of the wrong type or of an
unknown op raises :class:`ProtocolError` with a ``code`` that the server sends
back before carrying on.

Two endpoints speak it: the cache service (``kvtier server``, every op) and an
engine worker's lookup endpoint (:mod:`kvtier.service.lookup_endpoint`:
``lookup``, ``release`` and ``health`` only, no ``register``).

==================  ===================================================  =====================================
op                  request fields                                       reply fields
==================  ===================================================  =====================================
register            client_id, pid, namespace, namespace_digest,         segment {size, slot_bytes, num_slots,
                    chunk_bytes, token?                                  fd|path}, server_pid, instance, chunk_size
lookup              keys, owner?                                         tiers (1 byte per hit, see tiers.py)
contains            key                                                  hit
release             owner                                                -
reserve             key                                                  slot (nil: skipped), skip (WriteSkip|0)
reserve_many        keys                                                 slots [slot|nil], skips [WriteSkip|0]
commit              key, parent?                                         - (one-way allowed)
abort               key                                                  -
load                key, parent?                                         handle, slot, source (nil: miss)
load_many           keys, parents [bin32|nil per key]                    handles [[handle, slot, source]|nil]
unload              handle                                               - (one-way allowed)
prefetch            keys                                                 queued
flush               timeout_s                                            done
stats               -                                                    stats {name: number}
clear               -                                                    removed {tier: chunks}
health              -                                                    status, uptime_s, clients
cuda_register       handle, size, dtype, device (+ optional IPC refs)    - (always an error: use kv_register)
kv_register         kind, buffers, shape [B,H,N,C], layers               num_layers, num_blocks, page_bytes,
                                                                         device, pinned
store_blocks        keys, blocks [[block id]], parents?                  skips [0|WriteSkip]
load_blocks         keys, parents, blocks [[block id]], offsets          sources [tier|nil]
kv_release          -                                                    released
==================  ===================================================  =====================================

``skip`` values are :class:`kvtier.storage.types.WriteSkip` (1 PRESENT,
2 IN_FLIGHT, 3 NO_ROOM), 0 where a slot was reserved. Request accounting is
not part of the protocol (it is an engine concern, kept by the connector).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from kvtier.index.keys import KEY_BYTES, KeyNamespace
from kvtier.protocol.errors import ErrorCode, ProtocolError
from kvtier.protocol.fields import (
    INT64_MAX,
    get_float,
    get_int,
    get_key,
    get_key_and_parent,
    get_keys,
    get_opt_str,
    get_str,
    join_keys,
    namespace_from_wire,
    namespace_to_wire,
)
from kvtier.protocol.framing import pack

PROTOCOL_VERSION = 2
#: Ops a client may send with ``"noreply": true``.
ONE_WAY_OPS = frozenset({"commit", "unload"})

_BAD = ErrorCode.BAD_MESSAGE


@dataclass(frozen=True)
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
    obj: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": req.OP, "id": req_id}
    if noreply:
        obj["noreply"] = True
    obj.update(req.fields_to_wire())
    return pack(obj)


@dataclass(frozen=True)
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
            raise ProtocolError(_BAD, "namespace_digest must be 32 bytes")
        return cls(
            get_str(o, "client_id"),
            get_int(o, "pid", 0, 1 << 31),
            namespace_from_wire(o.get("namespace")),
            digest,
            get_int(o, "chunk_bytes", 1, 1 << 34),
            get_opt_str(o, "token"),
        )


@dataclass(frozen=True)
class Lookup(Request):
    """Longest cached prefix of ``keys``; leased to ``owner`` when given."""

    OP: ClassVar[str] = "lookup"
    keys: list[bytes]
    owner: str | None = None

    def fields_to_wire(self) -> dict[str, Any]:
        return {"keys": join_keys(self.keys), "owner": self.owner}

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Lookup":
        return cls(get_keys(o, "keys"), get_opt_str(o, "owner"))


@dataclass(frozen=True)
class Prefetch(Request):
    OP: ClassVar[str] = "prefetch"
    keys: list[bytes]

    def fields_to_wire(self) -> dict[str, Any]:
        return {"keys": join_keys(self.keys)}

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Prefetch":
        return cls(get_keys(o, "keys"))


@dataclass(frozen=True)
class Contains(Request):
    OP: ClassVar[str] = "contains"
    key: bytes

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Contains":
        return cls(get_key(o, "key"))


@dataclass(frozen=True)
class ReleaseLease(Request):
    OP: ClassVar[str] = "release"
    owner: str

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "ReleaseLease":
        return cls(get_str(o, "owner"))


@dataclass(frozen=True)
class Reserve(Request):
    OP: ClassVar[str] = "reserve"
    key: bytes

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Reserve":
        return cls(get_key(o, "key"))


@dataclass(frozen=True)
class ReserveMany(Request):
    """Slots for many chunks in one round trip (prompt order); a skip reason where none.

    ``parents`` (optional, one per key): each chunk's chain parent, so making room
    never evicts the parent of a chunk being stored (default: the previous key).
    """

    OP: ClassVar[str] = "reserve_many"
    keys: list[bytes]
    parents: list[bytes | None] | None = None

    def fields_to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"keys": join_keys(self.keys)}
        if self.parents is not None:
            out["parents"] = list(self.parents)
        return out

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "ReserveMany":
        keys = get_keys(o, "keys")
        if len(set(keys)) != len(keys):
            raise ProtocolError(_BAD, "keys must be distinct")
        return cls(keys, None if o.get("parents") is None else _get_parents(o, keys))


@dataclass(frozen=True)
class Commit(Request):
    OP: ClassVar[str] = "commit"
    key: bytes
    parent: bytes | None = None

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Commit":
        return cls(*get_key_and_parent(o))


@dataclass(frozen=True)
class Abort(Request):
    OP: ClassVar[str] = "abort"
    key: bytes

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Abort":
        return cls(get_key(o, "key"))


@dataclass(frozen=True)
class Load(Request):
    OP: ClassVar[str] = "load"
    key: bytes
    parent: bytes | None = None

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Load":
        return cls(*get_key_and_parent(o))


@dataclass(frozen=True)
class LoadMany(Request):
    """Read references on many chunks in one round trip (prompt order).

    ``client_verifies``: the client checks each CPU chunk's commit checksum itself as it
    reads the slot (:mod:`kvtier.service.integrity`); the reply then carries that checksum
    as a fourth element of each handle entry (nil where the client need not check). An
    older server ignores the field, checks the chunks itself and answers three elements.
    """

    OP: ClassVar[str] = "load_many"
    keys: list[bytes]
    parents: list[bytes | None]
    client_verifies: bool = False

    def fields_to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"keys": join_keys(self.keys), "parents": list(self.parents)}
        if self.client_verifies:
            out["client_verifies"] = True
        return out

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "LoadMany":
        keys = get_keys(o, "keys")
        parents = _get_parents(o, keys)
        return cls(keys, parents, o.get("client_verifies") is True)


def _get_parents(o: dict[str, Any], keys: list[bytes]) -> list[bytes | None]:
    """The ``parents`` field: one nil or 32-byte key per key, none equal to its own key."""
    parents = o.get("parents")
    if not isinstance(parents, list) or len(parents) != len(keys):
        raise ProtocolError(_BAD, "parents must be a list with one entry per key")
    for p in parents:
        if p is not None and (not isinstance(p, bytes) or len(p) != KEY_BYTES):
            raise ProtocolError(_BAD, f"each parent must be nil or a {KEY_BYTES}-byte key")
    if any(p == k for k, p in zip(keys, parents)):
        raise ProtocolError(_BAD, "a chunk cannot be its own parent")
    return parents


@dataclass(frozen=True)
class Unload(Request):
    """Drop read reference ``handle``; ``corrupt``: the client found the slot's bytes differ from
    the checksum the load gave it (the server checks again before it drops the chunk)."""

    OP: ClassVar[str] = "unload"
    handle: int
    corrupt: bool = False

    def fields_to_wire(self) -> dict[str, Any]:
        return {"handle": self.handle, **({"corrupt": True} if self.corrupt else {})}

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Unload":
        return cls(get_int(o, "handle"), o.get("corrupt") is True)


@dataclass(frozen=True)
class Flush(Request):
    OP: ClassVar[str] = "flush"
    timeout_s: float = 10.0

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "Flush":
        return cls(get_float(o, "timeout_s", 0.0, 60.0))


@dataclass(frozen=True)
class Stats(Request):
    OP: ClassVar[str] = "stats"


@dataclass(frozen=True)
class Clear(Request):
    OP: ClassVar[str] = "clear"


@dataclass(frozen=True)
class Health(Request):
    OP: ClassVar[str] = "health"


@dataclass(frozen=True)
class CudaRegister(Request):
    """Share an engine's CUDA KV buffer with the server (see :mod:`kvtier.service.cuda_ipc`)."""

    OP: ClassVar[str] = "cuda_register"
    handle: bytes
    size: int
    dtype: str
    device: int
    # The rest of torch's ``UntypedStorage._share_cuda_()`` tuple (optional on the wire, v1 clients omit them):
    offset: int = 0  # bytes from the allocation's start to the storage
    ref_counter_handle: bytes = b""  # torch's shared-memory reference counter (file name)
    ref_counter_offset: int = 0
    event_handle: bytes = b""  # cudaIpcEventHandle_t of the producer's last write ("" if none)
    event_sync_required: bool = False

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "CudaRegister":
        h = o.get("handle")
        if not isinstance(h, bytes) or not 0 < len(h) <= 256:
            raise ProtocolError(_BAD, "handle must be a binary of <= 256 bytes")
        extra: dict[str, Any] = {}
        for name in ("ref_counter_handle", "event_handle"):
            v = o.get(name, b"")
            if not isinstance(v, bytes) or len(v) > 256:
                raise ProtocolError(_BAD, f"{name} must be a binary of <= 256 bytes")
            extra[name] = v
        for name in ("offset", "ref_counter_offset"):
            extra[name] = get_int(o, name) if name in o else 0
        sync = o.get("event_sync_required", False)
        if not isinstance(sync, bool):
            raise ProtocolError(_BAD, "event_sync_required must be a boolean")
        return cls(h, get_int(o, "size", 1), get_str(o, "dtype", max_chars=32), get_int(o, "device", 0, 1024),
                   event_sync_required=sync, **extra)


#: Bounds of a ``kv_register`` request and of the block ids in one block-copy request.
MAX_KV_BUFFERS = 1024
MAX_KV_LAYERS = 1024
MAX_BLOCK_IDS = 1 << 18
#: ``kv_register`` kinds: a CUDA IPC export per buffer, or (tests only) a named CPU shared-memory file.
KV_KINDS = ("cuda", "shm")


@dataclass(frozen=True)
class ShmBuffer:
    """A CPU stand-in for a CUDA IPC export (tests only): ``/dev/shm/<name>``, ``size`` bytes.

    Only tests use it, so that CI drives the server's copies by block id through the
    same code as CUDA; real vLLM CPU engines keep the shared-memory slot copies.
    """

    name: str
    size: int

    def fields_to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size}

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "ShmBuffer":
        return cls(get_str(o, "name", max_chars=128), get_int(o, "size", 1))


@dataclass(frozen=True)
class KVRegister(Request):
    """Share an engine's paged KV with the server so stores and loads can name engine block ids.

    ``buffers``: one :class:`CudaRegister` (``kind="cuda"``) or :class:`ShmBuffer`
    (``kind="shm"``, tests only) per allocation. ``shape``: ``[B, H, N, C]`` of every
    layer (blocks, head slots, tokens per block, content bytes). ``layers``: one
    ``(buffer index, byte offset, stride_B, stride_H, stride_N)`` per layer, in layer
    order (strides in bytes; C is contiguous). Valid for this connection only.
    """

    OP: ClassVar[str] = "kv_register"
    kind: str
    buffers: list[Any]
    shape: tuple[int, int, int, int]
    layers: list[tuple[int, int, int, int, int]]

    def fields_to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "buffers": [b.fields_to_wire() for b in self.buffers],
                "shape": list(self.shape), "layers": [list(x) for x in self.layers]}

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "KVRegister":
        kind = o.get("kind")
        if kind not in KV_KINDS:
            raise ProtocolError(_BAD, f"kind must be one of {list(KV_KINDS)}")
        raw = o.get("buffers")
        if not isinstance(raw, list) or not 0 < len(raw) <= MAX_KV_BUFFERS or not all(isinstance(b, dict) for b in raw):
            raise ProtocolError(_BAD, f"buffers must be a list of 1 to {MAX_KV_BUFFERS} maps")
        parse = CudaRegister.from_fields if kind == "cuda" else ShmBuffer.from_fields
        buffers = [parse(b) for b in raw]
        shape = _int_list(o.get("shape"), 4, "shape", lo=1)
        layers = o.get("layers")
        if not isinstance(layers, list) or not 0 < len(layers) <= MAX_KV_LAYERS:
            raise ProtocolError(_BAD, f"layers must be a list of 1 to {MAX_KV_LAYERS} entries")
        views = [tuple(_int_list(x, 5, "each layer")) for x in layers]
        if any(v[0] >= len(buffers) for v in views):
            raise ProtocolError(_BAD, "a layer names a buffer index outside buffers")
        return cls(kind, buffers, tuple(shape), views)  # type: ignore[arg-type]


def _int_list(v: Any, n: int, what: str, lo: int = 0) -> list[int]:
    if not isinstance(v, list) or len(v) != n or any(type(x) is not int or not lo <= x <= INT64_MAX for x in v):
        raise ProtocolError(_BAD, f"{what} must be a list of {n} integers >= {lo}")
    return v


def _get_block_ids(o: dict[str, Any], n: int) -> list[list[int]]:
    """The ``blocks`` field: one non-empty list of engine block ids per key (bounded in total)."""
    v = o.get("blocks")
    if not isinstance(v, list) or len(v) != n or not all(isinstance(x, list) and x for x in v):
        raise ProtocolError(_BAD, "blocks must hold one non-empty list of block ids per key")
    if sum(len(x) for x in v) > MAX_BLOCK_IDS:
        raise ProtocolError(_BAD, f"at most {MAX_BLOCK_IDS} block ids per request")
    if any(type(b) is not int or not 0 <= b <= INT64_MAX for x in v for b in x):
        raise ProtocolError(_BAD, "block ids must be non-negative integers")
    return v


@dataclass(frozen=True)
class StoreBlocks(Request):
    """Store chunks copied by the server from the engine's blocks (needs ``kv_register`` first).

    ``blocks[i]``: chunk ``i``'s engine block ids (``blocks_per_chunk`` of them, token
    order). The engine's writes to them must be complete (stream synchronized) before
    sending. Reply ``skips``: per key 0 (stored) or a ``WriteSkip``.
    """

    OP: ClassVar[str] = "store_blocks"
    keys: list[bytes]
    blocks: list[list[int]]
    parents: list[bytes | None] | None = None

    def fields_to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"keys": join_keys(self.keys), "blocks": self.blocks}
        if self.parents is not None:
            out["parents"] = list(self.parents)
        return out

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "StoreBlocks":
        keys = get_keys(o, "keys")
        if len(set(keys)) != len(keys):
            raise ProtocolError(_BAD, "keys must be distinct")
        parents = None if o.get("parents") is None else _get_parents(o, keys)
        return cls(keys, _get_block_ids(o, len(keys)), parents)


@dataclass(frozen=True)
class LoadBlocks(Request):
    """Load chunks into the engine's blocks, copied by the server (needs ``kv_register`` first).

    ``blocks[i]`` receive chunk ``i``'s blocks ``offsets[i] ..`` (a partly loaded
    chunk starts past 0). Reply ``sources``: the tier per loaded chunk, nil from the
    first miss on (later chunks are not loaded: a prefix is what the engine can use).
    """

    OP: ClassVar[str] = "load_blocks"
    keys: list[bytes]
    parents: list[bytes | None]
    blocks: list[list[int]]
    offsets: list[int]

    def fields_to_wire(self) -> dict[str, Any]:
        return {"keys": join_keys(self.keys), "parents": list(self.parents), "blocks": self.blocks,
                "offsets": list(self.offsets)}

    @classmethod
    def from_fields(cls, o: dict[str, Any]) -> "LoadBlocks":
        keys = get_keys(o, "keys")
        offsets = o.get("offsets")
        if not isinstance(offsets, list) or len(offsets) != len(keys) or any(
            type(x) is not int or not 0 <= x < 1 << 20 for x in offsets
        ):
            raise ProtocolError(_BAD, "offsets must hold one block offset (>= 0) per key")
        return cls(keys, _get_parents(o, keys), _get_block_ids(o, len(keys)), offsets)


@dataclass(frozen=True)
class KVRelease(Request):
    """Forget this connection's ``kv_register`` (closing the connection does the same)."""

    OP: ClassVar[str] = "kv_release"


REQUESTS: dict[str, type[Request]] = {
    cls.OP: cls
    for cls in (
        Register, Lookup, Prefetch, Contains, ReleaseLease, Reserve, ReserveMany, Commit, Abort, Load, LoadMany,
        Unload, Flush, Stats, Clear, Health, CudaRegister, KVRegister, StoreBlocks, LoadBlocks, KVRelease,
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
    if type(rid) is not int or not 0 <= rid <= INT64_MAX:
        raise ProtocolError(_BAD, "id must be a non-negative integer")
    if obj.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION, f"protocol version must be {PROTOCOL_VERSION}", rid)
    op = obj.get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {str(op)[:40]!r}", rid)
    noreply = obj.get("noreply", False)
    if type(noreply) is not bool or (noreply and op not in ONE_WAY_OPS):
        raise ProtocolError(_BAD, f"noreply is only allowed for {sorted(ONE_WAY_OPS)}", rid)
    try:
        req = cls.from_fields(obj)
    except ProtocolError as exc:
        exc.req_id = rid
        raise
    return Envelope(rid, noreply), req


def ok_reply(req_id: int, **fields_: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": req_id, "ok": True, **fields_}


def error_reply(req_id: int, code: str, message: str) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": req_id, "ok": False, "code": str(code), "error": message[:500]}
