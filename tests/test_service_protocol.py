"""Cache service protocol: round trips, bounds and validation; the shared-memory pool."""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest

from conftest import small_namespace
from kvtier.memory.pool import ChunkPool
from kvtier import protocol as P
from kvtier.memory.shared_segment import SharedSegment
from kvtier.tiers.cpu import CpuTier

K1, K2 = b"\x01" * 32, b"\x02" * 32


def roundtrip(req: P.Request, noreply: bool = False) -> tuple[P.Envelope, P.Request]:
    frame = P.encode_request(req, 7, noreply)
    (n,) = P.HEADER.unpack(frame[:4])
    assert n == len(frame) - 4
    return P.decode_request(P.unpack_body(frame[4:]))


@pytest.mark.parametrize(
    "req",
    [
        P.Register("engine-a", 123, small_namespace(), small_namespace().digest(), 2048, None),
        P.Register("engine-a", 1, small_namespace(), small_namespace().digest(), 2048, "secret"),
        P.Lookup([K1, K2], "req-1"),
        P.Lookup([], None),
        P.Prefetch([K1]),
        P.Contains(K1),
        P.ReleaseLease("req-1"),
        P.Reserve(K1),
        P.Commit(K1, None),
        P.Commit(K2, K1),
        P.Abort(K1),
        P.Load(K2, K1),
        P.LoadMany([K1, K2], [None, K1]),
        P.ReserveMany([K1, K2]),
        P.ReserveMany([K1, K2], [None, K1]),
        P.Unload(5),
        P.Flush(2.5),
        P.Stats(),
        P.Clear(),
        P.Health(),
        P.CudaRegister(b"h" * 64, 1 << 20, "bfloat16", 0),
    ],
    ids=lambda r: r.OP + ("+parents" if getattr(r, "parents", None) else ""),
)
def test_every_request_round_trips(req: P.Request) -> None:
    env, back = roundtrip(req)
    assert env == P.Envelope(7, False)
    assert back == req


def test_one_way_flag_only_for_one_way_ops() -> None:
    env, _ = roundtrip(P.Unload(3), noreply=True)
    assert env.noreply
    with pytest.raises(P.ProtocolError) as e:
        roundtrip(P.Lookup([K1]), noreply=True)
    assert e.value.req_id == 7


def body(**fields: object) -> dict:
    return {"v": P.PROTOCOL_VERSION, "id": 1, **fields}


@pytest.mark.parametrize(
    "obj, code",
    [
        ({"v": P.PROTOCOL_VERSION, "op": "health"}, "bad_message"),  # no id
        (body(op="health", v=1), "bad_version"),  # version 1 had the accounting ops
        (body(op="health", v=P.PROTOCOL_VERSION + 1), "bad_version"),
        (body(op="nope"), "unknown_op"),
        (body(op=3), "unknown_op"),
        (body(op="contains", key=b"short"), "bad_message"),
        (body(op="contains", key="x" * 32), "bad_message"),  # str, not bin
        (body(op="lookup", keys=b"x" * 33), "bad_message"),  # not a multiple of 32
        (body(op="lookup", keys=b"x" * 32 * (P.MAX_KEYS + 1)), "bad_message"),
        (body(op="lookup", keys=b"", owner="o" * (P.MAX_NAME_CHARS + 1)), "bad_message"),
        (body(op="unload", handle=True), "bad_message"),  # bool is not an int
        (body(op="unload", handle=-1), "bad_message"),
        (body(op="flush", timeout_s=1e9), "bad_message"),
        (body(op="record_request", request_id="r", prompt_tokens=1), "unknown_op"),  # accounting: the connector's
        (body(op="get_request", request_id="r"), "unknown_op"),
        (body(op="flush", timeout_s=float("nan")), "bad_message"),
        (body(op="register", client_id="a", pid=1, namespace={"model": "m"}, namespace_digest=b"d" * 32,
              chunk_bytes=1), "bad_message"),
        (body(op="health", noreply=1), "bad_message"),
        (body(op="commit", key=K1, parent=K1), "bad_message"),  # found by the fuzz test
        (body(op="load_many", keys=K1 + K2, parents=[None]), "bad_message"),
        (body(op="reserve_many", keys=K1 + K2, parents=[None]), "bad_message"),
        (body(op="reserve_many", keys=K1 + K2, parents=[None, K2]), "bad_message"),  # own parent
    ],
)
def test_invalid_messages_are_refused_with_a_code(obj: dict, code: str) -> None:
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(P.unpack_body(msgpack.packb(obj, use_bin_type=True)))
    assert e.value.code == code


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        msgpack.packb([1, 2, 3]),  # not a map
        msgpack.packb({1: 2}),  # non-string map key
        msgpack.packb(msgpack.ExtType(5, b"x")),
        msgpack.packb({"a": 1}) + b"trailing",
        b"\xdd\xff\xff\xff\xff",  # array header claiming 4G items
        b"\xa3\xff\xfe\xfd",  # invalid utf-8 string
    ],
)
def test_undecodable_bodies_raise_protocol_error(raw: bytes) -> None:
    with pytest.raises(P.ProtocolError):
        P.unpack_body(raw)


def test_namespace_travels_exactly() -> None:
    ns = small_namespace(rank=1, world_size=2)
    back = P.namespace_from_wire(msgpack.unpackb(msgpack.packb(P.namespace_to_wire(ns))))
    assert back == ns and back.digest() == ns.digest()
    bad = P.namespace_to_wire(ns)
    bad["layout"]["block_size"] = 0
    with pytest.raises(P.ProtocolError):
        P.namespace_from_wire(bad)
    bad = P.namespace_to_wire(ns)
    bad["extra"] = 1
    with pytest.raises(P.ProtocolError):
        P.namespace_from_wire(bad)


def test_pack_refuses_oversized_messages() -> None:
    with pytest.raises(P.ProtocolError):
        P.pack({"x": b"a" * (P.MAX_FRAME_BYTES + 1)})


# -- shared-memory pool -----------------------------------------------------------------------
def test_segment_is_shared_between_mappings() -> None:
    seg = SharedSegment.create(3 * 4096)
    other = SharedSegment.attach_fd(os.dup(seg.fd), 3 * 4096)
    try:
        seg.array[100:104] = [9, 8, 7, 6]
        assert list(other.array[100:104]) == [9, 8, 7, 6]
        other.array[5000] = 42
        assert seg.array[5000] == 42
        assert (seg.array[:10] == 1).all()  # pre-touched
    finally:
        other.close()
        seg.close()


def test_pool_over_external_buffer_and_slot_of() -> None:
    seg = SharedSegment.create(4 * 2048)
    pool = ChunkPool(2048, 4, buffer=seg.array)
    slots = [pool.alloc() for _ in range(4)]
    for s in slots:
        assert pool.slot_of(pool.view(s)) == s
    pool.view(slots[2])[:] = 5
    assert (seg.array[slots[2] * 2048 : (slots[2] + 1) * 2048] == 5).all()
    with pytest.raises(ValueError):
        pool.slot_of(pool.view(1)[1:])
    with pytest.raises(ValueError):
        ChunkPool(2048, 5, buffer=seg.array)  # too small
    with pytest.raises(ValueError):
        ChunkPool(2048, 1, buffer=bytes(2048))  # read-only
    del pool, slots
    seg.close()


def test_cpu_tier_uses_an_injected_pool() -> None:
    pool = ChunkPool(2048, 2, buffer=np.zeros(4096, dtype=np.uint8))
    tier = CpuTier(2048, 10**9, pool=pool)  # capacity comes from the pool
    assert tier.capacity_bytes == 4096
    assert tier.reserve(K1) is not None and tier.reserve(K2) is not None
    tier.commit(K1)
    tier.commit(K2)
    assert tier.reserve(b"\x03" * 32) is not None  # evicts: the bound is the pool
    assert len(tier) == 2
    with pytest.raises(ValueError):
        CpuTier(1024, 4096, pool=pool)


# -- the one tier table --------------------------------------------------------------------
def test_tier_table_covers_every_tier_kind() -> None:
    from kvtier.storage.types import TIER_KINDS

    assert set(P.TIER_CODES) == set(TIER_KINDS)  # remote and peer included: the lookup RPC's table had neither
    codes = P.encode_tiers(list(TIER_KINDS))
    assert len(codes) == len(TIER_KINDS) and P.decode_tiers(codes) == list(TIER_KINDS)
    assert P.decode_tiers(b"cx") is None  # an unknown code voids the reply, never a guessed tier
    with pytest.raises(P.ProtocolError) as e:
        P.encode_tiers(["cpu", "tape"])
    assert e.value.code == "internal"


def test_backoff_doubles_with_jitter_and_resets() -> None:
    b = P.Backoff(0.1, 0.4)
    delays = [b.next_delay() for _ in range(4)]
    assert 0.05 <= delays[0] <= 0.1 and 0.1 <= delays[1] <= 0.2 and all(0.2 <= d <= 0.4 for d in delays[2:])
    assert b.waiting()
    b.reset()
    assert not b.waiting() and b.next_delay() <= 0.1
    with pytest.raises(ValueError):
        P.Backoff(0.0, 1.0)


def test_socket_dir_must_be_private(tmp_path) -> None:
    d = tmp_path / "run"
    P.make_socket_dir(str(d / "s.sock"))
    assert (d.stat().st_mode & 0o777) == 0o700
    d.chmod(0o770)
    with pytest.raises(P.UnsafeSocketDir, match="group/other-writable"):
        P.check_socket_dir(str(d / "s.sock"))
    d.chmod(0o1777)  # a shared /tmp-like directory
    with pytest.raises(P.UnsafeSocketDir):
        P.check_socket_dir(str(d / "s.sock"))


def test_service_protocol_module_still_importable() -> None:
    from kvtier.service import protocol as old

    assert old.Lookup is P.Lookup and old.TIER_CODES is P.TIER_CODES
