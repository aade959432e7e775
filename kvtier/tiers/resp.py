"""Just enough of the Redis protocol (RESP2) for the Redis tier's data path.

Why not redis-py's own reader: redis-py (with or without hiredis) materializes
every bulk reply as a Python ``bytes`` object. For a 5.9 MB chunk that is
socket -> 64 KiB parser buffer -> hiredis' internal buffer -> ``bytes`` -> the
caller's slot: three user-space copies, and the hiredis ``Reader`` has no
"read into this buffer" call. Here a GET reply's envelope header is parsed from
a small buffer and the payload is received straight into the destination with
``recv_into`` (zero user-space copies for the raw codec). Writes go out with
``sendmsg`` scatter-gather, so header and payload are never concatenated.

Every socket wait uses the remaining time to the caller's deadline, so one call
is bounded by its timeout as a whole, not per ``recv``.

Spec: https://redis.io/docs/latest/develop/reference/protocol-spec/
"""

from __future__ import annotations

import socket
import ssl
import time
from typing import Sequence

from kvtier.errors import BaseProtocolError
from kvtier.serde.base import Buffer, byte_view

#: Buffers at least this large are sent as their own iovec instead of being copied.
_BIG = 16 * 1024
_IOV_BATCH = 512
_CRLF = b"\r\n"


class RespError:
    """An error reply (``-ERR ...``); a value, not an exception: the connection stays usable."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message

    @property
    def is_redirect(self) -> bool:
        return self.message.startswith(("MOVED ", "ASK "))

    def __repr__(self) -> str:
        return f"RespError({self.message!r})"


class ProtocolError(BaseProtocolError, ConnectionError):
    """The byte stream is not valid RESP; the connection must be dropped."""


def _view(buf: Buffer) -> memoryview:
    mv = byte_view(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


class CommandPacker:
    """Packs commands into a list of buffers; large arguments are referenced, not copied.

    An argument is ``bytes`` or a list of buffers sent back to back as *one*
    bulk string (scatter-gather: envelope header + payload).
    """

    def __init__(self) -> None:
        self.parts: list[Buffer] = []
        self._small = bytearray()

    def add(self, args: Sequence[bytes | list[Buffer]]) -> None:
        # self._small is replaced by each _flush(): never hold it in a local.
        self._small += b"*%d\r\n" % len(args)
        for arg in args:
            pieces = arg if isinstance(arg, list) else [arg]
            views = [_view(p) for p in pieces]
            self._small += b"$%d\r\n" % sum(v.nbytes for v in views)
            for v in views:
                if v.nbytes >= _BIG:
                    self._flush()
                    self.parts.append(v)
                else:
                    self._small += v
            self._small += _CRLF

    def _flush(self) -> None:
        if self._small:
            self.parts.append(bytes(self._small))
            self._small = bytearray()

    def finish(self) -> list[Buffer]:
        self._flush()
        return self.parts


class Wire:
    """Buffered RESP reader/writer over a connected socket, bounded by ``deadline``.

    Args:
        sock: a connected stream socket (TCP, Unix or TLS).
        deadline: ``time.monotonic()`` value after which every wait fails with
            ``socket.timeout``.

    Errors: ``OSError`` (including ``socket.timeout``) and :class:`ProtocolError`
    propagate; after one the connection must be discarded.
    """

    def __init__(self, sock: socket.socket, deadline: float, bufsize: int = 64 * 1024):
        self.sock = sock
        self.deadline = deadline
        self._buf = bytearray(bufsize)
        self._mv = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def _arm(self) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("kvtier: operation deadline passed")
        self.sock.settimeout(remaining)

    # -- writing ---------------------------------------------------------------
    def send(self, parts: Sequence[Buffer]) -> None:
        views = [_view(p) for p in parts]
        if isinstance(self.sock, ssl.SSLSocket):
            for v in views:
                self._arm()
                self.sock.sendall(v)
            return
        i = 0
        while i < len(views):
            self._arm()
            n = self.sock.sendmsg(views[i : i + _IOV_BATCH])
            while n > 0 and i < len(views):
                size = views[i].nbytes
                if n >= size:
                    n -= size
                    i += 1
                else:
                    views[i] = views[i][n:]
                    n = 0
            while i < len(views) and views[i].nbytes == 0:
                i += 1

    # -- reading ---------------------------------------------------------------
    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            # Compact: keep the unread tail at the front.
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
            if n == len(self._buf):
                raise ProtocolError("RESP line longer than the read buffer")
        self._arm()
        got = self.sock.recv_into(self._mv[self._end :])
        if got == 0:
            raise ConnectionError("connection closed by the server")
        self._end += got

    def read_line(self) -> bytes:
        while True:
            i = self._buf.find(_CRLF, self._start, self._end)
            if i >= 0:
                line = bytes(self._buf[self._start : i])
                self._start = i + 2
                return line
            self._fill()

    def read_exact_into(self, out: memoryview) -> None:
        """Fill ``out`` completely; large remainders go straight from the socket into ``out``."""
        n = out.nbytes
        pos = min(n, self._end - self._start)
        if pos:
            out[:pos] = self._mv[self._start : self._start + pos]
            self._start += pos
        while pos < n:
            if n - pos >= _BIG:
                self._arm()
                got = self.sock.recv_into(out[pos:])
                if got == 0:
                    raise ConnectionError("connection closed by the server")
                pos += got
            else:
                self._fill()
                take = min(n - pos, self._end - self._start)
                out[pos : pos + take] = self._mv[self._start : self._start + take]
                self._start += take
                pos += take

    def skip(self, n: int) -> None:
        """Discard ``n`` bytes of the stream."""
        while n > 0:
            if self._start == self._end:
                self._fill()
            take = min(n, self._end - self._start)
            self._start += take
            n -= take

    def expect_crlf(self) -> None:
        tail = bytearray(2)
        self.read_exact_into(memoryview(tail))
        if tail != _CRLF:
            raise ProtocolError("bulk string not terminated by CRLF")

    def read_bulk_len(self) -> int | RespError:
        """Read the first line of a bulk reply: its length, -1 for nil, or the error reply."""
        line = self.read_line()
        kind = line[:1]
        if kind == b"$":
            return int(line[1:])
        if kind == b"-":
            return RespError(line[1:].decode(errors="replace"))
        if kind == b"_":  # RESP3 null
            return -1
        raise ProtocolError(f"expected a bulk reply, got {line[:32]!r}")

    def read_reply(self) -> object:
        """Read one complete reply: bytes (simple/bulk string), int, list, None or RespError."""
        line = self.read_line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            return RespError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = bytearray(n)
            self.read_exact_into(memoryview(data))
            self.expect_crlf()
            return bytes(data)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.read_reply() for _ in range(n)]
        if kind == b"_":
            return None
        raise ProtocolError(f"unexpected RESP reply {line[:32]!r}")
