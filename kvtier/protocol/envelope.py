"""The envelope of every control-plane message: decoding a request with its checks, and replies.

A request's envelope is ``v`` (:data:`~kvtier.protocol.messages.PROTOCOL_VERSION`), ``id``
(a non-negative int64, echoed by the reply), ``op`` (the tag of its struct in
:mod:`kvtier.protocol.messages`) and ``noreply`` (only for the one-way ops). The checks run in
that order: a bad id is ``BAD_MESSAGE`` without an id; then ``BAD_VERSION``, ``UNKNOWN_OP`` and
``BAD_MESSAGE`` (a bad ``noreply`` or field) name the request id, so the error reply can too.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kvtier.protocol.decoding import decode
from kvtier.protocol.errors import ErrorCode, ProtocolError
from kvtier.protocol.fields import INT64_MAX, U64, dec_hook
from kvtier.protocol.messages import ONE_WAY_OPS, PROTOCOL_VERSION, REQUESTS, AnyRequest, Request

_BAD = ErrorCode.BAD_MESSAGE


class Envelope(msgspec.Struct, frozen=True):
    """The envelope of a request: its id and whether it wants a reply."""

    req_id: int
    noreply: bool


class _WireEnvelope(msgspec.Struct, frozen=True):
    """The envelope fields as raw msgpack (each a view of the body, read on its own below); any
    other field is skipped unread, so a body's size costs the decoder nothing beyond the frame."""

    id: msgspec.Raw = msgspec.Raw(b"")
    v: msgspec.Raw = msgspec.Raw(b"")
    op: msgspec.Raw = msgspec.Raw(b"")
    noreply: msgspec.Raw = msgspec.Raw(b"")


class _TypedEnvelope(msgspec.Struct, frozen=True):
    """The envelope of a well-formed request (the fast path: one typed decode, other fields skipped)."""

    id: U64
    v: int
    op: Annotated[str, msgspec.Meta(max_length=64)]
    noreply: bool = False


_TYPED_ENVELOPE_DECODER = msgspec.msgpack.Decoder(_TypedEnvelope)
_ENVELOPE_DECODER = msgspec.msgpack.Decoder(_WireEnvelope)
_REQUEST_DECODER = msgspec.msgpack.Decoder(AnyRequest, dec_hook=dec_hook)
_SKIP_DECODER = msgspec.msgpack.Decoder(msgspec.Raw)  # walks a document without building it
_ID = msgspec.msgpack.Decoder(U64)
_VERSION = msgspec.msgpack.Decoder(int)
_OP = msgspec.msgpack.Decoder(Annotated[str, msgspec.Meta(max_length=64)])
_FLAG = msgspec.msgpack.Decoder(bool)


def _read(decoder: msgspec.msgpack.Decoder[Any], raw: msgspec.Raw) -> Any:
    """One envelope field's value, or ``_INVALID`` (absent, of the wrong type or out of bounds)."""
    if not len(raw):
        return _ABSENT
    if bytes(memoryview(raw)[:1]) in _EXT_MARKERS:
        raise ProtocolError(ErrorCode.BAD_MSGPACK, "an envelope field is a msgpack extension type")
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _INVALID


_ABSENT, _INVALID = object(), object()
#: First bytes of msgpack extension values (fixext 1-16, ext 8/16/32).
_EXT_MARKERS = frozenset(bytes([b]) for b in (0xC7, 0xC8, 0xC9, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8))


def decode_request_body(body: bytes | bytearray | memoryview) -> tuple[Envelope, Request]:
    """Validate a request straight from its frame body (the servers' only path).

    A well-formed request costs two cached msgspec decodes of the body (its typed envelope, then
    its op's struct); a body whose envelope does not decode is read again field by field, from raw
    msgpack, to say what is wrong (checks in the module doc's order). Nothing a field does not hold
    is built: fields a struct lacks are skipped unread (so a newer client's extra fields reach an
    older server harmlessly), and every field it has is bounded by its type.

    Raises:
        ProtocolError: ``BAD_MSGPACK`` (not msgpack), ``BAD_MESSAGE`` (not a map, a bad id: no
            request id then; a bad ``noreply`` or field, naming it), ``BAD_VERSION``,
            ``UNKNOWN_OP``; ``req_id`` is set once the id was read, and ``noreply`` when the
            request asked for no reply (the server then sends none, even for the error).
    """
    try:  # the fast path: a well-formed envelope (the slow one below names what is wrong)
        typed = decode(_TYPED_ENVELOPE_DECODER, body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        typed = None
    if typed is not None and typed.v == PROTOCOL_VERSION and typed.op in REQUESTS and (
            not typed.noreply or typed.op in ONE_WAY_OPS):
        return _with_op(body, typed.op, typed.id, typed.noreply)
    try:
        env = decode(_ENVELOPE_DECODER, body)
    except msgspec.ValidationError:
        # Every envelope field is optional and raw, so a map fails only for a key that is not a string.
        if body[:1] and (0x80 <= body[0] <= 0x8F or body[0] in (0xDE, 0xDF)):
            raise ProtocolError(ErrorCode.BAD_MSGPACK, "body is not a valid msgpack map: a key is not a string") from None
        try:
            decode(_SKIP_DECODER, body)  # a complete document of another type, or not one document at all
        except msgspec.DecodeError as exc:
            raise ProtocolError(ErrorCode.BAD_MSGPACK, f"body is not a valid msgpack document: {exc}") from None
        raise ProtocolError(_BAD, "a message must be a msgpack map") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_MSGPACK, f"body is not a valid msgpack document: {exc}") from None
    rid = _read(_ID, env.id)
    if rid is _ABSENT or rid is _INVALID:
        raise ProtocolError(_BAD, "id must be a non-negative integer")
    try:
        return _after_id(env, rid, body)
    except ProtocolError as exc:
        exc.req_id = rid
        raise


def _after_id(env: _WireEnvelope, rid: int, body: bytes | bytearray | memoryview) -> tuple[Envelope, Request]:
    if _read(_VERSION, env.v) != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION, f"protocol version must be {PROTOCOL_VERSION}", rid)
    op = _read(_OP, env.op)
    if not isinstance(op, str) or op not in REQUESTS:
        shown = repr(op[:40]) if isinstance(op, str) else "of the wrong type or missing"
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {shown}", rid)
    noreply = _read(_FLAG, env.noreply)
    if noreply is _ABSENT:
        noreply = False
    if noreply is _INVALID or (noreply and op not in ONE_WAY_OPS):
        raise ProtocolError(_BAD, f"noreply is only allowed for {sorted(ONE_WAY_OPS)}", rid)
    return _with_op(body, op, rid, noreply)


def _with_op(body: bytes | bytearray | memoryview, op: str, rid: int, noreply: bool) -> tuple[Envelope, Request]:
    """The request of a valid envelope: its op's struct, or ``BAD_MESSAGE`` naming the field (no reply
    is sent for it when the request asked for none)."""
    try:
        req: Request = decode(_REQUEST_DECODER, body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        err = ProtocolError(_BAD, f"bad {op} request: {exc}", rid)
        err.noreply = noreply
        raise err from None
    return Envelope(rid, noreply), req


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
    v = obj.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:
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
