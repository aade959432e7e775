"""The envelope of every control-plane message: decoding a request with its checks, and replies.

A request's envelope is ``v`` (:data:`~kvtier.protocol.messages.PROTOCOL_VERSION`), ``id``
(a non-negative int64, echoed by the reply), ``op`` (the tag of its struct in
:mod:`kvtier.protocol.messages`) and ``noreply`` (only for the one-way ops). The checks run in
that order: a bad id is ``BAD_MESSAGE`` without an id; then ``BAD_VERSION``, ``UNKNOWN_OP`` and
``BAD_MESSAGE`` (a bad ``noreply`` or field) name the request id, so the error reply can too.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvtier.protocol.decoding import decode
from kvtier.protocol.errors import ErrorCode, ProtocolError
from kvtier.protocol.fields import INT64_MAX, U64, dec_hook
from kvtier.protocol.framing import unpack_body
from kvtier.protocol.messages import ONE_WAY_OPS, PROTOCOL_VERSION, REQUESTS, AnyRequest, Request

_BAD = ErrorCode.BAD_MESSAGE


class Envelope(msgspec.Struct, frozen=True):
    """The envelope of a request: its id and whether it wants a reply."""

    req_id: int
    noreply: bool


class _WireEnvelope(msgspec.Struct, frozen=True):
    """The envelope as the fast path decodes it (any other field is skipped unread)."""

    id: U64
    v: int
    op: str
    noreply: bool = False


_ENVELOPE_DECODER = msgspec.msgpack.Decoder(_WireEnvelope)
_REQUEST_DECODER = msgspec.msgpack.Decoder(AnyRequest, dec_hook=dec_hook)


def decode_request_body(body: bytes | bytearray | memoryview) -> tuple[Envelope, Request]:
    """Validate a request straight from its frame body (the servers' hot path).

    A well-formed request is decoded by two cached msgspec decoders (envelope, then the
    op's struct); anything else goes through :func:`decode_request` on the unpacked map,
    so every invalid body gets the same code and message as there.

    Raises:
        ProtocolError: as :func:`decode_request`, or ``BAD_MSGPACK`` (not a bounded msgpack map).
    """
    try:
        env = decode(_ENVELOPE_DECODER, body)
        if env.v == PROTOCOL_VERSION and (not env.noreply or env.op in ONE_WAY_OPS):
            req: Request = decode(_REQUEST_DECODER, body)
            return Envelope(env.id, env.noreply), req
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    return decode_request(unpack_body(body))


def decode_request(obj: dict[str, Any]) -> tuple[Envelope, Request]:
    """Validate an unpacked request map.

    Raises:
        ProtocolError: wrong version, unknown op, bad envelope or bad fields.
            ``req_id`` is set when the id itself was valid, so the error reply
            can name the request. Field errors are ``BAD_MESSAGE`` naming the
            field (e.g. ``... - at `$.keys```).
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
