"""How an instance names and describes itself to the fleet controller.

- :func:`default_instance_id`: its id (unique per process).
- :func:`parse_controller`: the controller address it connects to, checked.
- :func:`namespace_info` / :func:`tier_infos` / :func:`peer_url_of`: the ``Register``
  descriptions of its namespaces, tiers and peer server (:mod:`kvtier.protocol.fleet`).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from kvtier.protocol import fleet as F


def default_instance_id(port: int | str | None = None) -> str:
    """``"<hostname>:<port or 'embedded'>:<pid>"``: unique per process, several per machine allowed.

    ``port`` is the instance's TCP port, or a label (``"server"`` for a Unix-socket-only server).
    """
    return f"{socket.gethostname()}:{port if port else 'embedded'}:{os.getpid()}"


def parse_controller(url: str) -> str:
    """Check a controller address (``tcp://host:port``) and return it as a ZMQ endpoint.

    Raises:
        ValueError: not ``tcp://host:port`` with a port in 1-65535.
    """
    scheme, sep, rest = url.partition("://")
    host, colon, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not colon or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"controller address {url!r} must be tcp://HOST:PORT (port 1-65535)")
    return url


def manager_of(ops: Any) -> Any:
    """The storage manager behind an InstanceOps (its ``m``; ``manager`` for look-alikes), or None."""
    return getattr(ops, "m", None) or getattr(ops, "manager", None)


#: Listen hosts that name every interface: other machines cannot dial them as they are.
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


def advertised_peer_url(url: str) -> str:
    """``url`` as other instances dial it: a wildcard listen host (``tcp://0.0.0.0:7700``) becomes this
    machine's host name (``tcp://HOSTNAME:7700``); other URLs (``shm://``, a named host) are unchanged."""
    scheme, sep, rest = url.partition("://")
    if scheme not in ("tcp", "nixl") or not sep:
        return url
    host, colon, port = rest.rpartition(":")
    if colon and host in WILDCARD_HOSTS:
        return f"{scheme}://{socket.gethostname()}:{port}"
    return url


def peer_url_of(namespaces: dict[bytes, tuple[F.NamespaceInfo, Any]]) -> str:
    """The URL peers dial for this instance: the first reported namespace's storage manager's
    ``peer_server.url`` (``peer_listen`` with the real port, see :func:`advertised_peer_url`), or ""
    when none serves peers."""
    for _, ops in namespaces.values():
        url = getattr(getattr(manager_of(ops), "peer_server", None), "url", "")
        if isinstance(url, str) and url:
            return advertised_peer_url(url)
    return ""


def namespace_info(namespace: Any) -> F.NamespaceInfo:
    """The :class:`~kvtier.protocol.fleet.NamespaceInfo` of a :class:`kvtier.index.keys.KeyNamespace`."""
    return F.NamespaceInfo(
        namespace.digest(), namespace.canonical_bytes(), int(namespace.chunk_size), int(namespace.chunk_bytes)
    )


def tier_infos(manager: Any) -> list[F.TierInfo]:
    """The tiers of a :class:`kvtier.storage.manager.StorageManager`, CPU first."""
    out = [F.TierInfo("cpu", "cpu", int(manager.cpu.capacity_bytes), False)]
    for tier in manager.lower:
        cap = int(getattr(tier, "capacity_bytes", 0) or 0)
        out.append(F.TierInfo(tier.kind, tier.location, cap, not tier.local))
    return out
