"""The one tier-code table of the control plane: one byte per tier kind in lookup replies.

Derived from :data:`kvtier.storage.types.TIER_KINDS` (``cpu``, ``disk``,
``remote``, ``peer``): the code of a kind is its first letter. A reply carries
one code per hit chunk, in prompt order.
"""

from __future__ import annotations

from typing import Iterable

from kvtier.protocol.errors import ErrorCode, ProtocolError
from kvtier.storage.types import TIER_KINDS

#: Tier kind -> one-byte code.
TIER_CODES: dict[str, bytes] = {kind: kind[:1].encode() for kind in TIER_KINDS}
#: Code (as an int, the element type of ``bytes``) -> tier kind.
TIER_NAMES: dict[int, str] = {code[0]: kind for kind, code in TIER_CODES.items()}
assert len(TIER_NAMES) == len(TIER_KINDS), "tier kinds must have distinct first letters"


def encode_tiers(tiers: Iterable[str]) -> bytes:
    """Codes of ``tiers`` (one byte each).

    Raises:
        ProtocolError: ``INTERNAL``: a tier label outside :data:`TIER_KINDS` (a bug
            in a tier; the caller treats the whole lookup as failed).
    """
    out = bytearray()
    for t in tiers:
        code = TIER_CODES.get(t)
        if code is None:
            raise ProtocolError(ErrorCode.INTERNAL, f"tier label {t!r} is not one of {TIER_KINDS}")
        out += code
    return bytes(out)


def decode_tiers(codes: bytes) -> list[str] | None:
    """Tier kinds of ``codes``; None if any code is unknown (the reply is then discarded)."""
    out: list[str] = []
    for c in codes:
        name = TIER_NAMES.get(c)
        if name is None:
            return None
        out.append(name)
    return out
