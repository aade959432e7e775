"""The listener of the shared-memory transfer channel: a Unix socket in an owner-only directory."""

from __future__ import annotations

import errno
import os
import socket
import stat
import tempfile

from kvtier.transfer.channel import DEFAULT_TIMEOUT_S
from kvtier.transfer.shm import DEFAULT_STAGING_BYTES, ShmChannel
from kvtier.transfer.stream import accept_socket


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
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _remove_stale_socket(self.path)
            self._sock.bind(self.path)
            os.chmod(self.path, 0o600)  # only this user may connect (the peer server checks uids too)
            self._sock.listen(128)
        except OSError:
            self._sock.close()
            raise

    kind = "shm"

    @property
    def socket(self) -> socket.socket:
        """The listening socket (a :class:`~kvtier.transfer.peer_server.PeerServer` accepts on it itself)."""
        return self._sock

    def channel(self, sock: socket.socket) -> ShmChannel:
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
        try:
            os.unlink(self.path)
            if self._tmpdir:
                os.rmdir(self._tmpdir)
        except OSError:
            pass

    def __enter__(self) -> "ShmListener":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _remove_stale_socket(path: str) -> None:
    """Unlink ``path`` if it is a Unix socket nobody listens on (left by a peer that was killed),
    so a restarted peer can listen at the same address.

    Raises:
        OSError (EADDRINUSE): a live listener answers at ``path``, or ``path`` is not a socket.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(errno.EADDRINUSE, f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        try:
            os.unlink(path)  # stale: its listener is gone
        except FileNotFoundError:
            pass
        return
    except OSError:
        raise OSError(errno.EADDRINUSE, f"shm transfer address {path} is in use") from None
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"shm transfer address {path} is in use")
