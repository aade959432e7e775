"""The largest legitimate reply body of every op a cache-service client reads, in bytes.

The client reads each reply into one fixed buffer per connection
(:func:`kvtier.protocol.framing.read_reply_body`); a reply longer than it is refused
(``TOO_LARGE``) and costs the connection. The buffer is therefore sized from the
worst case of every op, not picked by hand (a fixed 64 KiB was below the reply to a
``MAX_KEYS``-chunk ``load_blocks``): an op's bound is its envelope plus ``MAX_KEYS``
times its widest per-key element, each msgpack value at its widest encoding. Raising
``MAX_KEYS``, adding a tier kind with a longer name or a field to an element raises the
bound with it; ``tests/test_reply_bounds.py`` encodes each op's worst reply and checks it
fits.

Ops whose replies carry no per-key list (stats, health, clear, flush, kv_register, ...)
share :data:`MAP_REPLY_BYTES`.
"""

from __future__ import annotations

from kvtier.protocol.errors import ErrorCode
from kvtier.protocol.fields import MAX_KEYS
from kvtier.protocol.framing import MAX_FRAME_BYTES
from kvtier.storage.types import TIER_KINDS

#: Widest msgpack encodings: an integer (uint64/int64), a bool, an array (or bin) header.
INT = 9
BOOL = 1
ARRAY_HEAD = 5
#: Longest text of an error reply (``envelope.error_reply`` cuts it at 500 characters, <= 4 B each).
ERROR_TEXT_BYTES = 500 * 4


def str_bytes(n_bytes: int) -> int:
    """Widest msgpack encoding of a UTF-8 string of ``n_bytes`` bytes."""
    head = 1 if n_bytes < 32 else 2 if n_bytes < 256 else 3 if n_bytes < 65536 else 5
    return head + n_bytes


#: A tier name (a load's ``source``): the longest tier kind.
TIER_NAME = str_bytes(max(len(k.encode()) for k in TIER_KINDS))
#: ``{"v", "id", "ok", "code", "error"}``: every field of the envelope at its widest.
ENVELOPE = (5 + str_bytes(1) + INT + str_bytes(2) + INT + str_bytes(2) + BOOL
            + str_bytes(4) + str_bytes(max(len(c.value) for c in ErrorCode))
            + str_bytes(5) + str_bytes(ERROR_TEXT_BYTES))
#: Every reply without a per-key list (stats: ~100 counters; health; clear: per tier; ...).
MAP_REPLY_BYTES = 64 * 1024

#: Per op: (its per-key list fields' names, the widest encoding of one element of each).
PER_KEY: dict[str, tuple[tuple[str, int], ...]] = {
    "lookup": (("tiers", 1),),  # one byte per hit (a bin)
    "reserve_many": (("slots", INT), ("skips", INT)),
    # [handle, slot, source, checksum] (the checksum only when the client verifies)
    "load_many": (("handles", 1 + INT + INT + TIER_NAME + INT),),
    "store_blocks": (("skips", INT),),
    "load_blocks": (("sources", TIER_NAME),),
}


def max_reply_bytes(op: str, max_keys: int = MAX_KEYS) -> int:
    """Largest legitimate reply body of ``op`` to a request of ``max_keys`` keys, in bytes.

    Raises:
        KeyError: ``op`` carries no per-key list (its bound is :data:`MAP_REPLY_BYTES`).
    """
    return ENVELOPE + sum(str_bytes(len(name)) + ARRAY_HEAD + max_keys * width for name, width in PER_KEY[op])


#: The client's reply buffer holds any of them (bytes of body).
MAX_REPLY_BYTES = max(MAP_REPLY_BYTES, *(max_reply_bytes(op) for op in PER_KEY))
if MAX_REPLY_BYTES > MAX_FRAME_BYTES:  # pragma: no cover - a bound change that breaks the protocol
    raise ImportError(f"the largest reply ({MAX_REPLY_BYTES} B) exceeds MAX_FRAME_BYTES ({MAX_FRAME_BYTES} B)")

__all__ = ["MAP_REPLY_BYTES", "MAX_REPLY_BYTES", "PER_KEY", "max_reply_bytes"]
