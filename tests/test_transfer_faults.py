"""Transfer channels when the peer process is killed mid-transfer (SIGKILL, real processes)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvtier.transfer.errors import TransferError
from kvtier.transfer.shm_listener import ShmListener
from kvtier.transfer.tcp import TcpListener

N, SIZE = 6, 2_000_000

# The child opens a real channel and SIGKILLs itself at a chosen point of the real code path:
# as a sender, after ``KILL_AT`` chunk frames (TCP: halfway through that chunk's payload); as a
# receiver, when the ``KILL_AT``-th chunk frame arrives.
CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from kvtier.transfer.shm import ShmChannel
    from kvtier.transfer.tcp import TcpChannel
    from kvtier.transfer.frames import Chunk, decode_header
    from kvtier.transfer.stream import StreamChannel
    kind, role, addr, kill_at, n, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    if kind == "nixl":
        from kvtier.transfer.nixl import NixlChannel
        chan = NixlChannel.connect("127.0.0.1", int(addr), 10.0)
    elif kind == "shm":
        chan = ShmChannel.connect(addr, 10.0, staging_bytes=64 << 20)
    else:
        chan = TcpChannel.connect("127.0.0.1", int(addr), 10.0)
    seen = [0]
    def die():
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "nixl" and role == "send":  # frames out, then die before the receiver's READ is done
        type(chan)._recv_msg = lambda self, deadline: die()
        rng = np.random.default_rng(1)
        chan.send([(i.to_bytes(4, "little") * 8, rng.integers(0, 256, size, dtype=np.uint8)) for i in range(n)])
    elif kind == "nixl":  # receiver: die instead of reading
        type(chan)._post = lambda self, pairs: die()
        chan.recv_into([(i.to_bytes(4, "little") * 8, np.zeros(size, np.uint8)) for i in range(n)])
    elif role == "send":
        orig = StreamChannel._send_views
        def send_views(self, views, deadline, fds=()):
            if any(len(v) < 4096 and bytes(v[:4]) == b"KVTX" and isinstance(decode_header(bytes(v[8:])), Chunk) for v in views[:1]):
                seen[0] += 1
                if seen[0] == kill_at:
                    if len(views) > 1:  # tcp: the frame, then half the payload
                        orig(self, [views[0], memoryview(views[1])[: len(views[1]) // 2]], deadline)
                    die()
            return orig(self, views, deadline, fds)
        StreamChannel._send_views = send_views
        rng = np.random.default_rng(1)
        chan.send([(i.to_bytes(4, "little") * 8, rng.integers(0, 256, size, dtype=np.uint8)) for i in range(n)])
    else:
        orig = type(chan)._take
        def take(self, chunk, *a):
            seen[0] += 1
            if seen[0] == kill_at:
                die()
            return orig(self, chunk, *a)
        type(chan)._take = take
        chan.recv_into([(i.to_bytes(4, "little") * 8, np.zeros(size, np.uint8)) for i in range(n)])
""")


def _listen(kind: str):
    if kind == "nixl":
        try:
            from kvtier.transfer.nixl_listener import NixlListener

            return NixlListener(timeout_s=10)
        except TransferError as exc:
            pytest.skip(f"nixl channel: {exc}")
    return ShmListener(timeout_s=10) if kind == "shm" else TcpListener(timeout_s=10)


def _child(kind: str, role: str, listener, kill_at: int) -> subprocess.Popen:
    addr = listener.path if kind == "shm" else str(listener.address[1])  # tcp, nixl: control port
    return subprocess.Popen([sys.executable, "-c", CHILD, kind, role, addr, str(kill_at), str(N), str(SIZE)])


def _expected() -> list[tuple[bytes, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [(i.to_bytes(4, "little") * 8, rng.integers(0, 256, SIZE, dtype=np.uint8)) for i in range(N)]


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_sender_killed_mid_batch(kind):
    listener = _listen(kind)
    child = _child(kind, "send", listener, kill_at=4)
    try:
        chan = listener.accept(30)
        expected = _expected()
        dests = [(k, np.zeros(SIZE, np.uint8)) for k, _ in expected]
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            chan.recv_into(dests, timeout_s=20)
        assert time.monotonic() - t0 < 20
        got = info.value.received
        assert got is not None and got[3:] == [False] * (N - 3)  # the 4th chunk was cut: never reported
        assert got[0]  # what completed before is reported (shm: an ack to the dead peer may end it early) ...
        for ok, (_, d), (_, p) in zip(got, dests, expected):
            assert not ok or np.array_equal(d, p)  # ... and only if it is byte-identical
        assert chan.closed
    finally:
        child.kill()
        child.wait(10)
        listener.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["shm", "tcp", "nixl"])
def test_receiver_killed_mid_batch(kind):
    listener = _listen(kind)
    child = _child(kind, "recv", listener, kill_at=3)
    try:
        chan = listener.accept(30)
        rng = np.random.default_rng(1)
        chunks = [(i.to_bytes(4, "little") * 8, rng.integers(0, 256, SIZE, dtype=np.uint8)) for i in range(N)]
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            chan.send(chunks, timeout_s=20)
        assert time.monotonic() - t0 < 20 and chan.closed
    finally:
        child.kill()
        child.wait(10)
        listener.close()


@pytest.mark.slow
def test_nixl_sender_killed_before_the_read():
    listener = _listen("nixl")
    child = _child("nixl", "send", listener, kill_at=0)
    try:
        chan = listener.accept(30)
        dests = [(k, np.zeros(SIZE, np.uint8)) for k, _ in _expected()]
        t0 = time.monotonic()
        try:
            got = chan.recv_into(dests, timeout_s=10)
        except TransferError as exc:  # the READ failed, or the ack could not be sent
            got = exc.received
        assert time.monotonic() - t0 < 15
        for ok, (_, d), (_, p) in zip(got or [], dests, _expected()):
            assert not ok or np.array_equal(d, p)  # whatever is reported received is intact
    finally:
        child.kill()
        child.wait(10)
        listener.close()


def test_accept_without_peer_times_out():
    with ThreadPoolExecutor(1) as ex, TcpListener() as listener:
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            ex.submit(listener.accept, 0.2).result(5)
        assert time.monotonic() - t0 < 3
