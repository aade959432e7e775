"""Error codes of the kvtier control plane and the exception that carries them."""

from __future__ import annotations

import enum

from kvtier.errors import BaseProtocolError


class ErrorCode(str, enum.Enum):
    """Machine-readable reasons sent back in an error reply (``"code"``).

    Protocol errors (the request itself is wrong; the stream stays in step unless
    said otherwise):

    - ``BAD_MSGPACK``: the body is not a bounded msgpack document.
    - ``BAD_MESSAGE``: not a map, a missing/ill-typed field, a value out of bounds.
    - ``BAD_VERSION``: the envelope's ``v`` is not :data:`PROTOCOL_VERSION`.
    - ``UNKNOWN_OP``: the op is not part of this protocol version.
    - ``UNSUPPORTED``: a known op this endpoint does not serve.
    - ``TOO_LARGE``: a frame over :data:`MAX_FRAME_BYTES` (the peer hangs up).

    State errors (the request is well formed but not allowed now):

    - ``NOT_REGISTERED``, ``BAD_STATE``, ``AUTH``, ``NAMESPACE_MISMATCH``,
      ``CAPACITY``, ``TOO_MANY_HOLDS``, ``NOT_RESERVED``, ``UNKNOWN_HANDLE``,
      ``CUDA_UNAVAILABLE``, ``BUSY`` (too many clients), ``BAD_NAMESPACE``
      (a registration whose layout cannot be hosted: unknown dtype, geometry or
      chunk bytes that disagree), ``NOT_ALLOWED`` (the server's allow-list or
      per-client namespace cap refuses it), ``EXPIRED`` (a commit after the
      reservation timed out).

    Server faults: ``INTERNAL`` (a bug or a failing tier; the op's lease, if it
    granted one, is released before this reply is sent).

    Client-side only (never on the wire): ``DESYNC``, ``BAD_REPLY``.
    """

    BAD_MSGPACK = "bad_msgpack"
    BAD_MESSAGE = "bad_message"
    BAD_VERSION = "bad_version"
    UNKNOWN_OP = "unknown_op"
    UNSUPPORTED = "unsupported"
    TOO_LARGE = "too_large"
    NOT_REGISTERED = "not_registered"
    BAD_STATE = "bad_state"
    AUTH = "auth"
    NAMESPACE_MISMATCH = "namespace_mismatch"
    CAPACITY = "capacity"
    TOO_MANY_HOLDS = "too_many_holds"
    NOT_RESERVED = "not_reserved"
    UNKNOWN_HANDLE = "unknown_handle"
    CUDA_UNAVAILABLE = "cuda_unavailable"
    BUSY = "busy"
    BAD_NAMESPACE = "bad_namespace"
    NOT_ALLOWED = "not_allowed"
    EXPIRED = "expired"
    INTERNAL = "internal"
    DESYNC = "desync"
    BAD_REPLY = "bad_reply"

    def __str__(self) -> str:
        return self.value


class ProtocolError(BaseProtocolError, ValueError):
    """A frame or message that breaks the protocol (or a refusal received from the peer).

    Attributes:
        code: short machine-readable reason (an :class:`ErrorCode` value, or the
            code string a peer sent).
        req_id: the request id if it could be read, else -1.
        noreply: the request asked for no reply (``"noreply": true``, a one-way op): a server
            sends none for this error either, so the stream stays in step.
    """

    def __init__(self, code: str, message: str, req_id: int = -1):
        super().__init__(message)
        self.code = str(code)
        self.req_id = req_id
        self.noreply = False
