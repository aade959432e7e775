"""Transfer channels (shared memory, TCP) behind one interface: round trips, destinations, misses, errors."""

from __future__ import annotations

import functools
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np
import pytest
import xxhash

from kvtier.memory.shared_segment import SharedSegment
from kvtier.transfer.channel import TransferChannel
from kvtier.transfer.errors import (
    PeerGone,
    ProtocolError,
    TransferError,
    TransferTimeout,
)
from kvtier.transfer.frames import PREFIX, Batch, Chunk, Hello, encode_frame
from kvtier.transfer.shm import STAGING_WINDOW_BYTES, ShmChannel
from kvtier.transfer.shm_listener import ShmListener
from kvtier.transfer.tcp import TcpChannel, TcpListener

KINDS = ["shm", "tcp", "nixl"]


@functools.cache
def _nixl_missing() -> str | None:
    try:
        from kvtier.transfer.nixl import nixl_agent_class

        nixl_agent_class()
        return None
    except TransferError as exc:
        return str(exc)



def _key(i: int) -> bytes:
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little")) * 2


def _chunks(n: int, size: int, seed: int = 0) -> list[tuple[bytes, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(_key(i), rng.integers(0, 256, size, dtype=np.uint8)) for i in range(n)]


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as ex:
        yield ex


def _connect(kind: str, pool: ThreadPoolExecutor, timeout_s: float = 10.0, **kw) -> tuple[TransferChannel, TransferChannel]:
    """(sender end, receiver end), connected through a real listener."""
    if kind == "nixl" and _nixl_missing():
        pytest.skip(f"nixl channel: {_nixl_missing()}")
    if kind == "shm":
        listener = ShmListener(timeout_s=timeout_s, **kw)
        fut = pool.submit(listener.accept)
        a = ShmChannel.connect(listener.path, timeout_s, **kw)
    elif kind == "nixl":
        from kvtier.transfer.nixl import NixlChannel
        from kvtier.transfer.nixl_listener import NixlListener

        listener = NixlListener(timeout_s=timeout_s)
        fut = pool.submit(listener.accept)
        a = NixlChannel.connect(*listener.address, timeout_s=timeout_s)
    else:
        listener = TcpListener(timeout_s=timeout_s)
        fut = pool.submit(listener.accept)
        a = TcpChannel.connect(*listener.address, timeout_s=timeout_s)
    b = fut.result(10)
    listener.close()
    return a, b


@pytest.fixture(params=KINDS)
def link(request, pool) -> Iterator[tuple[TransferChannel, TransferChannel]]:
    a, b = _connect(request.param, pool, staging_bytes=8 << 20) if request.param == "shm" else _connect(request.param, pool)
    yield a, b
    a.close()
    b.close()


def _transfer(pool, a, b, chunks, dests, **kw):
    fut = pool.submit(b.recv_into, dests, **kw)
    sent = a.send(chunks)
    return sent, fut.result(30)


def test_round_trip_many_chunks_bytes_identical_into_given_buffers(link, pool):
    a, b = link
    chunks = _chunks(40, 300_000 + 17)
    # Destinations are slices of one arena with guard bytes around each: the channel must
    # write exactly those buffers, nothing else.
    size, guard = len(chunks[0][1]), 64
    arena = np.full(len(chunks) * (size + guard) + guard, 0xAB, dtype=np.uint8)
    dests = [(k, arena[guard + i * (size + guard):][:size]) for i, (k, _) in enumerate(chunks)]
    sent, got = _transfer(pool, a, b, chunks, dests)
    assert sent == [True] * 40 and got == [True] * 40
    for (_, d), (_, p) in zip(dests, chunks):
        assert np.shares_memory(d, arena) and np.array_equal(d, p)
    for i in range(len(chunks) + 1):
        assert (arena[i * (size + guard):][:guard] == 0xAB).all()
    assert b.stats()["chunks_received"] == 40 and a.stats()["chunks_delivered"] == 40


def test_large_chunk_and_reuse_of_the_link(link, pool):
    a, b = link
    big = _chunks(1, 24 << 20, seed=3)  # 3x the shm staging ring in the fixture: must lie in a shared segment
    if a.kind == "shm":
        seg = SharedSegment.create(24 << 20, sparse=True)
        seg.array[:] = big[0][1]
        a.share_segment(seg)
        big = [(big[0][0], seg.array)]
    out = np.zeros(24 << 20, dtype=np.uint8)
    sent, got = _transfer(pool, a, b, big, [(big[0][0], out)])
    assert sent == [True] and got == [True] and np.array_equal(out, big[0][1])
    small = _chunks(3, 1000, seed=4)  # the same link again, other chunks
    outs = [(k, np.zeros(1000, np.uint8)) for k, _ in small]
    assert _transfer(pool, a, b, small, outs)[1] == [True] * 3
    assert all(np.array_equal(o, p) for (_, o), (_, p) in zip(outs, small))


def _backed_bytes(seg: SharedSegment) -> int:
    """Bytes of a sparse segment whose pages exist (tmpfs counts allocated 512-byte blocks)."""
    assert seg.fd is not None
    return os.fstat(seg.fd).st_blocks * 512


@pytest.mark.slow
@pytest.mark.parametrize("chunk_mib", [4, 40])
def test_shm_batches_reuse_the_first_pages_of_the_staging_ring(pool, chunk_mib):
    """However far the sender could run ahead, a batch cycles through the ring's first
    STAGING_WINDOW_BYTES (or its largest payload): every later batch finds warm pages."""
    a, b = _connect("shm", pool, staging_bytes=256 << 20)
    size = chunk_mib << 20
    n = max(3, (96 << 20) // size)  # 96 MiB or more in one batch: 3x the window
    chunks = _chunks(n, size, seed=5)
    outs = [(k, np.zeros(size, np.uint8)) for k, _ in chunks]
    for _ in range(2):
        fut = pool.submit(lambda: (time.sleep(0.3), b.recv_into(outs))[1])  # the sender runs ahead meanwhile
        assert a.send(chunks) == [True] * n and fut.result(30) == [True] * n
        assert all(np.array_equal(o, p) for (_, o), (_, p) in zip(outs, chunks))
        assert a._staging is not None
        assert _backed_bytes(a._staging) <= max(STAGING_WINDOW_BYTES, size) + (1 << 20)
    a.close()
    b.close()


def test_shm_payload_in_shared_segment_is_not_staged(pool):
    a, b = _connect("shm", pool, staging_bytes=1 << 20)
    seg = SharedSegment.create(4 << 20)
    seg.array[:] = np.arange(4 << 20, dtype=np.uint64).astype(np.uint8)
    a.share_segment(seg)
    chunks = [(_key(i), seg.array[i << 20 : (i + 1) << 20]) for i in range(4)]
    dests = [(k, np.zeros(1 << 20, np.uint8)) for k, _ in chunks]
    sent, got = _transfer(pool, a, b, chunks, dests)
    assert got == [True] * 4 and all(np.array_equal(d, p) for (_, d), (_, p) in zip(dests, chunks))
    assert a._staging is None  # nothing was copied on the sender's side
    with pytest.raises(ValueError, match="staging ring"):
        a.send([(_key(9), np.zeros(2 << 20, np.uint8))])  # private payload larger than the ring
    a.close(), b.close(), seg.close()


def test_shm_verifies_staged_payloads_inline_and_shares_shared_ones_with_the_helper(pool, monkeypatch):
    """Payloads the sender stages (P2P: a CPU tier is no shared segment) are hashed inline by the
    receiver (a third thread on two cores slowed the staged path from 0.74x to 0.53x memcpy);
    payloads in a shared segment: the helper thread takes one, and while it is busy the
    receiving thread copies the following ones. Every one is verified, acks stay in order."""
    import threading

    from kvtier.transfer import verify

    calls: list[bool] = []
    real_copy, real_hash = verify.Verifier.copy, verify.copy_and_hash
    gate = threading.Event()

    def spy(self, index, slot, src, dst, expected, overlap=True):
        calls.append(overlap)
        if calls[1:] == [False, False, False]:
            gate.set()  # the helper's chunk may finish only after three inline copies
        return real_copy(self, index, slot, src, dst, expected, overlap=overlap)

    def gated_hash(src, dst):
        if threading.current_thread().name.startswith("kvtier-verify"):
            gate.wait(5)
        return real_hash(src, dst)

    monkeypatch.setattr(verify.Verifier, "copy", spy)
    monkeypatch.setattr(verify, "copy_and_hash", gated_hash)
    a, b = _connect("shm", pool, staging_bytes=8 << 20)
    seg = SharedSegment.create(8 << 20)
    seg.array[:] = np.random.default_rng(6).integers(0, 256, 8 << 20, dtype=np.uint8)
    a.share_segment(seg)
    staged = _chunks(2, 2 << 20, seed=5)
    shared = [(_key(50 + i), seg.array[i << 21 : (i + 1) << 21], xxhash.xxh3_64_digest(seg.array[i << 21 : (i + 1) << 21]))
              for i in range(4)]
    for chunks, want in ((staged, [False, False]), (shared, [True, False, False, False])):
        calls.clear()
        dests = [(c[0], np.zeros(len(c[1]), np.uint8)) for c in chunks]
        assert _transfer(pool, a, b, chunks, dests) == ([True] * len(chunks), [True] * len(chunks))
        assert all(np.array_equal(d, c[1]) for (_, d), c in zip(dests, chunks))
        assert calls == want
    assert gate.is_set()
    a.close(), b.close(), seg.close()


def test_shm_overlap_off_copies_every_chunk_on_the_calling_thread(pool, monkeypatch):
    import threading

    from kvtier.transfer import verify

    threads: list[str] = []
    real_hash = verify.copy_and_hash

    def spy(src, dst):
        threads.append(threading.current_thread().name)
        return real_hash(src, dst)

    monkeypatch.setattr(verify, "copy_and_hash", spy)
    a, b = _connect("shm", pool)
    b.overlap = False
    seg = SharedSegment.create(4 << 20)
    seg.array[:] = 5
    a.share_segment(seg)
    chunks = [(_key(i), seg.array[i << 21 : (i + 1) << 21]) for i in range(2)]
    dests = [(c[0], np.zeros(2 << 20, np.uint8)) for c in chunks]
    assert _transfer(pool, a, b, chunks, dests)[1] == [True, True]
    assert len(threads) == 2 and not any(t.startswith("kvtier-verify") for t in threads)
    a.close(), b.close(), seg.close()


@pytest.mark.parametrize("bad", [0, 1, 3])
def test_shm_corrupt_chunk_among_shared_ones_is_the_only_miss(pool, bad):
    """A wrong checksum on the helper thread's chunk (even index) or on this thread's (odd) is
    caught either way; the other chunks of the pair still count."""
    a, b = _connect("shm", pool)
    seg = SharedSegment.create(6 << 20)
    seg.array[:] = np.random.default_rng(bad).integers(0, 256, 6 << 20, dtype=np.uint8)
    a.share_segment(seg)
    views = [seg.array[i * (3 << 19) : (i + 1) * (3 << 19)] for i in range(4)]
    chunks = [(_key(i), v, b"\0" * 8 if i == bad else xxhash.xxh3_64_digest(v)) for i, v in enumerate(views)]
    dests = [(_key(i), np.zeros(3 << 19, np.uint8)) for i in range(4)]
    sent, got = _transfer(pool, a, b, chunks, dests)
    want = [i != bad for i in range(4)]
    assert got == want and sent == want and b.stats()["corrupt"] == 1
    assert all(np.array_equal(d, v) for i, ((_, d), v) in enumerate(zip(dests, views)) if i != bad)
    a.close(), b.close(), seg.close()


def test_shm_frames_of_shared_chunks_leave_in_one_write(pool, monkeypatch):
    """Chunks in a shared segment with known checksums: the batch frame and every chunk frame go
    out in one write (the receiver finds the next frame ready and copies two at once)."""
    a, b = _connect("shm", pool)
    seg = SharedSegment.create(4 << 20)
    seg.array[:] = 3
    a.share_segment(seg)
    writes: list[int] = []
    real = ShmChannel._send_views

    def spy(self, views, deadline, fds=()):
        if self is a:
            writes.append(len(views))
        return real(self, views, deadline, fds)

    monkeypatch.setattr(ShmChannel, "_send_views", spy)
    chunks = [(_key(i), seg.array[i << 20 : (i + 1) << 20], xxhash.xxh3_64_intdigest(seg.array[i << 20 : (i + 1) << 20]))
              for i in range(4)]
    dests = [(c[0], np.zeros(1 << 20, np.uint8)) for c in chunks]
    assert _transfer(pool, a, b, chunks, dests)[1] == [True] * 4
    assert writes == [5]  # Batch + 4 Chunk frames, one sendmsg
    a.close(), b.close(), seg.close()


def test_copy_and_hash_matches_xxh3_for_any_size():
    from kvtier.transfer.verify import PIECE_BYTES, copy_and_hash

    rng = np.random.default_rng(9)
    for n in (0, 1, PIECE_BYTES - 1, PIECE_BYTES, PIECE_BYTES + 1, 3 * PIECE_BYTES + 5):
        src = rng.integers(0, 256, n, dtype=np.uint8)
        dst = np.zeros(n, np.uint8)
        assert copy_and_hash(src, dst) == xxhash.xxh3_64_digest(src) and np.array_equal(dst, src)


def test_missing_unexpected_and_wrong_size_chunks_are_misses(link, pool):
    a, b = link
    chunks = _chunks(3, 5000)
    dests = [(chunks[0][0], np.zeros(5000, np.uint8)),          # arrives
             (chunks[1][0], np.zeros(4999, np.uint8)),          # wrong size: miss, untouched
             (_key(99), np.zeros(5000, np.uint8))]              # never sent: miss
    sent, got = _transfer(pool, a, b, chunks, dests)             # chunks[2]: nobody asked: dropped
    assert got == [True, False, False] and sent == [True, False, False]
    assert not dests[1][1].any() and not dests[2][1].any()
    s = b.stats()
    assert (s["size_mismatch"], s["unexpected"], s["chunks_received"]) == (1, 1, 1)


def test_wrong_checksum_is_a_miss_and_the_link_goes_on(link, pool):
    a, b = link
    chunks = _chunks(2, 10_000)
    wrong = [(chunks[0][0], chunks[0][1], b"\0" * 8), (chunks[1][0], chunks[1][1], xxhash.xxh3_64_intdigest(chunks[1][1]))]
    dests = [(k, np.zeros(10_000, np.uint8)) for k, _ in chunks]
    sent, got = _transfer(pool, a, b, wrong, dests)
    assert got == [False, True] and sent == [False, True] and b.stats()["corrupt"] == 1
    assert _transfer(pool, a, b, chunks, dests)[1] == [True, True]


def test_control_messages(link, pool):
    a, b = link
    a.send_control(b"hello peer")
    assert b.recv_control() == b"hello peer"
    b.send_control(b"x" * 1000)
    assert a.recv_control() == b"x" * 1000


def test_bad_arguments_raise_before_io(link):
    a, b = link
    with pytest.raises(ValueError, match="read-only"):
        b.recv_into([(_key(1), b"immutable")])
    with pytest.raises(ValueError, match="duplicate"):
        b.recv_into([(_key(1), bytearray(4)), (_key(1), bytearray(4))])
    with pytest.raises(ValueError):
        a.send([(b"", b"x")])
    with pytest.raises(TypeError):
        a.send([(_key(1), 12345)])
    assert not a.closed and not b.closed  # nothing went on the wire


@pytest.mark.parametrize("kind", KINDS)
def test_silent_peer_times_out_within_the_bound(kind, pool):
    a, b = _connect(kind, pool)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout):
        b.recv_into([(_key(1), np.zeros(10, np.uint8))], timeout_s=0.3)
    assert time.monotonic() - t0 < 2.0
    assert b.closed  # a stream that timed out mid-conversation is not reused
    t0 = time.monotonic()
    with pytest.raises(TransferError):  # the peer never answers the batch
        a.send([(_key(1), np.zeros(10, np.uint8))], timeout_s=0.3)
    assert time.monotonic() - t0 < 2.0
    a.close()


@pytest.mark.parametrize("kind", KINDS)
def test_closed_channel_raises_peer_gone(kind, pool):
    a, b = _connect(kind, pool)
    a.close()
    with pytest.raises(PeerGone):
        b.recv_into([(_key(1), np.zeros(10, np.uint8))], timeout_s=5)
    with pytest.raises(PeerGone):
        a.send_control(b"x")


# -- hand-made frames from a raw TCP peer ---------------------------------------------
def _raw_peer(pool) -> tuple[socket.socket, TcpChannel]:
    listener = TcpListener(timeout_s=5)
    fut = pool.submit(listener.accept)
    raw = socket.create_connection(listener.address)
    raw.sendall(encode_frame(Hello(kind="tcp")))
    chan = fut.result(10)
    listener.close()
    hdr = raw.recv(PREFIX.size + 64)
    assert hdr.startswith(b"KVTX")
    return raw, chan


def test_truncated_payload_is_peer_gone_and_no_partial_chunk_reported(pool):
    raw, chan = _raw_peer(pool)
    chunks = _chunks(3, 100_000)
    raw.sendall(encode_frame(Batch(batch_id=0, count=3)))
    for i, (k, p) in enumerate(chunks[:2]):
        raw.sendall(encode_frame(Chunk(index=i, key=k, nbytes=p.nbytes, checksum=xxhash.xxh3_64_digest(p))))
        raw.sendall(p if i == 0 else p[:50_000])  # the second payload is cut short
    raw.close()
    dests = [(k, np.zeros(100_000, np.uint8)) for k, _ in chunks]
    with pytest.raises(PeerGone) as info:
        chan.recv_into(dests, timeout_s=5)
    assert info.value.received == [True, False, False]
    assert np.array_equal(dests[0][1], chunks[0][1])


def test_corrupt_payload_is_a_miss(pool):
    raw, chan = _raw_peer(pool)
    (k, p), = _chunks(1, 4096)
    raw.sendall(encode_frame(Batch(batch_id=0, count=1)))
    raw.sendall(encode_frame(Chunk(index=0, key=k, nbytes=p.nbytes, checksum=xxhash.xxh3_64_digest(p))))
    bad = p.copy()
    bad[100] ^= 0xFF
    raw.sendall(bad)
    out = np.zeros(4096, np.uint8)
    assert chan.recv_into([(k, out)], timeout_s=5) == [False]
    assert chan.stats()["corrupt"] == 1
    raw.close()


@pytest.mark.parametrize("garbage, match", [
    (b"GARBAGE!" + b"\0" * 16, "bad magic"),
    (PREFIX.pack(b"KVTX", 1 << 30), "header length"),
    (PREFIX.pack(b"KVTX", 3) + b"\xc1\xc1\xc1", "malformed frame header"),
])
def test_malformed_header_is_a_clear_protocol_error(pool, garbage, match):
    raw, chan = _raw_peer(pool)
    raw.sendall(garbage)
    t0 = time.monotonic()
    with pytest.raises(ProtocolError, match=match):
        chan.recv_into([(_key(1), np.zeros(10, np.uint8))], timeout_s=5)
    assert time.monotonic() - t0 < 2.0 and chan.closed
    raw.close()


def test_out_of_range_chunk_field_is_a_protocol_error(pool):
    raw, chan = _raw_peer(pool)
    raw.sendall(encode_frame(Batch(batch_id=0, count=1)))
    raw.sendall(encode_frame(Chunk(index=0, key=_key(1), nbytes=1 << 40, checksum=b"\0" * 8)))
    with pytest.raises(ProtocolError, match="nbytes"):
        chan.recv_into([(_key(1), np.zeros(10, np.uint8))], timeout_s=5)
    raw.close()


def test_wrong_peer_kind_fails_the_handshake(pool):
    listener = TcpListener(timeout_s=5)
    fut = pool.submit(listener.accept)
    raw = socket.create_connection(listener.address)
    raw.sendall(encode_frame(Hello(kind="shm")))
    with pytest.raises(ProtocolError, match="speaks 'shm'"):
        fut.result(10)
    raw.close(), listener.close()


def test_shm_frame_outside_the_segment_is_a_protocol_error():
    a, b = ShmChannel.pair(timeout_s=5, staging_bytes=1 << 20)
    a.send_control(b"")  # nothing shared yet
    b.recv_control()
    a._ensure_staging(a._deadline(None))
    a._send_views([encode_frame(Batch(batch_id=0, count=1)),
                   encode_frame(Chunk(index=0, key=_key(1), nbytes=4096, checksum=b"\0" * 8,
                                      segment_id=0, offset=(1 << 20) - 100))], a._deadline(None))
    with pytest.raises(ProtocolError, match="outside segment"):
        b.recv_into([(_key(1), np.zeros(4096, np.uint8))], timeout_s=5)
    a.close()


def test_channels_chosen_by_url(pool, tmp_path):
    from kvtier.transfer import urls

    for url in (f"shm://{tmp_path}/x.sock", "tcp://127.0.0.1:0"):
        listener = urls.listen(url)
        target = f"shm://{listener.path}" if url.startswith("shm") else f"tcp://127.0.0.1:{listener.address[1]}"
        fut = pool.submit(listener.accept)
        a = urls.connect(target, timeout_s=5)
        b = fut.result(10)
        assert a.kind == b.kind == url.split(":")[0]
        a.send_control(b"ok")
        assert b.recv_control() == b"ok"
        a.close(), b.close(), listener.close()
    for bad in ("udp://h:1", "tcp://nohost", "shm://"):
        with pytest.raises(ValueError):
            urls.connect(bad)


@pytest.mark.slow
def test_nixl_agent_start_is_quiet_unless_asked(tmp_path):
    """NIXL's INFO lines (agent and backend creation) stay off stdout; NIXL_LOG_LEVEL set by the user wins."""
    if _nixl_missing():
        pytest.skip(f"nixl channel: {_nixl_missing()}")
    import subprocess
    import sys

    code = ("from kvtier.transfer.nixl import nixl_agent_class; A, C = nixl_agent_class(); "
            "A('quiet-test', C(backends=['UCX'])); print('agent up')")
    env = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}
    quiet = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "agent up" in quiet.stdout and "NIXL INFO" not in quiet.stdout + quiet.stderr
    loud = subprocess.run([sys.executable, "-c", code], env={**env, "NIXL_LOG_LEVEL": "INFO"},
                          capture_output=True, text=True, timeout=120)
    assert "NIXL INFO" in loud.stdout + loud.stderr


@pytest.mark.slow
@pytest.mark.parametrize("shared", [True, False])
def test_shm_batch_of_many_chunks_does_not_block_both_ends(pool, shared):
    """Frames one way and one ack per chunk the other: a 12,000-chunk batch used to fill both
    socket buffers and stall both ends until the timeout; now it completes within seconds."""
    n, size = 12_000, 64
    a, b = _connect("shm", pool, timeout_s=8.0, staging_bytes=1 << 20)
    data = np.random.default_rng(9).integers(0, 256, n * size, dtype=np.uint8)
    if shared:
        seg = SharedSegment.create(n * size)
        seg.array[:] = data
        a.share_segment(seg)
        data = seg.array
    chunks = [(_key(i), data[i * size:(i + 1) * size]) for i in range(n)]
    outs = [(k, np.zeros(size, np.uint8)) for k, _ in chunks]
    t0 = time.monotonic()
    sent, got = _transfer(pool, a, b, chunks, outs)
    assert sent == [True] * n and got == [True] * n and time.monotonic() - t0 < 8.0
    assert all(np.array_equal(o, p) for (_, o), (_, p) in zip(outs, chunks))
    a.close()
    b.close()
