"""The listener of the shared-memory transfer channel: a Unix socket in an owner-only directory."""

from __future__ import annotations

import errno
import os
import socket
import tempfile

from kvtier.protocol.unix_socket import bind_unix
from kvtier.transfer.channel import DEFAULT_TIMEOUT_S
from kvtier.transfer.shm import DEFAULT_STAGING_BYTES, ShmChannel
from kvtier.transfer.stream import accept_socket

#: ``socket.socket``, for annotations in the class whose ``socket`` property shadows the module.
_Socket = socket.socket


class ShmListener:
    """Accepts :class:`ShmChannel` peers on a Unix socket (created 0600: only this user may connect;
    the peer server also checks each peer's uid, ``SO_PEERCRED``).

    Args:
        path: socket path (default: ``shm.sock`` in a new private temporary directory).
        timeout_s: default call timeout of accepted channels, seconds.
        staging_bytes: staging ring size of accepted channels.
    """

    def __init__(self, path: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 staging_bytes: int = DEFAULT_STAGING_BYTES):
        self._tmpdir = None if path else tempfile.mkdtemp(prefix="kvtier-shm-")
        self.path = path or os.path.join(self._tmpdir or "", "shm.sock")
        self.timeout_s = timeout_s
        self.staging_bytes = staging_bytes
        try:
            # PATH.lock held while listening: a second listener starting while this one is between
            # bind() and listen() refuses instead of unlinking its socket (kvtier.protocol.unix_socket).
            # The socket is created 0600: only this user may connect (the peer server checks uids too).
            self._unix = bind_unix(self.path, replace_stale=True, private_dir=False)
        except RuntimeError as exc:
            raise OSError(errno.EADDRINUSE, f"shm transfer address {self.path} is in use ({exc})") from None
        self._sock = self._unix.sock

    kind = "shm"

    @property
    def socket(self) -> socket.socket:
        """The listening socket (a :class:`~kvtier.transfer.peer_server.PeerServer` accepts on it itself)."""
        return self._sock

    def channel(self, sock: _Socket) -> ShmChannel:
        """The channel of an accepted connection whose handshake is done (blocking mode)."""
        sock.setblocking(True)
        return ShmChannel(sock, self.timeout_s, self.staging_bytes)

    def accept(self, timeout_s: float | None = None) -> ShmChannel:
        """The next peer, hellos exchanged.

        Raises:
            TransferTimeout: nobody connected in time. TransferError: the handshake failed.
        """
        sock = accept_socket(self._sock, self.timeout_s if timeout_s is None else timeout_s, "shm")
        chan = ShmChannel(sock, self.timeout_s, self.staging_bytes)
        chan.handshake(timeout_s)
        return chan

    def close(self) -> None:
        self._sock.close()
        self._unix.remove()  # only the socket file this listener created
        try:
            if self._tmpdir:
                os.rmdir(self._tmpdir)
        except OSError:
            pass

    def __enter__(self) -> "ShmListener":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
