"""When a client's per-key request must be split to fit one frame.

A request of ``MAX_KEYS`` keys with their parents (and engine block ids) is over
``MAX_FRAME_BYTES`` (16,384 x (32 B key + 35 B parent) alone is 1.1 MB), and one that
does not fit is refused before it is sent. :func:`fits_one_frame` bounds a request's
encoded size from its counts (each value at its widest msgpack encoding); the client
sends one that does not fit as two halves, recursively (a lone key always goes as is).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence, TypeVar

from kvtier.protocol.framing import MAX_FRAME_BYTES
from kvtier.protocol.messages import MAX_BLOCK_IDS

log = logging.getLogger("kvtier.service.client")
Rq = TypeVar("Rq")

#: Bytes of one key (in the joined key binary), a parent (bin 8 header + 32 B, or nil), an
#: integer (block id, offset, at most uint64), an array header; and room for the envelope.
_KEY, _PARENT, _INT, _ARRAY, _ENVELOPE = 32, 34, 9, 5, 4096


def fits_one_frame(n_keys: int, blocks: Sequence[Sequence[int]] | None = None) -> bool:
    """Whether a request of ``n_keys`` keys, each with a parent, and (``store_blocks`` /
    ``load_blocks``) per key its ``blocks`` ids and an offset surely fits one frame and the
    per-request block-id bound (``MAX_BLOCK_IDS``)."""
    size = _ENVELOPE + n_keys * (_KEY + _PARENT)
    if blocks is not None:
        n_ids = sum(map(len, blocks))
        if n_ids > MAX_BLOCK_IDS:
            return False
        size += n_keys * (_ARRAY + _INT) + n_ids * _INT
    return size <= MAX_FRAME_BYTES


__all__ = ["fits_one_frame"]


def request_or_none(make: Callable[[], Rq]) -> Rq | None:
    """The request ``make`` builds, or None (a failed call: a miss) when its own rules refuse it
    (``__post_init__``: duplicate keys, a chunk that is its own parent, lengths that disagree)."""
    try:
        return make()
    except ValueError as exc:
        log.warning("kvtier: request not sent (%s); treated as a failed call", exc)
        return None
