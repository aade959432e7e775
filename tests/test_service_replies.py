"""The client's typed replies (kvtier.protocol.replies): what the server sends decodes, what does not fit is BAD_REPLY."""

from __future__ import annotations

import msgspec
import pytest

from kvtier import protocol as P
from kvtier.protocol.framing import pack
from kvtier.protocol.replies import (
    HandleEntry,
    LoadBlocksReply,
    LoadManyReply,
    LookupReply,
    RegisterReply,
    ReserveManyReply,
    Segment,
    StoreBlocksReply,
    decode_reply,
)

DEC = {k: msgspec.msgpack.Decoder(k) for k in
       (LookupReply, LoadManyReply, ReserveManyReply, RegisterReply, StoreBlocksReply, LoadBlocksReply)}


def body(obj: dict) -> bytes:
    return pack(obj)[4:]


def test_ok_replies_decode_into_their_structs() -> None:
    r = decode_reply(DEC[LoadManyReply], body(P.ok_reply(3, handles=[[1, 4, "cpu"], None, [2, 5, "disk", 77]])))
    assert (r.id, r.ok) == (3, True)
    assert r.handles == [HandleEntry(1, 4, "cpu"), None, HandleEntry(2, 5, "disk", 77)]
    r2 = decode_reply(DEC[ReserveManyReply], body(P.ok_reply(4, slots=[0, None], skips=[0, 1])))
    assert (r2.slots, r2.skips) == ([0, None], [0, 1])
    assert decode_reply(DEC[LookupReply], body(P.ok_reply(5, tiers=b"cd"))).tiers == b"cd"
    assert decode_reply(DEC[StoreBlocksReply], body(P.ok_reply(6, skips=[0, 3]))).skips == [0, 3]
    assert decode_reply(DEC[LoadBlocksReply], body(P.ok_reply(7, sources=["cpu", None]))).sources == ["cpu", None]
    seg = {"size": 4096, "slot_bytes": 2048, "num_slots": 2, "fd": 0}
    reg = decode_reply(DEC[RegisterReply], body(P.ok_reply(0, segment=seg, server_pid=9, chunk_size=32)))
    assert reg.segment == Segment(4096, 2048, 2) and reg.server_pid == 9


def test_an_error_reply_decodes_into_the_same_struct() -> None:
    r = decode_reply(DEC[LoadManyReply], body(P.error_reply(8, P.ErrorCode.TOO_MANY_HOLDS, "full")))
    assert (r.id, r.ok, r.code, r.error, r.handles) == (8, False, "too_many_holds", "full", None)


@pytest.mark.parametrize(
    "kind, fields, path",
    [
        (LoadManyReply, {"handles": [[1, "four", "cpu"]]}, "$.handles[0]"),
        (LoadManyReply, {"handles": [[1, 4]]}, "$.handles[0]"),
        (LoadManyReply, {"handles": [[-1, 4, "cpu"]]}, "$.handles[0]"),
        (LoadManyReply, {"handles": [[1, 4, "cpu", "sum"]]}, "$.handles[0]"),
        (ReserveManyReply, {"slots": [0, "x"]}, "$.slots[1]"),
        (LookupReply, {"tiers": "cd"}, "$.tiers"),
        (LoadBlocksReply, {"sources": [3]}, "$.sources[0]"),
        (RegisterReply, {"segment": {"size": 1}}, "$.segment"),
    ],
)
def test_a_reply_that_does_not_fit_is_bad_reply_naming_the_field(kind: type, fields: dict, path: str) -> None:
    with pytest.raises(P.ProtocolError) as e:
        decode_reply(DEC[kind], body(P.ok_reply(1, **fields)))
    assert e.value.code == "bad_reply" and path in str(e.value)


def test_a_reply_without_id_or_ok_is_bad_reply() -> None:
    with pytest.raises(P.ProtocolError) as e:
        decode_reply(DEC[LookupReply], body({"v": P.PROTOCOL_VERSION, "ok": True}))
    assert e.value.code == "bad_reply" and "id" in str(e.value)
    with pytest.raises(P.ProtocolError):
        decode_reply(DEC[LookupReply], b"\xc1")
