"""Where storage and peer sharing are joined: a storage manager with its peer tiers and its peer server.

A peer is one more lower tier. The storage layer opens the tiers it owns (disk, remote:
:func:`kvtier.storage.lower_tiers.open_storage_tiers`) and refuses peer settings it cannot honour;
this module, one layer up, adds the tiers of ``peers`` (one read-only tier per listed instance,
:func:`kvtier.transfer.peer_open.open_peer_tier`) and of ``peer_discovery`` (the controller-directed
tier, :mod:`kvtier.transfer.directed_peer`), and starts the peer server of ``peer_listen``. Before
this, the manager did all of it itself and reached this layer through ``importlib`` strings, an
upward dependency no import graph showed (issue 25).

Order of the lower tiers, fastest first: disk, remote, the static peers in ``peers`` order, the
directed peer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from kvtier.storage.lower_tiers import open_storage_tiers
from kvtier.storage.manager import StorageManager
from kvtier.transfer.directed_peer import open_directed_peer_tier
from kvtier.transfer.peer_open import open_peer_tier, start_peer_server

if TYPE_CHECKING:
    from kvtier.config import KVTierConfig
    from kvtier.index.keys import KeyNamespace
    from kvtier.memory.pool import ChunkPool
    from kvtier.tiers.base import LowerTier


def open_lower_tiers(config: KVTierConfig, namespace: KeyNamespace,
                     is_pinned: Callable[[bytes], bool]) -> list[LowerTier]:
    """Every lower tier ``config`` names, fastest first (see the module doc); contacts no peer here.

    ``is_pinned`` tells the disk tier which keys leases hold (never evicted).

    Raises:
        ValueError: a malformed URL or missing credentials (remote, peers, peer_discovery).
        DiskTierLocked: the disk directory is owned by another live process.
        OSError: the disk directory cannot be created or listed.
    """
    tiers = open_storage_tiers(config, namespace, is_pinned)
    try:
        for url in config.peers:  # one read-only tier per peer instance, slowest: last
            tiers.append(open_peer_tier(url, config.peer_timeout_s, config.peer_retry_s, config))
        if config.peer_discovery is not None:  # the peer the controller names, after the static ones
            tiers.append(open_directed_peer_tier(config, namespace.digest()))
    except BaseException:
        for t in tiers:
            t.close()
        raise
    return tiers


def open_manager(config: KVTierConfig, namespace: KeyNamespace, pool: ChunkPool | None = None) -> StorageManager:
    """A :class:`StorageManager` for ``config`` with all its lower tiers and, for ``peer_listen``, its peer server.

    Raises:
        ValueError: as :func:`open_lower_tiers`, or a ``peer_listen`` that cannot be served
            (missing credentials or opt-in).
        OSError: the ``peer_listen`` address is taken; the disk directory as above.
    """
    manager = StorageManager(config, namespace, pool=pool,
                             lower=lambda pinned: open_lower_tiers(config, namespace, pinned))
    try:
        manager.attach_peer_server(start_peer_server(config, manager))
    except BaseException:
        manager.close()
        raise
    return manager


__all__ = ["open_lower_tiers", "open_manager"]
