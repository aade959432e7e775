"""Owner-only Unix listening sockets that no other process can take over or remove.

Invariants:

- A process removes a socket file only if it created it: :meth:`UnixSocketFile.remove` unlinks
  the path only while it still names the inode this process bound (another process's socket
  that replaced it stays).
- ``bind()`` never replaces a file silently. With ``replace_stale=False`` (an engine's lookup
  endpoint, whose name is unique per engine instance) an existing path is an error, whoever owns
  it. With ``replace_stale=True`` (the ``kvtier server``'s fixed, user-chosen path, a peer's
  ``shm://`` transfer address) the binder
  first takes an exclusive ``flock`` on ``PATH.lock`` and keeps it for the socket's lifetime;
  an existing socket file is removed only when that lock was free (its creator is gone: the
  kernel drops a dead process's ``flock``) and nothing answers on it. A second server that
  starts while the first is between ``bind()`` and ``listen()`` finds the lock held and refuses;
  before the lock, it saw a refused ``connect``, took the socket for stale and unlinked the
  first one's.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
from dataclasses import dataclass

from kvtier.protocol.transport import make_socket_dir

#: Listen backlog of every kvtier listener (connections the kernel queues before accept).
LISTEN_BACKLOG = 512


@dataclass
class UnixSocketFile:
    """A bound, listening Unix socket and what proves this process created its file.

    Attributes:
        path: the socket path.
        sock: the listening socket.
        file_id: ``(st_dev, st_ino)`` of the socket file this process bound.
        lock_fd: the ``PATH.lock`` descriptor holding the exclusive ``flock`` (None: no lock).
    """

    path: str
    sock: socket.socket
    file_id: tuple[int, int]
    lock_fd: int | None = None

    def remove(self) -> None:
        """Unlink the socket file if it is still the one this process bound, then drop the lock
        (idempotent; never raises). The listening socket itself is closed by its owner."""
        try:
            st = os.lstat(self.path)
            if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == self.file_id:
                os.unlink(self.path)
        except OSError:
            pass
        fd, self.lock_fd = self.lock_fd, None
        if fd is not None:
            try:
                os.unlink(self.path + ".lock")  # still ours: we hold its lock
            except OSError:
                pass
            os.close(fd)


def _take_lock(path: str) -> int | None:
    """An exclusive ``flock`` on ``path`` (created 0600), or None when another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the holder removed the file as we opened it: lock the one now there


def _listen(sock: socket.socket) -> None:
    """``listen()`` (a seam: tests pause here to open the bind/listen window)."""
    sock.listen(LISTEN_BACKLOG)


def bind_unix(path: str, replace_stale: bool = True, private_dir: bool = True) -> UnixSocketFile:
    """Listen on the Unix socket ``path``, owner-only (socket 0600, directory 0700).

    Args:
        path: the socket path.
        replace_stale: take ``PATH.lock`` and replace a stale socket of a dead process (see the
            module doc); False: an existing ``path`` is an error.
        private_dir: create the directory 0700 and refuse one others can write; False: the
            directory is the caller's (a transfer address it chose). The socket is 0600 either way.

    Raises:
        UnsafeSocketDir: the directory is another user's or group/other-writable.
        RuntimeError: ``path`` is not a socket, another server holds or listens on it, or
            (``replace_stale=False``) it exists.
        OSError: the socket cannot be bound.
    """
    if private_dir:
        make_socket_dir(path)
    lock_fd = None
    if replace_stale:
        lock_fd = _take_lock(path + ".lock")
        if lock_fd is None:
            raise RuntimeError(f"another kvtier server is listening (or starting) on {path}")
    try:
        if os.path.lexists(path):
            if not replace_stale:
                raise RuntimeError(f"{path} already exists (another process's socket: it is left alone)")
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise RuntimeError(f"{path} exists and is not a socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # stale: its creator no longer holds the lock, nothing answers
            else:
                raise RuntimeError(f"another kvtier server is listening on {path}")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)
        try:
            sock.bind(path)
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise RuntimeError(f"{path} already exists (another process's socket: it is left alone)") from None
            raise
        finally:
            os.umask(old)
        st = os.lstat(path)
        bound = UnixSocketFile(path, sock, (st.st_dev, st.st_ino), lock_fd)
    except BaseException:
        if lock_fd is not None:
            os.close(lock_fd)
        raise
    try:
        os.chmod(path, 0o600)
        _listen(sock)
    except BaseException:
        bound.remove()
        sock.close()
        raise
    return bound
