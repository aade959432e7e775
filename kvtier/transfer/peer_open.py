"""Peer sharing from the config: peer tiers for ``peers``, a peer server on ``peer_listen``.

The storage layer reaches these two entry points by name through
:mod:`kvtier.tiers.registry` (``open_peer_tier`` / ``start_peer_server``), the way it
finds tier plug-ins, so it never imports this (higher) package:

- :class:`UrlPeerTier`: a :class:`~kvtier.transfer.peer_tier.PeerTier` that dials a peer's
  ``peer_listen`` URL (``tcp://HOST:PORT``, ``shm:///PATH``, ``nixl://HOST:PORT``) lazily, on
  its first call, each attempt bounded by ``timeout_s``; a dead peer is a miss and is not
  dialled again for ``retry_s`` seconds.
- :func:`start_peer_server`: listens on ``config.peer_listen`` and serves the manager's
  CPU/disk chunks (:class:`~kvtier.transfer.peer_tier.PeerServer`); the manager stops it on close.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.transfer import urls
from kvtier.transfer.channel import TransferChannel
from kvtier.transfer.peer_tier import PeerServer, PeerTier

log = logging.getLogger("kvtier.transfer.peer")


class UrlPeerTier(PeerTier):
    """A peer tier dialling ``url`` (see :func:`kvtier.transfer.urls.connect`).

    Args:
        url: the peer's ``peer_listen`` URL.
        timeout_s: bound of each connect and request, seconds.
        retry_s: after a failure, calls are misses without dialling for this long, seconds.

    Raises:
        ValueError: a malformed URL (checked here, before any call).
    """

    def __init__(self, url: str, timeout_s: float = 1.0, retry_s: float = 5.0):
        urls._parse(url)  # a malformed URL is a config error now, not a miss forever
        self.url = url
        super().__init__(self._dial, timeout_s=timeout_s, retry_s=retry_s, location=url)

    def _dial(self) -> TransferChannel:
        return urls.connect(self.url, self.timeout_s)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "UrlPeerTier":
        """``UrlPeerTier(url, timeout_s=..., retry_s=...)``; other options are refused (TypeError)."""
        return cls(url, **options)


def open_peer_tier(url: str, timeout_s: float, retry_s: float) -> UrlPeerTier:
    """The lower tier for one entry of ``config.peers`` (connects on first use; never blocks here)."""
    return UrlPeerTier(url, timeout_s=timeout_s, retry_s=retry_s)


class UrlPeerServer(PeerServer):
    """A :class:`PeerServer` that knows the URL peers dial (``url``, with the real port)."""

    def __init__(self, manager: Any, url: str, timeout_s: float):
        super().__init__(manager, urls.listen(url, timeout_s), timeout_s=timeout_s)
        self.url = listen_url(self.listener, url)


def listen_url(listener: Any, url: str) -> str:
    """``url`` with the port ``listener`` really listens on (``tcp://h:0`` -> ``tcp://h:41234``)."""
    address = getattr(listener, "address", None)
    scheme = url.split("://", 1)[0]
    if scheme in ("tcp", "nixl") and isinstance(address, tuple) and len(address) >= 2:
        host = url.split("://", 1)[1].rsplit(":", 1)[0]
        return f"{scheme}://{host}:{address[1]}"
    return url


def start_peer_server(config: Any, manager: Any) -> UrlPeerServer | None:
    """Serve ``manager``'s local chunks on ``config.peer_listen`` (None when unset).

    Args:
        config: a :class:`kvtier.config.KVTierConfig` (``peer_listen``, ``peer_timeout_s``).
        manager: the :class:`kvtier.storage.manager.StorageManager` to serve.

    Returns:
        The running server (``stop()`` it); ``server.url`` is the URL peers dial (real port).

    Raises:
        ValueError: a malformed URL. OSError: the address is taken or not bindable.
        ChannelUnavailable: ``nixl://`` without NIXL installed.
    """
    url = getattr(config, "peer_listen", None)
    if not url:
        return None
    server = UrlPeerServer(manager, url, config.peer_timeout_s)
    log.info("kvtier peer server: serving this instance's chunks on %s", server.url)
    return server
