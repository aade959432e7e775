"""How an instance names and describes itself to the fleet controller.

- :func:`default_instance_id`: its id (unique per process).
- :func:`parse_controller`: the controller address it connects to, checked.
- :func:`namespace_info` / :func:`tier_infos`: the ``Register`` descriptions of its
  namespaces and tiers (:mod:`kvtier.protocol.fleet`).
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
    if scheme != "tcp" or not sep or not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"controller address {url!r} must be tcp://HOST:PORT (port 1-65535)")
    return url


def manager_of(ops: Any) -> Any:
    """The storage manager behind an InstanceOps (its ``m``; ``manager`` for look-alikes), or None."""
    return getattr(ops, "m", None) or getattr(ops, "manager", None)


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
        out.append(F.TierInfo(tier.kind, tier.location, cap, tier.kind not in ("disk",)))
    return out
