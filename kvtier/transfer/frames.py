"""The wire messages of kvtier's transfer channels (msgspec structs) and their framing.

Every message on a channel's socket is one frame::

    magic   4s  b"KVTX"
    length  I   bytes of the msgpack header that follows (little-endian, <= MAX_HEADER_BYTES)
    header      msgpack of one of the tagged structs below
    payload     (TCP :class:`Chunk` frames only) ``Chunk.nbytes`` bytes

A chunk's integrity is its ``checksum``: the xxh3-64 digest (8 bytes) of the payload,
the checksum kvtier's records already use (:func:`kvtier.serde.record.checksum`).
A frame that does not decode, or whose fields are out of range, raises
:class:`~kvtier.transfer.errors.ProtocolError`: the stream cannot be trusted after it.
"""

from __future__ import annotations

import struct
from typing import Union

import msgspec

from kvtier.protocol.decoding import decode

from kvtier.transfer.errors import ProtocolError

MAGIC = b"KVTX"
PREFIX = struct.Struct("<4sI")
#: Longest header accepted (a malformed length must not make a reader allocate gigabytes).
MAX_HEADER_BYTES = 64 << 10
#: Largest chunk payload accepted from a peer (bytes).
MAX_CHUNK_BYTES = 1 << 30
PROTOCOL_VERSION = 1


class Hello(msgspec.Struct, tag=True, frozen=True):
    """First frame each end sends: which channel kind and protocol version it speaks.

    On an authenticated link (:mod:`kvtier.transfer.peer_auth`) it also carries the sender's static
    public key and a fresh ephemeral public key (32 bytes each, X25519), and, from the server, the
    MAC proving it holds its static secret key; empty otherwise.
    """

    kind: str
    version: int = PROTOCOL_VERSION
    key: bytes = b""
    eph: bytes = b""
    mac: bytes = b""


class Proof(msgspec.Struct, tag=True, frozen=True):
    """(authenticated links) The client's MAC over the handshake transcript: it holds its static key."""

    mac: bytes


class Refused(msgspec.Struct, tag=True, frozen=True):
    """The server will not serve this peer (not a member, a failed proof, too many connections);
    it closes the link after this frame."""

    reason: str


class Segment(msgspec.Struct, tag=True, frozen=True):
    """(shared memory) A segment whose file descriptor travels with this frame (SCM_RIGHTS)."""

    segment_id: int
    nbytes: int
    #: the sender's staging ring (it copies payloads in while this end copies them out):
    #: the receiver verifies those inline rather than on a third thread (2-core machines).
    staging: bool = False


class Batch(msgspec.Struct, tag=True, frozen=True):
    """Start of a batch of ``count`` chunk frames."""

    batch_id: int
    count: int


class Chunk(msgspec.Struct, tag=True, frozen=True):
    """One chunk of a batch: ``nbytes`` payload bytes whose xxh3-64 digest is ``checksum``.

    TCP: the payload follows the frame. Shared memory: it lies at ``offset`` in segment
    ``segment_id`` of the sender (shared earlier with a :class:`Segment` frame).
    """

    index: int
    key: bytes
    nbytes: int
    checksum: bytes
    segment_id: int = -1
    offset: int = -1


class ChunkAck(msgspec.Struct, tag=True, frozen=True):
    """(shared memory) The receiver is done reading chunk ``index`` (``ok``: written and verified)."""

    batch_id: int
    index: int
    ok: bool


class BatchAck(msgspec.Struct, tag=True, frozen=True):
    """(TCP) The receiver's verdict per chunk of batch ``batch_id``, in send order."""

    batch_id: int
    received: list[bool]


class Control(msgspec.Struct, tag=True, frozen=True):
    """A small opaque message of the channel's user (requests of a peer tier, bench commands)."""

    body: bytes


class Metadata(msgspec.Struct, tag=True, frozen=True):
    """(NIXL) The sender's NIXL agent metadata for memory it registered since its last one."""

    body: bytes


Message = Union[Hello, Proof, Refused, Segment, Batch, Chunk, ChunkAck, BatchAck, Control, Metadata]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode_frame(msg: Message) -> bytes:
    """``msg`` as a frame (prefix + header), ready to send."""
    body = _encoder.encode(msg)
    if len(body) > MAX_HEADER_BYTES:
        raise ValueError(f"frame header of {len(body)} bytes exceeds {MAX_HEADER_BYTES}")
    return PREFIX.pack(MAGIC, len(body)) + body


def decode_prefix(prefix: bytes | bytearray | memoryview) -> int:
    """The header length announced by a frame prefix.

    Raises:
        ProtocolError: wrong magic or an out-of-range length.
    """
    length: int
    magic, length = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"malformed frame: bad magic {bytes(magic)!r} (not a kvtier transfer peer?)")
    if not 0 < length <= MAX_HEADER_BYTES:
        raise ProtocolError(f"malformed frame: header length {length} out of range 1..{MAX_HEADER_BYTES}")
    return length


def decode_header(body: bytes | bytearray | memoryview) -> Message:
    """Decode and range-check one frame header.

    Raises:
        ProtocolError: not a known message, or fields out of range (key 1..255 bytes,
            ``0 <= nbytes <= MAX_CHUNK_BYTES``, 8-byte checksum, non-negative counts).
    """
    try:
        msg = decode(_decoder, body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed frame header: {exc}") from None
    if isinstance(msg, Chunk):
        if not 0 < len(msg.key) <= 255:
            raise ProtocolError(f"malformed chunk frame: key of {len(msg.key)} bytes")
        if not 0 <= msg.nbytes <= MAX_CHUNK_BYTES:
            raise ProtocolError(f"malformed chunk frame: nbytes {msg.nbytes} out of range")
        if len(msg.checksum) != 8:
            raise ProtocolError("malformed chunk frame: checksum is not 8 bytes")
        if msg.index < 0:
            raise ProtocolError("malformed chunk frame: negative index")
    elif isinstance(msg, Batch) and not 0 <= msg.count <= 1 << 20:
        raise ProtocolError(f"malformed batch frame: count {msg.count}")
    elif isinstance(msg, Segment) and not 0 < msg.nbytes <= 1 << 40:
        raise ProtocolError(f"malformed segment frame: nbytes {msg.nbytes}")
    return msg
