"""Peer sharing from the config: peer tiers for ``peers``, a peer server on ``peer_listen``.

The storage layer reaches these two entry points by name through
:mod:`kvtier.tiers.registry` (``open_peer_tier`` / ``start_peer_server``), the way it
finds tier plug-ins, so it never imports this (higher) package:

- :class:`UrlPeerTier`: a :class:`~kvtier.transfer.peer_tier.PeerTier` that dials a peer's
  ``peer_listen`` URL (``tcp://HOST:PORT``, ``shm:///PATH``, ``nixl://HOST:PORT``) lazily, on
  its first call, each attempt bounded by ``timeout_s``; a dead peer is a miss and is not
  dialled again for ``retry_s`` seconds.
- :func:`start_peer_server`: listens on ``config.peer_listen`` and serves the manager's
  CPU/disk chunks (:class:`~kvtier.transfer.peer_server.PeerServer`); the manager stops it on close.

Who may talk to whom (README, "the trust model"): over ``tcp://`` and ``nixl://`` both ends prove a
fleet key (``fleet_key``) that the other lists in its ``fleet_members`` with the ``peer`` role; a
listener beyond loopback also needs ``peer_allow_remote``. Over ``shm://`` (a Unix socket, 0600)
both ends must run as the same user; with credentials set they authenticate as over TCP.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.hosts import is_loopback
from kvtier.protocol.trust import Credentials, TrustError, credentials_from_config
from kvtier.transfer import urls
from kvtier.transfer.channel import TransferChannel
from kvtier.transfer.peer_auth import ClientAuth
from kvtier.transfer.peer_server import PeerServer
from kvtier.transfer.peer_tier import PeerTier

log = logging.getLogger("kvtier.transfer.peer")


def peer_credentials(config: Any) -> Credentials | None:
    """The fleet credentials of ``config`` (``fleet_key`` / ``fleet_members``), or None.

    Raises:
        ValueError: set but unusable (the :class:`~kvtier.protocol.trust.TrustError` message).
    """
    try:
        return credentials_from_config(config) if config is not None else None
    except TrustError as exc:
        raise ValueError(str(exc)) from None


class UrlPeerTier(PeerTier):
    """A peer tier dialling ``url`` (see :func:`kvtier.transfer.urls.connect`).

    Args:
        url: the peer's ``peer_listen`` URL.
        timeout_s: bound of each connect and request, seconds.
        retry_s: after a failure, calls are misses without dialling for this long, seconds.
        credentials: this node's fleet key and members (required for ``tcp://`` and ``nixl://``).
        expect: the Z85 public key the peer must hold (None: any member with the ``peer`` role).

    Raises:
        ValueError: a malformed URL, or a TCP/NIXL URL without credentials (checked here, before any call).
    """

    def __init__(self, url: str, timeout_s: float = 1.0, retry_s: float = 5.0,
                 credentials: Credentials | None = None, expect: str | None = None):
        urls._parse(url)  # a malformed URL is a config error now, not a miss forever
        if credentials is None and not url.startswith("shm://"):
            raise ValueError(f"peer {url}: a TCP/NIXL peer is dialled with fleet credentials only (set fleet_key "
                             "and fleet_members); without them, peers share over shm:/// between one user's processes")
        self.url = url
        self.credentials = credentials
        self.expect = expect
        super().__init__(self._dial, timeout_s=timeout_s, retry_s=retry_s, location=url)

    def _dial(self) -> TransferChannel:
        auth = ClientAuth(self.credentials, self.expect) if self.credentials is not None else None
        return urls.connect(self.url, self.timeout_s, auth=auth)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "UrlPeerTier":
        """``UrlPeerTier(url, timeout_s=..., retry_s=..., credentials=...)``; other options are refused (TypeError)."""
        return cls(url, **options)


def open_peer_tier(url: str, timeout_s: float, retry_s: float, config: Any = None) -> UrlPeerTier:
    """The lower tier for one entry of ``config.peers`` (connects on first use; never blocks here).

    Raises:
        ValueError: a malformed URL, a TCP/NIXL peer without credentials, unusable credentials.
    """
    return UrlPeerTier(url, timeout_s=timeout_s, retry_s=retry_s, credentials=peer_credentials(config))


class UrlPeerServer(PeerServer):
    """A :class:`PeerServer` that knows the URL peers dial (``url``, with the real port)."""

    def __init__(self, manager: Any, url: str, timeout_s: float, credentials: Credentials | None = None):
        super().__init__(manager, urls.listen(url, timeout_s), timeout_s=timeout_s, credentials=credentials)
        self.url = listen_url(self.listener, url)


def listen_url(listener: Any, url: str) -> str:
    """``url`` with the port ``listener`` really listens on (``tcp://h:0`` -> ``tcp://h:41234``)."""
    address = getattr(listener, "address", None)
    scheme = url.split("://", 1)[0]
    if scheme in ("tcp", "nixl") and isinstance(address, tuple) and len(address) >= 2:
        host = url.split("://", 1)[1].rsplit(":", 1)[0]
        return f"{scheme}://{host}:{address[1]}"
    return url


def check_listen(config: Any) -> None:
    """Refuse a ``peer_listen`` that would serve strangers: TCP/NIXL without fleet credentials, or a host
    beyond loopback without ``peer_allow_remote``.

    Raises:
        ValueError: naming the setting to change.
    """
    url = config.peer_listen
    host = urls.host_of(url)
    if url.startswith("shm://"):
        return
    if getattr(config, "fleet_key", None) is None or getattr(config, "fleet_members", None) is None:
        raise ValueError(f"peer_listen {url}: a TCP/NIXL peer server admits fleet members only; set fleet_key and "
                         "fleet_members (or share over shm:///PATH between one user's processes)")
    if not is_loopback(host) and not getattr(config, "peer_allow_remote", False):
        raise ValueError(f"peer_listen {url}: {host} is beyond loopback; set peer_allow_remote to serve other machines")


def start_peer_server(config: Any, manager: Any) -> UrlPeerServer | None:
    """Serve ``manager``'s local chunks on ``config.peer_listen`` (None when unset).

    Args:
        config: a :class:`kvtier.config.KVTierConfig` (``peer_listen``, ``peer_timeout_s``, ``fleet_key``,
            ``fleet_members``, ``peer_allow_remote``).
        manager: the :class:`kvtier.storage.manager.StorageManager` to serve.

    Returns:
        The running server (``stop()`` it); ``server.url`` is the URL peers dial (real port).

    Raises:
        ValueError: a malformed URL, missing credentials or opt-in (:func:`check_listen`).
        OSError: the address is taken or not bindable. ChannelUnavailable: ``nixl://`` without NIXL installed.
    """
    url = getattr(config, "peer_listen", None)
    if not url:
        return None
    check_listen(config)
    server = UrlPeerServer(manager, url, config.peer_timeout_s, peer_credentials(config))
    log.info("kvtier peer server: serving this instance's chunks on %s (%s)", server.url,
             "fleet members only" if server.credentials is not None else "this user's processes only")
    return server
