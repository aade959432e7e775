"""Addresses and socket directories of the control plane (shared by servers and clients)."""

from __future__ import annotations

import os
import stat
import tempfile


class UnsafeSocketDir(PermissionError):
    """A Unix socket's directory is not owned by this user or is group/other-writable.

    Anyone who can write there could replace the socket with their own and
    receive this process's keys (or serve it forged replies).
    """


def check_socket_dir(path: str) -> None:
    """Refuse a socket whose directory another user could write to.

    Raises:
        UnsafeSocketDir: the directory of ``path`` is owned by another user or is
            group- or other-writable.
        FileNotFoundError: the directory does not exist.
    """
    d = os.path.dirname(os.path.abspath(path))
    st = os.stat(d)
    if st.st_uid != os.getuid():
        raise UnsafeSocketDir(f"socket directory {d} is owned by uid {st.st_uid}, not by this user ({os.getuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeSocketDir(
            f"socket directory {d} is group/other-writable (mode {stat.S_IMODE(st.st_mode):o}); use a 0700 directory"
        )


def make_socket_dir(path: str) -> None:
    """Create the directory of ``path`` owner-only (0700) if missing, then :func:`check_socket_dir`.

    Raises:
        UnsafeSocketDir: see :func:`check_socket_dir`.
        OSError: the directory cannot be created.
    """
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, mode=0o700, exist_ok=True)
    check_socket_dir(path)


def private_runtime_dir() -> str:
    """``$XDG_RUNTIME_DIR`` (a per-user 0700 directory), else ``<tmp>/kvtier-<uid>``."""
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run:
        return run
    return os.path.join(tempfile.gettempdir(), f"kvtier-{os.getuid()}")
