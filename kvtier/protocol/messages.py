"""Every message that crosses a kvtier process boundary (protocol version 1).

Transport: a byte stream (Unix socket, or opt-in TCP on loopback) carrying
frames (:mod:`kvtier.protocol.framing`). Chunk payloads never travel here: they
move through the cache service's shared-memory segment; messages carry keys and
slot indices.

Every request is a :class:`msgspec.Struct` of a tagged union (tag field ``op``); its body is a
map with an envelope and the op's fields::

    {"v": 1, "op": "<name>", "id": <int>, "noreply": <bool, optional>, ...fields}

and every reply a map ``{"v": 1, "id": <request id>, "ok": true, ...fields}``
or ``{"v": 1, "id": <id or -1>, "ok": false, "code": <ErrorCode>, "error": <str>}``.
Requests with ``"noreply": true`` (only the one-way ops in :data:`ONE_WAY_OPS`)
get no reply, even on error, so the stream stays in step.

Chunk keys are 32-byte binaries; a list of keys travels as one binary of
``n * 32`` bytes. Every size is bounded (``MAX_FRAME_BYTES``, ``MAX_KEYS``,
``MAX_NAME_CHARS``; the field types in :mod:`kvtier.protocol.fields`, cross-field rules in each
request's ``__post_init__``); a message outside the bounds, of the wrong type or of an unknown op
raises :class:`ProtocolError` with a ``code`` that the server sends back before carrying on, its
message naming the field (``... - at `$.keys```). Servers decode a request straight from the frame
body (:func:`kvtier.protocol.envelope.decode_request_body`, cached msgspec decoders); clients
decode the hot replies into the typed structs of :mod:`kvtier.protocol.replies`.

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
flush               timeout_s (0 to 60)                                  done
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

import operator
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union, get_args

import msgspec

from kvtier.index.chains import request_cycle
from kvtier.index.keys import KeyNamespace
from kvtier.protocol.decoding import decode
from kvtier.protocol.errors import ErrorCode, ProtocolError
from kvtier.protocol.fields import (
    MAX_KEYS,
    Key,
    KeyList,
    Name,
    Parents,
    Pos64,
    U64,
    check_namespace,
    dec_hook,
)
from kvtier.protocol.framing import pack

PROTOCOL_VERSION = 2
#: Ops a client may send with ``"noreply": true``.
ONE_WAY_OPS = frozenset({"commit", "unload"})

_BAD = ErrorCode.BAD_MESSAGE


class Request(msgspec.Struct, frozen=True, tag_field="op"):
    """Base of every request; each subclass is tagged with its op (``OP``, the wire's ``op``)."""

    OP: ClassVar[str] = ""
    #: Fields that are key lists (a list of 32-byte keys; on the wire one ``n * 32`` binary).
    KEY_FIELDS: ClassVar[tuple[str, ...]] = ()

    def fields_to_wire(self) -> dict[str, Any]:
        """The op's fields as the wire has them (key lists joined into one binary)."""
        out = msgspec.structs.asdict(self)
        for name in self.KEY_FIELDS:
            out[name] = b"".join(out[name])
        return out

    @classmethod
    def from_fields(cls, obj: dict[str, Any]) -> "Request":
        """This op's request from an unpacked map of its fields (the wire form; envelope keys ignored).

        Raises:
            ProtocolError: ``BAD_MESSAGE`` naming the field that is missing, ill-typed or out of bounds.
        """
        try:
            return decode(_Converter(cls), obj)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ProtocolError(_BAD, f"invalid {cls.OP}: {exc}") from None


def encode_request(req: Request, req_id: int, noreply: bool = False) -> bytes:
    """One frame for ``req`` with envelope ``id``/``noreply``.

    Raises:
        ProtocolError: ``TOO_LARGE`` beyond ``MAX_FRAME_BYTES``.
    """
    obj: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": req.OP, "id": req_id}
    if noreply:
        obj["noreply"] = True
    obj.update(req.fields_to_wire())
    return pack(obj)


def _check_parents(keys: list[bytes], parents: list[bytes | None] | None, required: bool) -> None:
    """One parent per key (each nil or 32 bytes, by type), none equal to its own key, and no
    cycle among the request's own links (:func:`kvtier.index.chains.request_cycle`)."""
    if parents is None:
        if required:
            raise ValueError("field 'parents' must be a list with one entry per key")
        return
    if len(parents) != len(keys):
        raise ValueError("field 'parents' must be a list with one entry per key")
    if any(map(operator.eq, keys, parents)):
        raise ValueError("field 'parents': a chunk cannot be its own parent")
    at = request_cycle(keys, parents)
    if at is not None:
        raise ValueError(f"field 'parents': keys[{at}] is its own ancestor (the parents form a cycle)")


def _check_distinct(keys: list[bytes]) -> None:
    if len(set(keys)) != len(keys):
        raise ValueError("field 'keys' must hold distinct keys")


class Register(Request, frozen=True, tag="register"):
    client_id: Name
    pid: Annotated[int, msgspec.Meta(ge=0, le=1 << 31)]
    namespace: KeyNamespace
    namespace_digest: Key
    chunk_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 34)]
    token: Name | None = None

    def __post_init__(self) -> None:
        check_namespace(self.namespace)


class Lookup(Request, frozen=True, tag="lookup"):
    """Longest cached prefix of ``keys``; leased to ``owner`` when given."""

    KEY_FIELDS: ClassVar[tuple[str, ...]] = ("keys",)
    keys: KeyList
    owner: Name | None = None


class Prefetch(Request, frozen=True, tag="prefetch"):
    KEY_FIELDS: ClassVar[tuple[str, ...]] = ("keys",)
    keys: KeyList


class Contains(Request, frozen=True, tag="contains"):
    key: Key


class ReleaseLease(Request, frozen=True, tag="release"):
    owner: Name


class Reserve(Request, frozen=True, tag="reserve"):
    key: Key


class ReserveMany(Request, frozen=True, tag="reserve_many"):
    """Slots for many distinct chunks in one round trip (prompt order); a skip reason where none.

    ``parents`` (optional, one per key): each chunk's chain parent, so making room
    never evicts the parent of a chunk being stored (default: the previous key).
    """

    KEY_FIELDS: ClassVar[tuple[str, ...]] = ("keys",)
    keys: KeyList
    parents: Parents | None = None

    def __post_init__(self) -> None:
        _check_distinct(self.keys)
        _check_parents(self.keys, self.parents, required=False)


class Commit(Request, frozen=True, tag="commit"):
    key: Key
    parent: Key | None = None

    def __post_init__(self) -> None:
        if self.parent == self.key:  # tiers refuse a chunk that is its own parent (a chain has no cycles)
            raise ValueError("field 'parent': a chunk cannot be its own parent")


class Abort(Request, frozen=True, tag="abort"):
    key: Key


class Load(Request, frozen=True, tag="load"):
    key: Key
    parent: Key | None = None

    def __post_init__(self) -> None:
        if self.parent == self.key:
            raise ValueError("field 'parent': a chunk cannot be its own parent")


class LoadMany(Request, frozen=True, tag="load_many"):
    """Read references on many chunks in one round trip (prompt order).

    ``client_verifies``: the client checks each CPU chunk's commit checksum itself as it
    reads the slot (:mod:`kvtier.service.integrity`); the reply then carries that checksum
    as a fourth element of each handle entry (nil where the client need not check). An
    older server ignores the field, checks the chunks itself and answers three elements.
    """

    KEY_FIELDS: ClassVar[tuple[str, ...]] = ("keys",)
    keys: KeyList
    parents: Parents
    client_verifies: bool = False

    def __post_init__(self) -> None:
        _check_parents(self.keys, self.parents, required=True)


class Unload(Request, frozen=True, tag="unload"):
    """Drop read reference ``handle``; ``corrupt``: the client found the slot's bytes differ from
    the checksum the load gave it (the server checks again before it drops the chunk)."""

    handle: U64
    corrupt: bool = False


class Flush(Request, frozen=True, tag="flush"):
    """Wait up to ``timeout_s`` seconds (0 to 60) for the write-behind."""

    timeout_s: Annotated[float, msgspec.Meta(ge=0.0, le=60.0)]


class Stats(Request, frozen=True, tag="stats"):
    pass


class Clear(Request, frozen=True, tag="clear"):
    pass


class Health(Request, frozen=True, tag="health"):
    pass


_Blob256 = Annotated[bytes, msgspec.Meta(max_length=256)]


class CudaRegister(Request, frozen=True, tag="cuda_register"):
    """Share an engine's CUDA KV buffer with the server (see :mod:`kvtier.service.cuda_ipc`).

    Also the form of each ``kind="cuda"`` buffer of a :class:`KVRegister` (without the ``op``).
    """

    handle: Annotated[bytes, msgspec.Meta(min_length=1, max_length=256)]
    size: Pos64
    dtype: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
    device: Annotated[int, msgspec.Meta(ge=0, le=1024)]
    # The rest of torch's ``UntypedStorage._share_cuda_()`` tuple (optional on the wire, v1 clients omit them):
    offset: U64 = 0  # bytes from the allocation's start to the storage
    ref_counter_handle: _Blob256 = b""  # torch's shared-memory reference counter (file name)
    ref_counter_offset: U64 = 0
    event_handle: _Blob256 = b""  # cudaIpcEventHandle_t of the producer's last write ("" if none)
    event_sync_required: bool = False


#: Bounds of a ``kv_register`` request and of the block ids in one block-copy request.
MAX_KV_BUFFERS = 1024
MAX_KV_LAYERS = 1024
MAX_BLOCK_IDS = 1 << 18
#: ``kv_register`` kinds: a CUDA IPC export per buffer, or (tests only) a named CPU shared-memory file.
KV_KINDS = ("cuda", "shm")


class ShmBuffer(msgspec.Struct, frozen=True):
    """A CPU stand-in for a CUDA IPC export (tests only): ``/dev/shm/<name>``, ``size`` bytes.

    Only tests use it, so that CI drives the server's copies by block id through the
    same code as CUDA; real vLLM CPU engines keep the shared-memory slot copies.
    """

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    size: Pos64

    def fields_to_wire(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


_BUFFER_TYPES: dict[str, type[CudaRegister] | type[ShmBuffer]] = {"cuda": CudaRegister, "shm": ShmBuffer}
_BUFFER_DECODERS: dict[str, msgspec.msgpack.Decoder[Any]] = {k: msgspec.msgpack.Decoder(t) for k, t in _BUFFER_TYPES.items()}


# ``kv_register`` buffers arrive as raw msgpack (one view of the frame each, nothing decoded) and are
# read as their kind's struct in ``__post_init__``: a body cannot make the decoder build what no
# field holds (1 MiB of nested empty arrays in ``buffers`` was ~65 MB of Python lists as ``list[Any]``).
# Type checkers see the decoded form.
if TYPE_CHECKING:
    _BufferList = list[Any]
else:
    _BufferList = Annotated[list[msgspec.Raw], msgspec.Meta(min_length=1, max_length=MAX_KV_BUFFERS)]


class KVRegister(Request, frozen=True, tag="kv_register"):
    """Share an engine's paged KV with the server so stores and loads can name engine block ids.

    ``buffers``: one :class:`CudaRegister` (``kind="cuda"``) or :class:`ShmBuffer`
    (``kind="shm"``, tests only) per allocation, 1 to ``MAX_KV_BUFFERS`` (maps on the wire).
    ``shape``: ``[B, H, N, C]`` of every layer (blocks, head slots, tokens per block, content
    bytes; each >= 1). ``layers``: one ``(buffer index, byte offset, stride_B, stride_H,
    stride_N)`` per layer, in layer order, 1 to ``MAX_KV_LAYERS`` (strides in bytes; C is
    contiguous). Valid for this connection only.
    """

    kind: Literal["cuda", "shm"]
    buffers: _BufferList
    shape: tuple[Pos64, Pos64, Pos64, Pos64]
    layers: Annotated[list[tuple[U64, U64, U64, U64, U64]], msgspec.Meta(min_length=1, max_length=MAX_KV_LAYERS)]

    def __post_init__(self) -> None:
        want = _BUFFER_TYPES.get(self.kind)
        if want is None:  # decoding checks the Literal; a request built here may still name another kind
            raise ValueError(f"field 'kind' must be one of {list(KV_KINDS)}")
        if not all(type(b) is want for b in self.buffers):  # decoded: each buffer's bytes, read as its kind's type
            out = []
            for i, b in enumerate(self.buffers):
                if type(b) is want:
                    out.append(b)
                    continue
                if not isinstance(b, msgspec.Raw):
                    raise ValueError(f"field 'buffers[{i}]' must be a map ({self.kind} buffer)")
                try:
                    out.append(decode(_BUFFER_DECODERS[self.kind], b))
                except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                    raise ValueError(f"field 'buffers[{i}]': {exc}") from None
            msgspec.structs.force_setattr(self, "buffers", out)
        if any(v[0] >= len(self.buffers) for v in self.layers):
            raise ValueError("field 'layers': a layer names a buffer index outside buffers")

    @classmethod
    def from_fields(cls, obj: dict[str, Any]) -> "Request":
        """As :meth:`Request.from_fields`; each buffer map is taken as the raw msgpack the body path sees."""
        raw = obj.get("buffers")
        if isinstance(raw, list):
            obj = {**obj, "buffers": [msgspec.Raw(msgspec.msgpack.encode(b)) for b in raw]}
        return super().from_fields(obj)

    def fields_to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "buffers": [msgspec.structs.asdict(b) for b in self.buffers],
                "shape": list(self.shape), "layers": [list(x) for x in self.layers]}


#: The ``blocks`` field: one non-empty list of engine block ids per key.
_Blocks = Annotated[
    list[Annotated[list[U64], msgspec.Meta(min_length=1, max_length=MAX_BLOCK_IDS)]],
    msgspec.Meta(max_length=MAX_KEYS),
]


def _check_blocks(blocks: list[list[int]], n: int) -> None:
    if len(blocks) != n:
        raise ValueError("field 'blocks' must hold one non-empty list of block ids per key")
    if sum(map(len, blocks)) > MAX_BLOCK_IDS:
        raise ValueError(f"field 'blocks': at most {MAX_BLOCK_IDS} block ids per request")


class StoreBlocks(Request, frozen=True, tag="store_blocks"):
    """Store chunks copied by the server from the engine's blocks (needs ``kv_register`` first).

    ``keys`` distinct; ``blocks[i]``: chunk ``i``'s engine block ids (``blocks_per_chunk`` of
    them, token order; at most ``MAX_BLOCK_IDS`` in all). The engine's writes to them must be
    complete (stream synchronized) before sending. Reply ``skips``: per key 0 (stored) or a
    ``WriteSkip``.
    """

    KEY_FIELDS: ClassVar[tuple[str, ...]] = ("keys",)
    keys: KeyList
    blocks: _Blocks
    parents: Parents | None = None

    def __post_init__(self) -> None:
        _check_distinct(self.keys)
        _check_parents(self.keys, self.parents, required=False)
        _check_blocks(self.blocks, len(self.keys))


class LoadBlocks(Request, frozen=True, tag="load_blocks"):
    """Load chunks into the engine's blocks, copied by the server (needs ``kv_register`` first).

    ``blocks[i]`` receive chunk ``i``'s blocks ``offsets[i] ..`` (a partly loaded
    chunk starts past 0; each offset below 2**20). Reply ``sources``: the tier per loaded
    chunk, nil from the first miss on (later chunks are not loaded: a prefix is what the
    engine can use).
    """

    KEY_FIELDS: ClassVar[tuple[str, ...]] = ("keys",)
    keys: KeyList
    parents: Parents
    blocks: _Blocks
    offsets: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 20)]], msgspec.Meta(max_length=MAX_KEYS)]

    def __post_init__(self) -> None:
        _check_parents(self.keys, self.parents, required=True)
        _check_blocks(self.blocks, len(self.keys))
        if len(self.offsets) != len(self.keys):
            raise ValueError("field 'offsets' must hold one block offset (>= 0) per key")


class KVRelease(Request, frozen=True, tag="kv_release"):
    """Forget this connection's ``kv_register`` (closing the connection does the same)."""


AnyRequest = Union[
    Register, Lookup, Prefetch, Contains, ReleaseLease, Reserve, ReserveMany, Commit, Abort, Load, LoadMany,
    Unload, Flush, Stats, Clear, Health, CudaRegister, KVRegister, StoreBlocks, LoadBlocks, KVRelease,
]

REQUESTS: dict[str, type[Request]] = {}
for _cls in get_args(AnyRequest):
    _cls.OP = _cls.__struct_config__.tag
    REQUESTS[_cls.OP] = _cls


class _Converter:
    """``msgspec.convert`` into one request type, in the shape :func:`decode` takes."""

    def __init__(self, cls: type[Request]):
        self.cls = cls

    def decode(self, obj: Any, /) -> Request:
        return msgspec.convert(obj, self.cls, dec_hook=dec_hook)
