"""The requests a peer tier sends a peer server, and the replies (msgspec structs in control frames)."""

from __future__ import annotations

import msgspec


class PeerRequest(msgspec.Struct, frozen=True):
    """``op``: ``"contains"`` or ``"get"``; ``keys``: chunk keys, in prompt order."""

    op: str
    keys: list[bytes]


class PeerReply(msgspec.Struct, frozen=True):
    """Per requested key: held (``contains``) or about to be sent in the batch that follows (``get``)."""

    found: list[bool]


#: Most keys one request may name.
MAX_KEYS = 4096
#: Keys per request a peer tier sends (255-byte keys at most: one request fits a 64 KiB control frame).
BATCH_KEYS = 200
