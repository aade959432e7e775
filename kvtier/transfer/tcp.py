"""The TCP transfer channel (across machines): zero-copy sends, ``recv_into`` destination slots.

A batch on the wire is one :class:`~kvtier.transfer.frames.Batch` frame, then per chunk a
:class:`~kvtier.transfer.frames.Chunk` frame immediately followed by its payload; the
receiver answers with one :class:`~kvtier.transfer.frames.BatchAck`. The sender hands
the caller's payload buffers to ``sendmsg`` as they are (no copy in Python); the receiver
reads each payload straight into the caller's destination with ``recv_into``, hashing
(xxh3-64) each piece as it lands, and compares with the frame's checksum. Payloads for
keys not asked for, or of another size than their destination, are read into a scratch
buffer and dropped.

Connection: :class:`TcpListener` accepts, :meth:`TcpChannel.connect` dials; both ends
exchange a :class:`~kvtier.transfer.frames.Hello` first.
"""

from __future__ import annotations

import socket
from typing import Sequence

from kvtier.transfer.channel import (
    DEFAULT_TIMEOUT_S,
    Deadline,
    InSlot,
    OutChunk,
    check_in_slots,
    check_out_chunks,
    payload_digest,
)
from kvtier.transfer.errors import TransferError
from kvtier.transfer.frames import Batch, BatchAck, Chunk, encode_frame
from kvtier.transfer.stream import StreamChannel, accept_socket

#: ``socket.socket``, for annotations in classes whose ``socket`` property shadows the module.
_Socket = socket.socket


def tune_tcp(sock: socket.socket) -> None:
    """Set TCP_NODELAY on ``sock``: acks and control frames go out at once."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def dial_tcp(host: str, port: int, timeout_s: float, kind: str) -> socket.socket:
    """A TCP connection to ``host:port`` (the control link of a ``kind`` channel).

    Raises:
        TransferError: cannot connect within ``timeout_s`` seconds.
    """
    try:
        return socket.create_connection((host, port), timeout=timeout_s)
    except (OSError, UnicodeError) as exc:  # UnicodeError: a name the IDNA codec refuses (an empty or long label)
        raise TransferError(f"cannot connect to {kind} transfer peer {host}:{port}: {exc}") from None


class TcpChannel(StreamChannel):
    """One end of a TCP transfer link (see the module docstring).

    Args:
        sock: a connected TCP socket (owned from now on); use :meth:`connect` or :class:`TcpListener`.
        timeout_s: default bound of each call, seconds.
    """

    kind = "tcp"

    def __init__(self, sock: socket.socket, timeout_s: float = DEFAULT_TIMEOUT_S):
        tune_tcp(sock)
        super().__init__(sock, timeout_s)

    @classmethod
    def connect(cls, host: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S, auth: object = None) -> "TcpChannel":
        """Dial a :class:`TcpListener` (or a peer server) and exchange hellos; with ``auth`` (a
        :class:`~kvtier.transfer.peer_auth.ClientAuth`) mutually authenticated.

        Raises:
            PeerRefused: the server refused this end or is not the expected fleet member.
            TransferError: cannot connect within ``timeout_s``, or the peer is not a TCP transfer channel.
        """
        chan = cls(dial_tcp(host, port, timeout_s, "tcp"), timeout_s)
        chan.handshake(auth=auth)
        return chan

    def send(self, chunks: Sequence[OutChunk], timeout_s: float | None = None) -> list[bool]:
        """See :meth:`TransferChannel.send`. Payloads go to the kernel as they are (``sendmsg``)."""
        items = check_out_chunks(chunks)
        deadline = self._deadline(timeout_s)
        batch_id = self._begin_batch()
        try:
            self._send_views([encode_frame(Batch(batch_id=batch_id, count=len(items)))], deadline)
            for i, (key, mv, given) in enumerate(items):
                frame = encode_frame(Chunk(index=i, key=key, nbytes=len(mv), checksum=payload_digest(mv, given)))
                self._send_views([frame, mv], deadline)
            ack = self._recv_batch_ack(batch_id, len(items), deadline)
        except (OSError, TransferError) as exc:
            raise self._fail(exc) from None
        self._count_sent(items, ack.received)
        return list(ack.received)

    def recv_into(self, dests: Sequence[InSlot], timeout_s: float | None = None) -> list[bool]:
        """See :meth:`TransferChannel.recv_into`. Payloads land in ``dests`` by ``recv_into``."""
        views, index = check_in_slots(dests)
        deadline = self._deadline(timeout_s)
        result = [False] * len(views)
        try:
            batch = self._recv_batch(deadline)
            verdicts: list[bool] = []
            for expect in range(batch.count):
                chunk = self._recv_chunk(batch, expect, deadline)
                verdicts.append(self._take(chunk, views, index, result, deadline))
            self._send_views([encode_frame(BatchAck(batch_id=batch.batch_id, received=verdicts))], deadline)
        except (OSError, TransferError) as exc:
            raise self._fail(exc, received=result) from None
        return result

    def _take(self, chunk: Chunk, views: list[memoryview], index: dict[bytes, int], result: list[bool],
              deadline: Deadline) -> bool:
        """Read one chunk's payload into its destination (or drop it); True if received intact."""
        i = self._slot_for(chunk.key, chunk.nbytes, views, index)
        if i is not None:
            result[i] = False
            ok = self._recv_payload_into(views[i], deadline) == chunk.checksum
            result[i] = ok
            self._count_received(ok, chunk.nbytes)
            return ok
        self._discard(chunk.nbytes, deadline)
        return False


class TcpListener:
    """Accepts :class:`TcpChannel` peers on ``host:port`` (port 0: any free port; see :attr:`address`).

    Args:
        host / port: where to listen.
        timeout_s: default call timeout of accepted channels, seconds.
    """

    kind = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.timeout_s = timeout_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET  # ([::1] arrives here as ::1)
        self._sock = socket.create_server((host, port), family=family, reuse_port=False, backlog=128)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]

    @property
    def socket(self) -> socket.socket:
        """The listening socket (a :class:`~kvtier.transfer.peer_server.PeerServer` accepts on it itself)."""
        return self._sock

    def channel(self, sock: _Socket) -> TcpChannel:
        """The channel of an accepted connection whose handshake is done (blocking mode)."""
        sock.setblocking(True)
        return TcpChannel(sock, self.timeout_s)

    def accept(self, timeout_s: float | None = None) -> TcpChannel:
        """The next peer, hellos exchanged.

        Raises:
            TransferTimeout: nobody connected in time. TransferError: the handshake failed.
        """
        sock = accept_socket(self._sock, self.timeout_s if timeout_s is None else timeout_s, "tcp")
        return self._wrap(sock, timeout_s)

    def _wrap(self, sock: _Socket, timeout_s: float | None) -> TcpChannel:
        """The channel of an accepted connection, hellos exchanged."""
        chan = TcpChannel(sock, self.timeout_s)
        chan.handshake(timeout_s)
        return chan

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "TcpListener":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
