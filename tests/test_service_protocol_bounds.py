"""Every bound of the cache-service requests: one smallest bad input each, on both decode paths.

The servers decode a request straight from its frame body (``decode_request_body``, msgspec);
``decode_request`` validates an unpacked map. Both must refuse each input below with the same
code, name the request id (it is valid in every case but the id cases) and name the field.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from conftest import small_namespace
from kvtier import protocol as P
from kvtier.protocol.fields import MAX_KEYS
from kvtier.protocol.framing import MAX_ARRAY_LEN
from kvtier.protocol.messages import MAX_BLOCK_IDS, MAX_KV_BUFFERS, MAX_KV_LAYERS

K1, K2 = b"\x01" * 32, b"\x02" * 32
NS = small_namespace()
REGISTER = {"op": "register", "client_id": "a", "pid": 1, "namespace": P.namespace_to_wire(NS),
            "namespace_digest": NS.digest(), "chunk_bytes": NS.chunk_bytes}
CUDA = {"op": "cuda_register", "handle": b"h" * 64, "size": 10, "dtype": "bfloat16", "device": 0}
SHM = {"name": "kv", "size": 4096}
KV_REGISTER = {"op": "kv_register", "kind": "shm", "buffers": [SHM], "shape": [2, 1, 16, 64],
               "layers": [[0, 0, 1024, 1024, 64]]}
STORE = {"op": "store_blocks", "keys": K1 + K2, "blocks": [[0], [1]]}
LOAD_BLOCKS = {"op": "load_blocks", "keys": K1 + K2, "parents": [None, K1], "blocks": [[0], [1]], "offsets": [0, 0]}
LOAD_MANY = {"op": "load_many", "keys": K1 + K2, "parents": [None, K1]}


def with_(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = {**base, **changes}
    return {k: v for k, v in out.items() if v is not DROP}


DROP = object()


def ns_wire(**changes: Any) -> dict[str, Any]:
    w = P.namespace_to_wire(NS)
    for k, v in changes.items():
        if k in w["layout"]:
            w["layout"][k] = v
        else:
            w[k] = v
    return w


def refused(fields: dict[str, Any]) -> list[P.ProtocolError]:
    """The errors of both decode paths for the body ``{"v", "id": 1, **fields}``."""
    raw = msgpack.packb({"v": P.PROTOCOL_VERSION, "id": 1, **fields}, use_bin_type=True)
    out = []
    for decode in (lambda: P.decode_request_body(raw), lambda: P.decode_request(P.unpack_body(raw))):
        with pytest.raises(P.ProtocolError) as e:
            decode()
        out.append(e.value)
    return out


# (body fields, the field the error names)
BAD_FIELDS = [
    # register
    (with_(REGISTER, client_id=""), "client_id"),
    (with_(REGISTER, client_id="c" * (P.MAX_NAME_CHARS + 1)), "client_id"),
    (with_(REGISTER, pid=-1), "pid"),
    (with_(REGISTER, pid=(1 << 31) + 1), "pid"),
    (with_(REGISTER, namespace_digest=b"d" * 31), "namespace_digest"),
    (with_(REGISTER, chunk_bytes=0), "chunk_bytes"),
    (with_(REGISTER, chunk_bytes=(1 << 34) + 1), "chunk_bytes"),
    (with_(REGISTER, token=""), "token"),
    (with_(REGISTER, token="t" * (P.MAX_NAME_CHARS + 1)), "token"),
    (with_(REGISTER, namespace=ns_wire(block_size=0)), "block_size"),
    (with_(REGISTER, namespace=ns_wire(num_layers=(1 << 20) + 1)), "num_layers"),
    (with_(REGISTER, namespace=ns_wire(engine="")), "engine"),
    (with_(REGISTER, namespace=ns_wire(model="m" * 1025)), "model"),
    (with_(REGISTER, namespace=ns_wire(rank=-1)), "rank"),
    (with_(REGISTER, namespace=ns_wire(chunk_size=(1 << 20) + 32)), "chunk_size"),
    (with_(REGISTER, namespace=DROP), "namespace"),
    # key lists (lookup, prefetch)
    ({"op": "lookup", "keys": b"k" * 31}, "keys"),
    ({"op": "lookup", "keys": b"k" * 32 * (MAX_KEYS + 1)}, "keys"),
    ({"op": "lookup", "keys": "k" * 32}, "keys"),
    ({"op": "lookup"}, "keys"),
    ({"op": "lookup", "keys": K1, "owner": ""}, "owner"),
    ({"op": "lookup", "keys": K1, "owner": "o" * (P.MAX_NAME_CHARS + 1)}, "owner"),
    ({"op": "prefetch", "keys": b"k" * 33}, "keys"),
    # one key
    ({"op": "contains", "key": b"k" * 31}, "key"),
    ({"op": "reserve", "key": b"k" * 33}, "key"),
    ({"op": "abort"}, "key"),
    ({"op": "release", "owner": ""}, "owner"),
    ({"op": "release", "owner": "o" * (P.MAX_NAME_CHARS + 1)}, "owner"),
    ({"op": "commit", "key": K1, "parent": b"p" * 31}, "parent"),
    ({"op": "commit", "key": K1, "parent": K1}, "parent"),
    ({"op": "load", "key": K1, "parent": K1}, "parent"),
    # reserve_many / load_many
    ({"op": "reserve_many", "keys": K1 + K1}, "keys"),
    ({"op": "reserve_many", "keys": K1 + K2, "parents": [None]}, "parents"),
    ({"op": "reserve_many", "keys": K1 + K2, "parents": [None, b"p" * 31]}, "parents"),
    ({"op": "reserve_many", "keys": K1 + K2, "parents": [None, K2]}, "parents"),
    (with_(LOAD_MANY, parents=DROP), "parents"),
    (with_(LOAD_MANY, parents=[None]), "parents"),
    (with_(LOAD_MANY, parents=[K1, K1]), "parents"),
    (with_(LOAD_MANY, client_verifies=1), "client_verifies"),
    # unload, flush
    ({"op": "unload", "handle": -1}, "handle"),
    ({"op": "unload", "handle": 1 << 63}, "handle"),
    ({"op": "unload", "handle": True}, "handle"),
    ({"op": "unload", "handle": 1, "corrupt": 1}, "corrupt"),
    ({"op": "flush", "timeout_s": -0.001}, "timeout_s"),
    ({"op": "flush", "timeout_s": 60.001}, "timeout_s"),
    ({"op": "flush", "timeout_s": float("nan")}, "timeout_s"),
    ({"op": "flush", "timeout_s": float("inf")}, "timeout_s"),
    ({"op": "flush"}, "timeout_s"),
    # cuda_register (and the same form inside kv_register)
    (with_(CUDA, handle=b""), "handle"),
    (with_(CUDA, handle=b"h" * 257), "handle"),
    (with_(CUDA, size=0), "size"),
    (with_(CUDA, dtype=""), "dtype"),
    (with_(CUDA, dtype="d" * 33), "dtype"),
    (with_(CUDA, device=-1), "device"),
    (with_(CUDA, device=1025), "device"),
    (with_(CUDA, offset=-1), "offset"),
    (with_(CUDA, ref_counter_handle=b"r" * 257), "ref_counter_handle"),
    (with_(CUDA, ref_counter_offset=-1), "ref_counter_offset"),
    (with_(CUDA, event_handle=b"e" * 257), "event_handle"),
    (with_(CUDA, event_sync_required=1), "event_sync_required"),
    # kv_register
    (with_(KV_REGISTER, kind="gpu"), "kind"),
    (with_(KV_REGISTER, buffers=[]), "buffers"),
    (with_(KV_REGISTER, buffers=[SHM] * (MAX_KV_BUFFERS + 1)), "buffers"),
    (with_(KV_REGISTER, buffers=[7]), "buffers"),
    (with_(KV_REGISTER, buffers=[{"name": "", "size": 1}]), "name"),
    (with_(KV_REGISTER, buffers=[{"name": "n" * 129, "size": 1}]), "name"),
    (with_(KV_REGISTER, buffers=[{"name": "kv", "size": 0}]), "size"),
    (with_(KV_REGISTER, kind="cuda", buffers=[{**CUDA, "device": 1025}]), "device"),
    (with_(KV_REGISTER, shape=[2, 1, 16]), "shape"),
    (with_(KV_REGISTER, shape=[2, 1, 0, 64]), "shape"),
    (with_(KV_REGISTER, layers=[]), "layers"),
    (with_(KV_REGISTER, layers=[[0, 0, 1, 1, 1]] * (MAX_KV_LAYERS + 1)), "layers"),
    (with_(KV_REGISTER, layers=[[0, 0, 1, 1]]), "layers"),
    (with_(KV_REGISTER, layers=[[0, -1, 1, 1, 1]]), "layers"),
    (with_(KV_REGISTER, layers=[[1, 0, 1, 1, 1]]), "layers"),  # buffer index outside buffers
    # store_blocks / load_blocks
    (with_(STORE, keys=K1 + K1), "keys"),
    (with_(STORE, blocks=[[0]]), "blocks"),
    (with_(STORE, blocks=[[0], []]), "blocks"),
    (with_(STORE, blocks=[[0], [-1]]), "blocks"),
    # more than MAX_BLOCK_IDS in all (one list is at most MAX_ARRAY_LEN long: the framing's bound)
    (with_(STORE, keys=b"".join(bytes([i]) * 32 for i in range(17)), blocks=[[0] * MAX_ARRAY_LEN] * 17), "blocks"),
    (with_(STORE, parents=[None, K2]), "parents"),
    (with_(LOAD_BLOCKS, parents=DROP), "parents"),
    (with_(LOAD_BLOCKS, parents=[K1, K1]), "parents"),
    (with_(LOAD_BLOCKS, blocks=[[0]]), "blocks"),
    (with_(LOAD_BLOCKS, offsets=[0]), "offsets"),
    (with_(LOAD_BLOCKS, offsets=[0, 1 << 20]), "offsets"),
    (with_(LOAD_BLOCKS, offsets=[0, -1]), "offsets"),
]


@pytest.mark.parametrize("fields, name", BAD_FIELDS, ids=[f"{f['op']}-{n}-{i}" for i, (f, n) in enumerate(BAD_FIELDS)])
def test_each_bound_refuses_its_smallest_bad_input(fields: dict[str, Any], name: str) -> None:
    for exc in refused(fields):
        assert exc.code == "bad_message" and exc.req_id == 1, (exc.code, exc.req_id, str(exc))
        assert name in str(exc), str(exc)


@pytest.mark.parametrize(
    "obj, code, req_id",
    [
        ({"v": P.PROTOCOL_VERSION, "op": "health"}, "bad_message", -1),
        ({"v": P.PROTOCOL_VERSION, "op": "health", "id": -1}, "bad_message", -1),
        ({"v": P.PROTOCOL_VERSION, "op": "health", "id": 1 << 63}, "bad_message", -1),
        ({"v": P.PROTOCOL_VERSION, "op": "health", "id": True}, "bad_message", -1),
        ({"v": P.PROTOCOL_VERSION - 1, "op": "health", "id": 4}, "bad_version", 4),
        ({"op": "health", "id": 4}, "bad_version", 4),
        ({"v": P.PROTOCOL_VERSION, "op": "nope", "id": 4}, "unknown_op", 4),
        ({"v": P.PROTOCOL_VERSION, "op": None, "id": 4}, "unknown_op", 4),
        ({"v": P.PROTOCOL_VERSION, "op": "lookup", "id": 4, "keys": b"", "noreply": True}, "bad_message", 4),
        ({"v": P.PROTOCOL_VERSION, "op": "unload", "id": 4, "handle": 1, "noreply": 1}, "bad_message", 4),
    ],
)
def test_envelope_errors_name_the_id_when_it_is_valid(obj: dict[str, Any], code: str, req_id: int) -> None:
    raw = msgpack.packb(obj, use_bin_type=True)
    for decode in (lambda: P.decode_request_body(raw), lambda: P.decode_request(P.unpack_body(raw))):
        with pytest.raises(P.ProtocolError) as e:
            decode()
        assert (e.value.code, e.value.req_id) == (code, req_id)


@pytest.mark.parametrize(
    "raw, code",
    [
        (b"", "bad_msgpack"),
        (b"abc", "bad_msgpack"),  # an int, then trailing bytes
        (msgpack.packb([1, 2]), "bad_message"),  # not a map
        (msgpack.packb({1: 2}), "bad_msgpack"),
        (msgpack.packb({"v": P.PROTOCOL_VERSION, "id": 1, "op": msgpack.ExtType(1, b"x")}), "bad_msgpack"),
        (msgpack.packb({"v": P.PROTOCOL_VERSION, "id": 1, "op": "health"}) + b"\x00", "bad_msgpack"),
        (b"\x81\xa2op" + b"\x91" * 100_000, "bad_msgpack"),  # nested deeper than any decoder goes
    ],
)
def test_undecodable_bodies_get_the_codes_of_the_map_path(raw: bytes, code: str) -> None:
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request_body(raw)
    assert e.value.code == code


def test_the_body_path_decodes_what_the_map_path_does() -> None:
    reqs: list[P.Request] = [
        P.Register("engine-a", 123, NS, NS.digest(), NS.chunk_bytes, "tok"),
        P.Lookup([K1, K2], "o"), P.LoadMany([K1, K2], [None, K1], True), P.ReserveMany([K1, K2], [None, K1]),
        P.Unload(3, True), P.Flush(0), P.Flush(60.0),
        P.KVRegister("shm", [P.ShmBuffer("kv", 4096)], (2, 1, 16, 64), [(0, 0, 1024, 1024, 64)]),
        P.KVRegister("cuda", [P.CudaRegister(b"h", 1, "bfloat16", 0, offset=5)], (1, 1, 1, 1), [(0, 0, 0, 0, 0)]),
        P.StoreBlocks([K1, K2], [[0, 1], [2]], [None, K1]), P.StoreBlocks([K1], [[0]]),
        P.LoadBlocks([K1, K2], [None, K1], [[0], [1, 2]], [0, (1 << 20) - 1]), P.KVRelease(),
        P.Lookup([bytes([i % 251]) + bytes(31) for i in range(MAX_KEYS)], None),
    ]
    for req in reqs:
        frame = P.encode_request(req, 9)
        env, back = P.decode_request_body(frame[4:])
        assert (env, back) == (P.Envelope(9, False), req) == P.decode_request(P.unpack_body(frame[4:]))
        assert type(back) is type(req) and back.OP == req.OP


def test_keys_travel_as_one_binary_and_the_envelope_is_unchanged() -> None:
    frame = P.encode_request(P.Commit(K2, K1), 5, noreply=True)
    body = msgpack.unpackb(frame[4:])
    assert body == {"v": P.PROTOCOL_VERSION, "op": "commit", "id": 5, "noreply": True, "key": K2, "parent": K1}
    body = msgpack.unpackb(P.encode_request(P.LoadMany([K1, K2], [None, K1]), 6)[4:])
    assert body["keys"] == K1 + K2 and body["parents"] == [None, K1]


def test_a_request_its_own_rules_refuse_is_refused_when_built() -> None:
    with pytest.raises(ValueError, match="distinct"):
        P.ReserveMany([K1, K1])
    with pytest.raises(ValueError, match="own parent"):
        P.LoadMany([K1], [K1])
