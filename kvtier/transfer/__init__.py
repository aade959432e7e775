"""Transfer channels: move KV chunks between kvtier instances straight into caller-owned buffers.

One interface (:class:`~kvtier.transfer.channel.TransferChannel`), three channels:

- :mod:`kvtier.transfer.shm`: same machine, through shared memory (payloads never cross a socket);
- :mod:`kvtier.transfer.tcp`: across machines, TCP with zero-copy sends and ``recv_into``;
- :mod:`kvtier.transfer.nixl`: optional NIXL (UCX) channel, ``pip install 'kvtier[nixl]'``.

:mod:`kvtier.transfer.peer_tier` exposes a peer instance as a read-only lower tier.
Errors are :class:`~kvtier.transfer.errors.TransferError` subclasses; frames are
:mod:`kvtier.transfer.frames`. Layer: above ``service`` (it maps ``kvtier server``'s
shared segments); nothing below imports it.
"""

from kvtier.transfer.channel import ChannelCounters, TransferChannel
from kvtier.transfer.errors import (
    ChannelUnavailable,
    PeerGone,
    ProtocolError,
    TransferError,
    TransferTimeout,
)

__all__ = [
    "ChannelCounters",
    "ChannelUnavailable",
    "PeerGone",
    "ProtocolError",
    "TransferChannel",
    "TransferError",
    "TransferTimeout",
]
