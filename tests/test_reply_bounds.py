"""The client's reply buffer holds the largest legitimate reply of every op (kvtier.protocol.reply_bounds)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import msgspec
import pytest

from kvtier import protocol as P
from kvtier.protocol import reply_bounds as B
from kvtier.protocol.envelope import error_reply, ok_reply
from kvtier.protocol.framing import pack, read_reply_body
from kvtier.protocol.replies import (LoadBlocksReply, LoadManyReply, LookupReply, ReserveManyReply,
                                     StoreBlocksReply, decode_reply)
from kvtier.service import connection
from kvtier.service.request_split import fits_one_frame
from kvtier.storage.types import TIER_KINDS

N = P.MAX_KEYS
WIDE_INT = (1 << 64) - 1
LONGEST_TIER = max(TIER_KINDS, key=len)

#: Per op: its worst legitimate ok reply's fields (MAX_KEYS entries, every value at its widest), its struct.
WORST: dict[str, tuple[dict[str, Any], type]] = {
    "lookup": ({"tiers": b"r" * N}, LookupReply),
    "reserve_many": ({"slots": [WIDE_INT >> 1] * N, "skips": [WIDE_INT >> 1] * N}, ReserveManyReply),
    "load_many": ({"handles": [[WIDE_INT >> 1, WIDE_INT >> 1, LONGEST_TIER, WIDE_INT >> 1]] * N}, LoadManyReply),
    "store_blocks": ({"skips": [WIDE_INT >> 1] * N}, StoreBlocksReply),
    "load_blocks": ({"sources": [LONGEST_TIER] * N}, LoadBlocksReply),
}


def test_every_op_with_a_per_key_list_has_a_worst_case_here() -> None:
    assert set(WORST) == set(B.PER_KEY)


@pytest.mark.parametrize("op", sorted(WORST))
def test_worst_reply_of_each_op_fits_its_bound_and_the_client_buffer(op: str) -> None:
    fields, struct = WORST[op]
    frame = pack(ok_reply(WIDE_INT, **fields))
    body_len = len(frame) - P.HEADER.size
    assert body_len <= B.max_reply_bytes(op) <= B.MAX_REPLY_BYTES <= P.MAX_FRAME_BYTES
    buf = bytearray(connection._RECV_BYTES)
    a, b = socket.socketpair()
    sender = threading.Thread(target=a.sendall, args=(frame,))  # larger than the socket buffer
    sender.start()
    try:
        b.settimeout(5)
        body, _ = read_reply_body(b, buf, time.monotonic() + 5)
    finally:
        sender.join(5)
        a.close()
        b.close()
    reply = decode_reply(msgspec.msgpack.Decoder(struct), body)
    assert reply.ok and reply.id == WIDE_INT


def test_worst_error_reply_fits_the_envelope_bound() -> None:
    longest_code = max((c.value for c in P.ErrorCode), key=len)
    frame = pack(error_reply(WIDE_INT, longest_code, "\U0010ffff" * 600))
    assert len(frame) - P.HEADER.size <= B.ENVELOPE


def test_bounds_grow_with_the_keys_per_request() -> None:
    for op in B.PER_KEY:
        assert B.max_reply_bytes(op, 2 * N) > B.max_reply_bytes(op, N)
    assert B.MAX_REPLY_BYTES == max(B.MAP_REPLY_BYTES, *(B.max_reply_bytes(op) for op in B.PER_KEY))


def test_requests_too_large_for_one_frame_are_split() -> None:
    assert fits_one_frame(1) and fits_one_frame(8192)
    assert not fits_one_frame(P.MAX_KEYS)  # keys and parents alone are over MAX_FRAME_BYTES
    assert fits_one_frame(P.MAX_KEYS // 2, [[1]] * (P.MAX_KEYS // 2))
    assert not fits_one_frame(4, [[1] * (1 << 17)] * 4)  # over MAX_BLOCK_IDS
