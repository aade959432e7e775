"""The typed errors of kvtier's transfer channels.

Every failure of a channel call (timeout, peer gone, malformed frame, missing
backend) raises a :class:`TransferError` subclass; none hangs beyond the call's
timeout. A chunk whose payload is corrupt or does not fit its destination is not
an error: the call reports it as not received (a miss).
"""

from __future__ import annotations

from kvtier.errors import BaseProtocolError


class TransferError(Exception):
    """A channel call failed; ``received`` (when known) says which chunks of the call had
    completely arrived and were verified before the failure (never a partial chunk)."""

    def __init__(self, message: str, received: list[bool] | None = None):
        super().__init__(message)
        self.received = received


class TransferTimeout(TransferError):
    """The call's timeout passed (a silent or slow peer)."""


class PeerGone(TransferError):
    """The peer closed or reset the connection (it died, or closed the channel)."""


class ProtocolError(BaseProtocolError, TransferError):
    """A frame that does not decode or breaks the protocol (the channel is closed after it)."""


class ChannelUnavailable(TransferError):
    """The channel's backend is not installed or cannot start here (e.g. NIXL)."""


class PeerRefused(TransferError):
    """The peer would not authenticate this end, or this end would not accept the peer (not a fleet
    member, a failed proof, a refused connection); ``str()`` says which."""
