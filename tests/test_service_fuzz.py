"""Fuzz the cache service with 100,000+ random and mutated messages over its Unix socket.

The server must answer or skip every frame without crashing, keep serving, and
once the fuzzing connections are gone hold no slot, reservation, read
reference or lease (nothing leaks).
"""

from __future__ import annotations

import pytest

import random
import socket
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from conftest import payload_for, small_namespace
from kvtier import protocol as P
from service_helpers import connect, short_dir, start_server, wait_until  # noqa: F401 (fixture)

NUM_MESSAGES = 100_000
BATCH = 200
SENTINEL_BASE = 1 << 62
KEYS = [bytes([i + 1]) * 32 for i in range(8)]


def templates(ns: Any) -> list[dict[str, Any]]:
    """One valid body per op (keys from a small set, so stores and loads really happen)."""
    k = random.choice
    return [
        {"op": "lookup", "keys": b"".join(KEYS[: random.randint(0, 8)]), "owner": k(["r1", "r2", None])},
        {"op": "contains", "key": k(KEYS)},
        {"op": "release", "owner": k(["r1", "r2"])},
        {"op": "reserve", "key": k(KEYS)},
        {"op": "reserve_many", "keys": b"".join(random.sample(KEYS, random.randint(0, 3)))},
        {"op": "commit", "key": k(KEYS), "parent": k([None, *KEYS])},
        {"op": "abort", "key": k(KEYS)},
        {"op": "load", "key": k(KEYS), "parent": None},
        {"op": "load_many", "keys": b"".join(KEYS[:2]), "parents": [None, KEYS[0]]},
        {"op": "unload", "handle": random.randint(0, 40)},
        {"op": "prefetch", "keys": b"".join(KEYS[:3])},
        {"op": "record_request", "request_id": "r1", "prompt_tokens": 64},  # removed op: unknown_op
        {"op": "flush", "timeout_s": 0.01},
        {"op": "stats"},
        {"op": "clear"},
        {"op": "health"},
        {"op": "cuda_register", "handle": b"h" * 64, "size": 10, "dtype": "bf16", "device": 0},
        {"op": "register", "client_id": "x", "pid": 1, "namespace": P.namespace_to_wire(ns),
         "namespace_digest": ns.digest(), "chunk_bytes": ns.chunk_bytes},
    ]


def random_value(depth: int = 0) -> Any:
    r = random.random()
    if r < 0.15:
        return random.choice([0, 1, -1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, random.randint(-1000, 1000)])
    if r < 0.25:
        return random.choice([True, False, None])
    if r < 0.35:
        return random.choice([0.5, -1e308, float("inf"), float("nan"), 1e-9])
    if r < 0.55:
        return random.randbytes(random.choice([0, 1, 31, 32, 33, 64, 1000]))
    if r < 0.7:
        return random.choice(["", "x", "r1", "\u2603" * 10, "a" * 300, "cpu", "disk"])
    if r < 0.85 and depth < 3:
        return [random_value(depth + 1) for _ in range(random.randint(0, 4))]
    if depth < 3:
        return {random.choice(["op", "v", "id", "key", "keys", "x"]): random_value(depth + 1) for _ in range(3)}
    return 7


def fuzz_body(tpls: list[dict[str, Any]], rid: int) -> bytes:
    r = random.random()
    if r < 0.08:
        return random.randbytes(random.randint(0, 64))
    if r < 0.16:
        return msgpack.packb(random_value(), use_bin_type=True)
    msg = {"v": P.PROTOCOL_VERSION, "id": rid, **random.choice(tpls)}
    if r < 0.45:
        pass  # valid message
    elif r < 0.7:
        field = random.choice(list(msg))
        msg[field] = random_value()
    elif r < 0.8:
        msg.pop(random.choice(list(msg)))
    elif r < 0.88:
        msg["noreply"] = random_value() if random.random() < 0.5 else True
    else:
        body = bytearray(msgpack.packb(msg, use_bin_type=True))
        for _ in range(random.randint(1, 3)):
            body[random.randrange(len(body))] = random.randrange(256)
        return bytes(body)
    return msgpack.packb(msg, use_bin_type=True)


def read_frame(sock: socket.socket) -> dict[str, Any] | None:
    try:
        head = sock.recv(4, socket.MSG_WAITALL)
    except ConnectionResetError:  # the server hung up with our bytes unread
        return None
    if len(head) < 4:
        return None
    (n,) = P.HEADER.unpack(head)
    body = sock.recv(n, socket.MSG_WAITALL)
    return P.unpack_body(body)


def open_registered(path: Path) -> socket.socket:
    ns = small_namespace()
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(60)  # hang guard
    s.connect(str(path))
    s.sendall(P.encode_request(P.Register("fuzzer", 1, ns, ns.digest(), ns.chunk_bytes), 0))
    msg, fds, _, _ = socket.recv_fds(s, 4, 4)
    for fd in fds:
        import os

        os.close(fd)
    (n,) = P.HEADER.unpack(msg + s.recv(4 - len(msg), socket.MSG_WAITALL))
    assert P.unpack_body(s.recv(n, socket.MSG_WAITALL))["ok"]
    return s


@pytest.mark.slow
def test_fuzz_server_survives_and_leaks_nothing(short_dir: Path) -> None:
    random.seed(1234)
    ns = small_namespace()
    with start_server(short_dir, cpu_chunks=6, max_holds_per_client=16) as srv:
        path = short_dir / "s.sock"
        sock = open_registered(path)
        sent = replies = errors = reconnects = 0
        batch_no = 0
        codes: dict[str, int] = {}
        while sent < NUM_MESSAGES:
            tpls = templates(ns)
            frames = []
            for _ in range(BATCH):
                body = fuzz_body(tpls, random.randint(1, 1000))
                frames.append(P.HEADER.pack(len(body)) + body)
            # Now and then the stream itself is broken: an oversized length header.
            broken = random.random() < 0.02
            if broken:
                frames.append(P.HEADER.pack(P.MAX_FRAME_BYTES + 1 + random.randrange(1000)))
            sentinel = SENTINEL_BASE + batch_no
            batch_no += 1
            frames.append(P.encode_request(P.Health(), sentinel))
            sock.sendall(b"".join(frames))
            sent += len(frames)
            while True:
                reply = read_frame(sock)
                if reply is None:
                    assert broken, "server hung up on a well-framed stream"
                    break
                replies += 1
                errors += reply.get("ok") is False
                codes[str(reply.get("code"))] = codes.get(str(reply.get("code")), 0) + 1
                if reply.get("id") == sentinel:
                    assert not broken
                    srv.check_invariants()  # every frame of the batch is handled: holds/session invariants
                    break
            if broken:
                sock.close()
                reconnects += 1
                sock = open_registered(path)
        sock.close()
        assert sent >= NUM_MESSAGES and errors > sent // 4 and replies > sent // 2
        assert reconnects > 0
        assert "internal" not in codes, codes  # every bad message is caught by validation, not by luck
        assert codes.get("unknown_op", 0) > 0  # request accounting ops are gone from the protocol

        # Nothing leaked once the fuzzing connection is gone.
        wait_until(lambda: srv.num_sessions() == 0, what="fuzz sessions to end")
        host = srv.hosts()[0]
        m = host.manager
        assert srv.total_holds() == 0
        assert len(m.leases) == 0 and m.leases.pinned_keys == 0
        assert m.cpu.referenced_chunks() == 0
        assert host.pool.num_free + len(m.cpu) == host.pool.num_slots
        assert all(m.cpu.contains(k) for k in list(m.cpu._entries))  # no reservation left WRITING

        # And it still serves a well-behaved client end to end.
        c = connect(path)
        m.clear()
        key = b"\xee" * 32
        buf = c.open_write(key, None)
        assert buf is not None
        buf[:] = payload_for(key, c.chunk_bytes)
        c.commit(key, None)
        with c.open_read(key) as h:
            assert np.array_equal(h.buffer, payload_for(key, c.chunk_bytes))
        c.close()
