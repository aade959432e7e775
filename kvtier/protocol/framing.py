"""Framing of the control plane: a 4-byte big-endian body length, then a msgpack body.

Bodies are msgpack maps (https://github.com/msgpack/msgpack/blob/master/spec.md), never pickle.
A server reads a request straight into its typed struct
(:func:`kvtier.protocol.envelope.decode_request_body`): every field it has is bounded by its type,
and a field no request has is skipped unread (nothing of it is built, whatever it holds: a newer
client's extra field reaches an older server harmlessly). :func:`unpack_body` decodes the other
bodies (untyped replies, maps in tests) with hard bounds on every container and string.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import msgpack
import msgspec

from kvtier.protocol.errors import ErrorCode, ProtocolError

#: Largest frame body either side accepts (bytes); 1 MiB holds 32,000 keys.
MAX_FRAME_BYTES = 1 << 20
#: Longest array in a message: a per-key list (parents, handles, slots) of ``MAX_KEYS`` keys fits
#: (it was 4096, below ``MAX_KEYS``: a 5,000-key load was undecodable, and the server's error for
#: it, without the request's id, cost the client its connection).
MAX_ARRAY_LEN = 16_384
#: Frame header: body length, big-endian uint32.
HEADER = struct.Struct(">I")
#: Encodes every body (msgspec's msgpack encoder: bytes as bin, str as str; 4x msgpack-python's
#: packb on a 64-handle load reply).
_ENCODER = msgspec.msgpack.Encoder()


def pack(obj: dict[str, Any]) -> bytes:
    """One frame (header + msgpack body) for ``obj``.

    Raises:
        ProtocolError: ``TOO_LARGE`` if the body would exceed :data:`MAX_FRAME_BYTES`.
    """
    body = _ENCODER.encode(obj)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"message of {len(body)} B exceeds {MAX_FRAME_BYTES} B")
    return HEADER.pack(len(body)) + body


def unpack_body(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Decode a frame body with hard limits on every container and string.

    Raises:
        ProtocolError: ``BAD_MSGPACK`` (not msgpack, extension types, over a
            bound) or ``BAD_MESSAGE`` (not a map).
    """
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_bin_len=MAX_FRAME_BYTES,
            max_str_len=64 * 1024,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=512,  # a stats reply has ~100 keys; the frame bound caps the total
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several types (ValueError, ExtraData, UnicodeDecodeError...)
        raise ProtocolError(
            ErrorCode.BAD_MSGPACK, f"body is not a valid bounded msgpack document: {type(exc).__name__}"
        ) from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "a message must be a msgpack map")
    return obj


def time_left(sock: socket.socket, deadline: float | None) -> None:
    """Set ``sock``'s timeout to the seconds left before ``deadline`` (``time.monotonic``; None: no deadline).

    Call it before each ``recv``/``send`` of a message: the deadline then bounds the
    whole message, not each call (a peer dripping one byte at a time cannot outlive it).

    Raises:
        socket.timeout: ``deadline`` has passed.
    """
    if deadline is None:
        sock.settimeout(None)
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("message not complete within its deadline")
    sock.settimeout(left)


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> bool:
    """Fill ``view`` from ``sock``; False on a clean EOF before it is full.

    ``deadline`` (``time.monotonic`` seconds): the whole of ``view`` must arrive by
    then (each ``recv`` gets the time left, :func:`time_left`); None: the socket's
    own timeout applies to each ``recv``.

    Raises:
        OSError: the socket failed; ``socket.timeout`` (``TimeoutError``) when it or
            ``deadline`` timed out.
    """
    got = 0
    n = len(view)
    while got < n:
        if deadline is not None:
            time_left(sock, deadline)
        k = sock.recv_into(view[got:])
        if k == 0:
            return False
        got += k
    return True


def read_reply(sock: socket.socket, buf: bytearray, deadline: float) -> tuple[dict[str, Any], bool]:
    """One reply frame from ``sock`` into ``buf``, finished by ``deadline`` (``time.monotonic``).

    Returns the decoded body and whether the socket's timeout was changed (the
    caller restores it).

    Raises:
        socket.timeout: the reply was not complete by ``deadline``.
        ConnectionResetError: the peer closed the connection.
        ProtocolError: ``TOO_LARGE`` (reply bigger than ``buf``), ``DESYNC``
            (bytes after the reply), or a body that does not decode.
    """
    body, retimed = read_reply_body(sock, buf, deadline)
    return unpack_body(body), retimed


def read_reply_body(sock: socket.socket, buf: bytearray, deadline: float) -> tuple[memoryview, bool]:
    """As :func:`read_reply`, but the body undecoded: a view of ``buf``, valid until ``buf`` is reused.

    Raises:
        socket.timeout, ConnectionResetError: as :func:`read_reply`.
        ProtocolError: ``TOO_LARGE`` or ``DESYNC``, as :func:`read_reply`.
    """
    view = memoryview(buf)
    got = 0
    need = HEADER.size
    body_len = -1
    retimed = False
    while got < need:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionResetError("peer closed the connection")
        got += k
        if body_len < 0 and got >= HEADER.size:
            (body_len,) = HEADER.unpack_from(buf)
            if body_len > len(buf) - HEADER.size:
                raise ProtocolError(ErrorCode.TOO_LARGE, "reply larger than the client's buffer")
            need = HEADER.size + body_len
        if got < need:
            time_left(sock, deadline)
            retimed = True
    if got > need:
        raise ProtocolError(ErrorCode.DESYNC, "unexpected bytes after the reply")
    return view[HEADER.size : need], retimed
