"""The listener of the NIXL transfer channel (control frames over TCP)."""

from __future__ import annotations

import socket

from kvtier.transfer.channel import DEFAULT_TIMEOUT_S
from kvtier.transfer.nixl import NixlChannel, nixl_agent_class
from kvtier.transfer.tcp import TcpListener


class NixlListener(TcpListener):
    """Accepts :class:`NixlChannel` peers on ``host:port`` (control over TCP).

    Raises:
        ChannelUnavailable: NIXL is not installed.
    """

    kind = "nixl"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S):
        nixl_agent_class()
        super().__init__(host, port, timeout_s)

    def channel(self, sock: socket.socket) -> NixlChannel:  # type: ignore[override]
        """The channel of an accepted connection whose hellos are done (the NIXL metadata exchange,
        :meth:`NixlChannel.exchange_metadata`, is next)."""
        sock.setblocking(True)
        return NixlChannel(sock, self.timeout_s)

    def _wrap(self, sock: socket.socket, timeout_s: float | None) -> NixlChannel:  # type: ignore[override]
        chan = NixlChannel(sock, self.timeout_s)
        chan.handshake(timeout_s)
        return chan
