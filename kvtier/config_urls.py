"""Checks of the addresses and URLs that settings name (used by :class:`kvtier.config.KVTierConfig`).

Every error names the setting and shows its URL masked (:func:`kvtier.urls.mask_url`: no
password reaches a message) and cut to 200 characters.
"""

from __future__ import annotations

import os

from kvtier.hosts import canonical_host, check_host
from kvtier.urls import mask_url

__all__ = ["PEER_SCHEMES", "MAX_UNIX_PATH_BYTES", "check_ports", "check_transfer_url",
           "canonical_host_of", "check_host_of"]


def check_ports(url: str, rest: str) -> None:
    """Every ``host:port`` of the URL's authority has a port in 1-65535 (cluster URLs list several)."""
    netloc = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0].rpartition("@")[2]
    for part in filter(None, netloc.split(",")):
        host, sep, port = part.rpartition(":") if not part.endswith("]") else ("", "", "")
        if sep and (not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536):
            raise ValueError(f"remote_url {mask_url(url)!r}: port {port!r} is not a number in 1-65535")


#: Transfer channel schemes a peer URL may name (see :mod:`kvtier.transfer.urls`).
PEER_SCHEMES = ("tcp", "shm", "nixl")


def check_transfer_url(key: str, url: str, listen: bool) -> str:
    """``url`` if it is ``tcp://HOST:PORT``, ``nixl://HOST:PORT`` or ``shm:///ABSOLUTE/PATH``, else ValueError.

    Ports are 1-65535 (0 too when ``listen``: any free port). A TCP/NIXL URL is returned in its
    canonical form, ``SCHEME://host:PORT`` (host lowercased but for an IPv6 zone id, no trailing
    ``/``, the port in decimal without leading zeros); an ``shm://`` URL as given.
    """
    scheme, sep, rest = url.partition("://")
    if scheme not in PEER_SCHEMES or not sep:
        raise ValueError(f"{key} {_shown(url)!r}: scheme must be one of {', '.join(s + '://' for s in PEER_SCHEMES)}")
    shown = _shown(url)
    if scheme == "shm":
        if not rest.startswith("/") or len(rest) < 2:
            raise ValueError(f"{key} {shown!r}: shm:// needs an absolute socket path, e.g. shm:///run/kvtier-peer.sock")
        if any(c in rest for c in "\0?#"):
            raise ValueError(f"{key} {shown!r}: a socket path holds no NUL, '?' or '#'")
        path = os.path.normpath(rest)  # lexical: // and /./ and a trailing / go
        path = "/" + path.lstrip("/")  # (POSIX keeps a leading '//')
        if len(os.fsencode(path)) > MAX_UNIX_PATH_BYTES:
            raise ValueError(f"{key} {shown!r}: a Unix socket path is at most {MAX_UNIX_PATH_BYTES} bytes")
        return f"shm://{path}"
    host, colon, port = rest.rstrip("/").rpartition(":")
    low = 0 if listen else 1
    if not colon or not host or "/" in host or not (port.isascii() and port.isdigit() and len(port) <= 5) \
            or not low <= int(port) < 65536:
        raise ValueError(f"{key} {shown!r}: expected {scheme}://HOST:PORT with a port in {low}-65535")
    check_host_of(key, url, host, wildcard=False)  # (a socket binds 0.0.0.0, not ZeroMQ's *)
    canonical = canonical_host_of(key, shown, host)
    if not listen and canonical in ("0.0.0.0", "[::]"):
        raise ValueError(f"{key} {shown!r}: a peer is dialled at an address, not a wildcard")
    return f"{scheme}://{canonical}:{int(port)}"


#: Longest Unix socket path (``sun_path`` is 108 bytes with its terminating NUL).
MAX_UNIX_PATH_BYTES = 107


def canonical_host_of(key: str, shown: str, host: str) -> str:
    """:func:`kvtier.hosts.canonical_host` with the setting and its URL in the error."""
    try:
        return canonical_host(host)
    except ValueError as exc:
        raise ValueError(f"{key} {shown!r}: {exc}") from None


def check_host_of(key: str, url: str, host: str, wildcard: bool = True) -> None:
    """:func:`kvtier.hosts.check_host` with the setting and its (masked) URL in the error."""
    try:
        check_host(host, wildcard=wildcard)
    except ValueError as exc:
        raise ValueError(f"{key} {mask_url(url)!r}: {exc}") from None


def _shown(url: str) -> str:
    """``url`` as an error shows it: its password masked (:func:`kvtier.urls.mask_url`), cut to 200 characters."""
    masked = mask_url(url)
    return masked if len(masked) <= 200 else masked[:200] + "..."
