"""Typed replies of the cache service's hot ops, decoded by the client straight from the frame body.

Every reply is a map ``{"v", "id", "ok", ...}`` (:func:`kvtier.protocol.envelope.ok_reply` /
``error_reply``); the structs here read it with one cached msgspec decoder per op. An error
reply (``ok`` false) decodes into the same struct with ``code``/``error`` set and the op's
fields at their defaults (None), so one decode serves both. A reply that does not fit its
struct (a field of the wrong type, a malformed handle entry) raises
``ProtocolError(BAD_REPLY)``: the client drops that connection, and the server then releases
whatever the unreadable reply granted.

=============  ==========================  ===========================================================
op             struct                      fields (None where absent or on an error reply)
=============  ==========================  ===========================================================
register       :class:`RegisterReply`      segment :class:`Segment`, server_pid
lookup         :class:`LookupReply`        tiers (1 byte per hit, see tiers.py)
reserve_many   :class:`ReserveManyReply`   slots [slot|nil], skips [WriteSkip|0]
load_many      :class:`LoadManyReply`      handles [:class:`HandleEntry`|nil]
store_blocks   :class:`StoreBlocksReply`   skips [0|WriteSkip]
load_blocks    :class:`LoadBlocksReply`    sources [tier|nil]
=============  ==========================  ===========================================================

The other ops' replies stay maps (:func:`kvtier.protocol.framing.unpack_body`).
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from kvtier.protocol.decoding import decode
from kvtier.protocol.errors import ErrorCode, ProtocolError
from kvtier.protocol.fields import U64


class Reply(msgspec.Struct, frozen=True):
    """The envelope of every reply: the request's ``id``, ``ok``, and on an error its ``code`` and ``error``."""

    id: int
    ok: bool
    code: str = ""
    error: str = ""


class Segment(msgspec.Struct, frozen=True):
    """The server's shared-memory pool: ``size`` bytes, ``num_slots`` slots of ``slot_bytes`` (the
    client checks they are positive and fit); ``path`` when it is not passed as a file descriptor."""

    size: int
    slot_bytes: int
    num_slots: int
    path: str | None = None


class RegisterReply(Reply, frozen=True):
    segment: Segment | None = None
    server_pid: int | None = None


class LookupReply(Reply, frozen=True):
    tiers: bytes | None = None


class ReserveManyReply(Reply, frozen=True):
    slots: list[int | None] | None = None
    skips: list[int] | None = None


class HandleEntry(msgspec.Struct, frozen=True, array_like=True):
    """One loaded chunk: ``[handle, slot, source]``, plus its commit ``checksum`` (or nil) when the
    client verifies (``LoadMany.client_verifies``)."""

    handle: U64
    slot: int
    source: str
    checksum: int | None = None


class LoadManyReply(Reply, frozen=True):
    handles: list[HandleEntry | None] | None = None


class StoreBlocksReply(Reply, frozen=True):
    skips: list[int] | None = None


class LoadBlocksReply(Reply, frozen=True):
    sources: list[str | None] | None = None


R = TypeVar("R", bound=Reply)


def decode_reply(decoder: "msgspec.msgpack.Decoder[R]", body: bytes | bytearray | memoryview) -> R:
    """Decode one reply body with ``decoder`` (a ``msgspec.msgpack.Decoder`` of one reply struct,
    built once by its user: building one costs more than a decode).

    Raises:
        ProtocolError: ``BAD_REPLY`` naming the field that does not fit (``... - at `$.slots[3]```).
    """
    try:
        return decode(decoder, body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(ErrorCode.BAD_REPLY, f"malformed reply: {exc}") from None


__all__ = [
    "HandleEntry", "LoadBlocksReply", "LoadManyReply", "LookupReply", "RegisterReply", "Reply",
    "ReserveManyReply", "Segment", "StoreBlocksReply", "decode_reply",
]
