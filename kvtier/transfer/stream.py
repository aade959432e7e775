"""Framed, deadline-bounded I/O over a stream socket: the base of the shared-memory and TCP channels.

Frames are those of :mod:`kvtier.transfer.frames`. Every read and write is bounded
by a :class:`~kvtier.transfer.channel.Deadline`; a socket timeout becomes
:class:`TransferTimeout`, EOF/reset :class:`PeerGone`. After any
:class:`TransferError` the stream may be mid-frame, so the channel closes itself.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from typing import Any, Sequence

import xxhash

from kvtier.transfer.channel import Deadline, TransferChannel
from kvtier.transfer.errors import (
    PeerGone,
    PeerRefused,
    ProtocolError,
    TransferError,
    TransferTimeout,
)
from kvtier.transfer.frames import (
    PREFIX,
    Batch,
    BatchAck,
    Chunk,
    Control,
    Hello,
    Message,
    Proof,
    Refused,
    Segment,
    decode_header,
    decode_prefix,
    encode_frame,
)

#: Bytes discarded per read when dropping a payload nobody asked for.
_DRAIN_BYTES = 1 << 20
_MAX_FDS = 4


class StreamChannel(TransferChannel):
    """A :class:`TransferChannel` over a connected stream socket (TCP or Unix).

    Args:
        sock: connected socket (owned from now on).
        timeout_s: default bound of each call, seconds.
        pass_fds: receive file descriptors with frames (Unix sockets: shared memory).
    """

    def __init__(self, sock: socket.socket, timeout_s: float, pass_fds: bool = False):
        super().__init__(timeout_s)
        self._sock: socket.socket | None = sock
        self._pass_fds = pass_fds
        self._prefix = bytearray(PREFIX.size)
        self._next_batch = 0

    # -- raw I/O ------------------------------------------------------------------
    def _live(self) -> socket.socket:
        if self._sock is None:
            raise PeerGone(f"{self.kind} channel is closed")
        return self._sock

    def _fail(self, exc: BaseException, received: list[bool] | None = None) -> TransferError:
        """Map ``exc`` to a TransferError, count it and close the channel."""
        if isinstance(exc, TransferError):
            err = exc
            if received is not None and err.received is None:
                err.received = received
        elif isinstance(exc, (socket.timeout, TimeoutError)):
            err = TransferTimeout(f"{self.kind} transfer timed out", received)
        elif isinstance(exc, OSError) and exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF):
            err = PeerGone(f"{self.kind} peer gone: {exc.strerror}", received)
        else:
            err = TransferError(f"{self.kind} transfer failed: {exc}", received)
        self.counters.add(errors=1)
        self.close()
        return err

    def _send_views(self, views: Sequence[memoryview | bytes], deadline: Deadline, fds: Sequence[int] = ()) -> None:
        """Write every byte of ``views`` (one ``sendmsg`` each time; no copy of the payloads)."""
        sock = self._live()
        pending = [memoryview(v).cast("B") for v in views if len(v)]
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, _pack_fds(fds))] if fds else []
        while pending:
            sock.settimeout(deadline.remaining())
            sent = sock.sendmsg(pending[:64], anc)
            anc = []
            while sent and pending:
                if sent >= len(pending[0]):
                    sent -= len(pending[0])
                    pending.pop(0)
                else:
                    pending[0] = pending[0][sent:]
                    sent = 0

    def _recv_exact(self, view: memoryview, deadline: Deadline, hasher: xxhash.xxh3_64 | None = None) -> None:
        """Fill ``view`` from the socket; each piece is fed to ``hasher`` (if any) as it lands.

        Raises:
            PeerGone: EOF before ``view`` is full. TransferTimeout: ``deadline`` passed.
        """
        sock = self._live()
        pos, n = 0, len(view)
        while pos < n:
            sock.settimeout(deadline.remaining())
            got = sock.recv_into(view[pos:], n - pos)
            if got == 0:
                raise PeerGone(f"{self.kind} peer closed the connection mid-{'frame' if hasher is None else 'payload'}")
            if hasher is not None:
                hasher.update(view[pos : pos + got])
            pos += got

    def _recv_prefix(self, deadline: Deadline) -> list[int]:
        """Read the next frame prefix into ``self._prefix``; returns fds that came with it."""
        view = memoryview(self._prefix)
        if not self._pass_fds:
            self._recv_exact(view, deadline)
            return []
        sock = self._live()
        sock.settimeout(deadline.remaining())
        data, fds, _flags, _addr = socket.recv_fds(sock, len(view), _MAX_FDS)
        if not data:
            for fd in fds:
                _close_fd(fd)
            raise PeerGone(f"{self.kind} peer closed the connection")
        view[: len(data)] = data
        if len(data) < len(view):
            try:
                self._recv_exact(view[len(data):], deadline)
            except BaseException:
                for fd in fds:
                    _close_fd(fd)
                raise
        return list(fds)

    def _recv_msg(self, deadline: Deadline) -> Message:
        """The next frame's header; :class:`Segment` frames are handed to :meth:`_on_segment`."""
        while True:
            fds = self._recv_prefix(deadline)
            try:
                length = decode_prefix(self._prefix)
                body = bytearray(length)
                self._recv_exact(memoryview(body), deadline)
                msg = decode_header(body)
                if isinstance(msg, Segment):
                    if len(fds) != 1:
                        raise ProtocolError("segment frame without exactly one file descriptor")
                    fd = fds.pop()
                    self._on_segment(msg, fd)
                    continue
                if fds:
                    raise ProtocolError("unexpected file descriptors with a frame")
                if isinstance(msg, Refused):
                    raise PeerRefused(f"the {self.kind} peer refused this instance: {msg.reason[:300]}")
                return msg
            finally:
                for fd in fds:
                    _close_fd(fd)

    def _on_segment(self, msg: Segment, fd: int) -> None:
        _close_fd(fd)
        raise ProtocolError(f"{self.kind} channel does not take shared segments")

    def _recv_payload_into(self, view: memoryview, deadline: Deadline) -> bytes:
        """Read ``len(view)`` payload bytes into ``view``, hashing each piece as it lands; xxh3-64 digest."""
        h = xxhash.xxh3_64()
        self._recv_exact(view, deadline, h)
        return h.digest()

    def _discard(self, n: int, deadline: Deadline) -> None:
        scratch = memoryview(bytearray(min(n, _DRAIN_BYTES)))
        while n > 0:
            m = min(n, len(scratch))
            self._recv_exact(scratch[:m], deadline)
            n -= m

    # -- batch framing (shared by the channels' send / recv_into) ------------------------
    def _begin_batch(self) -> int:
        """The id of the next batch this end sends."""
        batch_id = self._next_batch
        self._next_batch += 1
        return batch_id

    def _recv_batch(self, deadline: Deadline) -> Batch:
        """The next frame, which must open a batch.

        Raises:
            ProtocolError: it is another frame. TransferError: timeout or the peer gone.
        """
        batch = self._recv_msg(deadline)
        if not isinstance(batch, Batch):
            raise ProtocolError(f"expected a batch frame, got {type(batch).__name__}")
        return batch

    def _recv_chunk(self, batch: Batch, expect: int, deadline: Deadline) -> Chunk:
        """The next frame, which must be chunk frame ``expect`` of ``batch``.

        Raises:
            ProtocolError: another frame or chunk index. TransferError: timeout or the peer gone.
        """
        chunk = self._recv_msg(deadline)
        if not isinstance(chunk, Chunk) or chunk.index != expect:
            raise ProtocolError(f"expected chunk frame {expect} of batch {batch.batch_id}, got {chunk!r:.80}")
        return chunk

    def _recv_batch_ack(self, batch_id: int, count: int, deadline: Deadline) -> BatchAck:
        """The next frame, which must be the ack of batch ``batch_id`` (``count`` chunks).

        Raises:
            ProtocolError: another frame, batch or count. TransferError: timeout or the peer gone.
        """
        ack = self._recv_msg(deadline)
        if not isinstance(ack, BatchAck) or ack.batch_id != batch_id or len(ack.received) != count:
            raise ProtocolError(f"expected the ack of batch {batch_id}, got {ack!r:.80}")
        return ack

    # -- shared operations ----------------------------------------------------------
    def handshake(self, timeout_s: float | None = None, auth: Any = None) -> None:
        """Exchange :class:`Hello` frames; with ``auth`` (a :class:`kvtier.transfer.peer_auth.ClientAuth`)
        also prove this end's fleet key and check the server's (:mod:`kvtier.transfer.peer_auth`).

        Without ``auth`` this end takes a server that presents no key; with ``auth`` only an
        authenticated server, except over a Unix socket whose server runs as this user (``shm``
        peers without fleet keys: same-user trust, see :func:`check_same_user`).

        Raises:
            ProtocolError: the peer speaks another channel kind or protocol version.
            PeerRefused: the server refused this end, or is not the fleet member expected.
            TransferError: timeout or the peer gone.
        """
        deadline = self._deadline(timeout_s)
        try:
            mine = Hello(kind=self.kind, key=auth.key, eph=auth.eph) if auth is not None else Hello(kind=self.kind)
            self._send_views([encode_frame(mine)], deadline)
            theirs = self._recv_msg(deadline)
            if not isinstance(theirs, Hello):
                raise ProtocolError(f"expected a hello frame, got {type(theirs).__name__}")
            if theirs.kind != mine.kind or theirs.version != mine.version:
                raise ProtocolError(f"peer speaks {theirs.kind!r} v{theirs.version}, not {mine.kind!r} v{mine.version}")
            if auth is not None and (theirs.key or not self._same_user_server()):
                proof = auth.answer(self.kind, theirs.key, theirs.eph, theirs.mac)
                self._send_views([encode_frame(Proof(mac=proof))], deadline)
        except (OSError, TransferError) as exc:
            raise self._fail(exc) from None

    def _same_user_server(self) -> bool:
        """True over a Unix socket whose other end runs as this user (the only unauthenticated peer an
        authenticating client accepts)."""
        sock = self._sock
        return sock is not None and sock.family == socket.AF_UNIX and peer_uid(sock) == os.geteuid()

    def send_control(self, body: bytes, timeout_s: float | None = None) -> None:
        deadline = self._deadline(timeout_s)
        frame = encode_frame(Control(body=bytes(body)))
        try:
            self._send_views([frame], deadline)
        except (OSError, TransferError) as exc:
            raise self._fail(exc) from None

    def recv_control(self, timeout_s: float | None = None) -> bytes:
        deadline = self._deadline(timeout_s)
        try:
            msg = self._recv_msg(deadline)
            if not isinstance(msg, Control):
                raise ProtocolError(f"expected a control frame, got {type(msg).__name__}")
            return msg.body
        except (OSError, TransferError) as exc:
            raise self._fail(exc) from None

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    @property
    def closed(self) -> bool:
        return self._sock is None


def accept_socket(listener: socket.socket, timeout_s: float, kind: str) -> socket.socket:
    """The next connection on the listening ``listener`` within ``timeout_s`` seconds (blocking mode).

    Raises:
        TransferTimeout: nobody connected in time. TransferError: the accept failed.
    """
    listener.settimeout(timeout_s)
    try:
        sock, _addr = listener.accept()
    except (socket.timeout, TimeoutError):
        raise TransferTimeout(f"no {kind} transfer peer connected in time") from None
    except OSError as exc:
        raise TransferError(f"{kind} accept failed: {exc}") from None
    sock.settimeout(None)
    return sock


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a connected Unix socket (``SO_PEERCRED``), or None
    where the platform does not say."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    return int(struct.unpack("3i", creds)[1])


def check_same_user(sock: socket.socket, what: str) -> None:
    """Refuse a Unix-socket peer running as another user (root excepted): shared-memory peers without
    fleet keys trust the same user only, like ``kvtier server``'s owner-only socket.

    Raises:
        PeerRefused: naming ``what`` and the uid.
    """
    uid = peer_uid(sock)
    if uid is not None and uid not in (os.geteuid(), 0):
        raise PeerRefused(f"{what} runs as uid {uid}, not this user ({os.geteuid()}): refused")


def _pack_fds(fds: Sequence[int]) -> bytes:
    import array

    return array.array("i", fds).tobytes()


def _close_fd(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass
