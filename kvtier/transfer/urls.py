"""Choose a transfer channel by URL (what a config setting names).

- ``shm:///path/to/socket`` (same machine: shared memory, control over that Unix socket);
- ``tcp://host:port`` (across machines);
- ``nixl://host:port`` (NIXL/UCX payloads, control over TCP at ``host:port``; needs ``kvtier[nixl]``).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from kvtier.transfer.channel import DEFAULT_TIMEOUT_S, TransferChannel

SCHEMES = ("shm", "tcp", "nixl")


def _parse(url: str) -> tuple[str, str, int]:
    """``(scheme, host or path, port)``.

    Raises:
        ValueError: an unknown scheme, or a missing host/port/path.
    """
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"transfer channel URL {url!r}: scheme must be one of {', '.join(SCHEMES)}")
    if parts.scheme == "shm":
        if not parts.path:
            raise ValueError(f"transfer channel URL {url!r}: shm:// needs a socket path (shm:///run/kvtier.sock)")
        return "shm", parts.path, 0
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise ValueError(f"transfer channel URL {url!r}: needs host:port")
    return parts.scheme, parts.hostname, port


def connect(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, auth: Any = None) -> TransferChannel:
    """Dial the peer at ``url``; with ``auth`` (a :class:`~kvtier.transfer.peer_auth.ClientAuth`)
    both ends authenticate (:mod:`kvtier.transfer.peer_auth`).

    Raises:
        ValueError: a malformed URL. PeerRefused: authentication failed either way.
        TransferError: cannot connect (ChannelUnavailable: NIXL missing).
    """
    scheme, where, port = _parse(url)
    if scheme == "shm":
        from kvtier.transfer.shm import ShmChannel

        return ShmChannel.connect(where, timeout_s, auth=auth)
    if scheme == "tcp":
        from kvtier.transfer.tcp import TcpChannel

        return TcpChannel.connect(where, port, timeout_s, auth=auth)
    from kvtier.transfer.nixl import NixlChannel

    return NixlChannel.connect(where, port, timeout_s, auth=auth)


def host_of(url: str) -> str:
    """The host of a ``tcp://`` / ``nixl://`` URL ("" for ``shm://``).

    Raises:
        ValueError: a malformed URL.
    """
    scheme, where, _ = _parse(url)
    return "" if scheme == "shm" else where


def listen(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """A listener for ``url`` (its ``accept(timeout_s)`` returns a channel; ``close()``).

    Raises:
        ValueError: a malformed URL. ChannelUnavailable: NIXL missing. OSError: the address is taken.
    """
    scheme, where, port = _parse(url)
    if scheme == "shm":
        from kvtier.transfer.shm_listener import ShmListener

        return ShmListener(where, timeout_s)
    if scheme == "tcp":
        from kvtier.transfer.tcp import TcpListener

        return TcpListener(where, port, timeout_s)
    from kvtier.transfer.nixl_listener import NixlListener

    return NixlListener(where, port, timeout_s)
