"""``kvtier server`` copies addressed by engine block id (kvtier.service.kv_ops).

CPU: a real ``kvtier server`` process with the shm stand-in (tests only) for a CUDA IPC
export, so the server's register/gather/scatter code runs exactly as on a GPU except the
step that opens the buffer. ``cuda``-marked tests do the same with a CUDA KV tensor and
skip with a reason without a device.
"""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from kvtier import protocol as P
from kvtier.index.keys import chain_parents
from kvtier.protocol.messages import KVRegister, KVRelease, LoadBlocks, ShmBuffer, StoreBlocks
from kvtier.service.kv_export import kv_register_request
from kvtier.service.pinning import SegmentPins
from kvtier.memory.shared_segment import SharedSegment
from kvtier.storage.types import WriteSkip
from conftest import small_namespace
from service_helpers import connect, short_dir, start_server_process, wait_until  # noqa: F401 (short_dir: fixture)

NS = small_namespace()  # 2 layers, 16-token blocks, 1 head, 8 dims fp16: C = 32 B, page 512 B, 2 blocks per chunk
L, B, H, N, C = 2, 8, 1, 16, 32
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")


def keys(tag: str, n: int) -> list[bytes]:
    return [(f"{tag}-{i}".encode() * 32)[:32] for i in range(n)]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[subprocess.Popen, Path]]:
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="kvbc-", dir="/tmp"))
    proc = start_server_process(d, cpu_chunks=16, disk=False)
    try:
        seen = []
        while not any("ready" in line for line in seen):
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, "".join(seen)
            seen.append(line)
        yield proc, d / "s.sock"
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(d, ignore_errors=True)


class ShmKV:
    """A test engine's KV: ``/dev/shm/kvtier-kvtest-*`` mapped as fp16 ``[L, B, H, N, C/2]`` (LBHNC)."""

    def __init__(self, tag: str):
        self.name = f"kvtier-kvtest-{os.getpid()}-{tag}"
        self.path = f"/dev/shm/{self.name}"
        nbytes = L * B * H * N * C
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.raw = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.raw.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        self.kv = self.raw.view(torch.float16).view(L, B, H, N, C // 2)

    @property
    def layers(self) -> list[torch.Tensor]:
        return [self.kv[i] for i in range(L)]

    def blocks(self, ids: list[int]) -> torch.Tensor:
        """``uint8 [L, len(ids), page]`` copy of those blocks (the slot layout)."""
        return self.raw.view(L, B, -1)[:, ids].clone()

    def close(self) -> None:
        del self.kv, self.raw
        self.mm.close()
        os.unlink(self.path)


@pytest.fixture
def shm_kv(request: pytest.FixtureRequest) -> Iterator[ShmKV]:
    kv = ShmKV(request.node.name[-24:].replace("[", "_").replace("]", "_"))
    yield kv
    kv.close()


def server_maps(proc: subprocess.Popen, path: str) -> bool:
    """True while the server process maps ``path`` (its registration holds the buffer)."""
    with open(f"/proc/{proc.pid}/maps") as f:
        return path in f.read()


@pytest.mark.slow
def test_store_from_blocks_then_load_into_other_blocks_is_byte_identical(server, shm_kv: ShmKV) -> None:
    proc, sock = server
    c = connect(sock, NS, "bc-engine")
    other = connect(sock, NS, "bc-reader")
    try:
        reply = c.register_kv(kv_register_request(shm_kv.layers, shm_kv.name))
        assert reply is not None and reply["num_blocks"] == B and reply["page_bytes"] == H * N * C
        assert reply["device"] == "cpu" and reply["pinned"] is False
        k = keys("roundtrip", 2)
        src = [[3, 1], [6, 0]]
        want = [shm_kv.blocks(ids) for ids in src]
        assert c.store_blocks(k, src, chain_parents(k)) == [None, None]
        # The stored slots hold exactly the slot layout [L, blocks, page] the slot copies use.
        for key, w in zip(k, want):
            h = other.open_read(key)
            assert h is not None
            assert np.array_equal(h.buffer, w.numpy().reshape(-1))
            h.close()
        dst = [[2, 4], [5, 7]]
        shm_kv.raw.view(L, B, -1)[:, [2, 4, 5, 7]] = 0
        assert c.load_blocks(k, [None, k[0]], dst) == ["cpu", "cpu"]
        for ids, w in zip(dst, want):
            assert torch.equal(shm_kv.blocks(ids), w)
        # A partial chunk: only block 1 of chunk k[1] (its second) into engine block 2.
        shm_kv.raw.view(L, B, -1)[:, 2] = 0
        assert c.load_blocks(k[1:], [k[0]], [[2]], [1]) == ["cpu"]
        assert torch.equal(shm_kv.blocks([2]), want[1][:, 1:2])
        # Storing again: present; a miss ends the loaded prefix.
        assert c.store_blocks(k[:1], [[3, 1]], chain_parents(k[:1])) == [WriteSkip.PRESENT]
        missing = keys("never-stored", 1)
        assert c.load_blocks([missing[0], k[0]], [None, None], [[2, 4], [5, 7]]) == [None, None]
        # Every reservation and read of the requests was given back. ``other``'s reads end with one-way
        # unloads on its own connection, which nothing orders before ``c``'s stats call: poll.
        wait_until(lambda: c.stats()["server_holds"] == 0, 10.0)
    finally:
        c.close()
        other.close()


class Raw:
    """A bare protocol connection (to see error codes, which the client turns into misses)."""

    def __init__(self, path: Path, register: bool = True):
        self.s = socket.socket(socket.AF_UNIX)
        self.s.connect(str(path))
        self.s.settimeout(20)
        self.rid = 0
        if register:
            self.s.sendall(P.encode_request(P.Register("bc-raw", os.getpid(), NS, NS.digest(), NS.chunk_bytes), 0))
            head, fds, _, _ = socket.recv_fds(self.s, P.HEADER.size, 4)
            for fd in fds:
                os.close(fd)
            (n,) = P.HEADER.unpack(head)
            assert P.unpack_body(self.s.recv(n, socket.MSG_WAITALL))["ok"] is True

    def call(self, req: P.Request) -> dict[str, Any]:
        self.rid += 1
        self.s.sendall(P.encode_request(req, self.rid))
        (n,) = P.HEADER.unpack(self.s.recv(4, socket.MSG_WAITALL))
        reply = P.unpack_body(self.s.recv(n, socket.MSG_WAITALL))
        assert reply["id"] == self.rid
        return reply

    def close(self) -> None:
        self.s.close()


def code(reply: dict[str, Any]) -> str:
    assert reply["ok"] is False, reply
    return reply["code"]


@pytest.mark.slow
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(server, shm_kv: ShmKV) -> None:
    proc, sock = server
    k = keys("errors", 2)
    unreg = Raw(sock, register=False)
    assert code(unreg.call(StoreBlocks(k[:1], [[0, 1]]))) == "not_registered"
    unreg.close()
    r = Raw(sock)
    try:
        assert code(r.call(StoreBlocks(k[:1], [[0, 1]]))) == "bad_state"  # no kv_register yet
        assert code(r.call(LoadBlocks(k[:1], [None], [[0]], [0]))) == "bad_state"
        good = kv_register_request(shm_kv.layers, shm_kv.name)
        wrong_shape = KVRegister("shm", good.buffers, (B, H, N // 2, C), good.layers)
        assert code(r.call(wrong_shape)) == "bad_namespace"
        one_layer = KVRegister("shm", good.buffers, good.shape, good.layers[:1])
        assert code(r.call(one_layer)) == "bad_namespace"
        for name in ("../etc/passwd", "kvtier-kvtest-does-not-exist"):
            reply = r.call(KVRegister("shm", [ShmBuffer(name, 8192)], good.shape, good.layers))
            assert code(reply) == "bad_message", reply
        past_end = KVRegister("shm", good.buffers, good.shape, [(0, 8192 - 100, *good.layers[0][2:])] * 2)
        assert "past its buffer" in r.call(past_end)["error"]
        assert r.call(good)["ok"] is True
        for bad, says in [
            (StoreBlocks(k[:1], [[0, B]]), "outside the KV cache"),
            (StoreBlocks(k[:1], [[1, 1]]), "duplicate"),
            (StoreBlocks(k[:1], [[0, 1, 2]]), "each chunk is 2 block ids"),
            (LoadBlocks(k[:1], [None], [[0, 1]], [1]), "outside a 2-block chunk"),
            (LoadBlocks(k, [None, k[0]], [[0, 1], [1, 2]], [0, 0]), "duplicate"),
        ]:
            reply = r.call(bad)
            assert code(reply) == "bad_message" and says in reply["error"], reply
        # Same connection, same server: a valid store and load still work.
        assert r.call(StoreBlocks(k[:1], [[4, 5]]))["skips"] == [0]
        shm_kv.raw.view(L, B, -1)[:, 6:8] = 0
        assert r.call(LoadBlocks(k[:1], [None], [[6, 7]], [0]))["sources"] == ["cpu"]
        assert torch.equal(shm_kv.blocks([6, 7]), shm_kv.blocks([4, 5]))
        assert proc.poll() is None
    finally:
        r.close()


def test_release_and_disconnect_free_the_registration(server, shm_kv: ShmKV) -> None:
    proc, sock = server
    r = Raw(sock)
    assert r.call(kv_register_request(shm_kv.layers, shm_kv.name))["ok"] is True
    assert server_maps(proc, shm_kv.path)
    assert r.call(KVRelease())["released"] is True
    wait_until(lambda: not server_maps(proc, shm_kv.path), 10, "buffer unmapped after kv_release")
    assert code(r.call(StoreBlocks(keys("rel", 1), [[0, 1]]))) == "bad_state"
    assert r.call(kv_register_request(shm_kv.layers, shm_kv.name))["ok"] is True
    assert server_maps(proc, shm_kv.path)
    r.close()  # a disconnect releases it too
    wait_until(lambda: not server_maps(proc, shm_kv.path), 10, "buffer unmapped after the disconnect")
    c = connect(sock, NS, "bc-after")  # and the server still serves
    assert c.register_kv(kv_register_request(shm_kv.layers, shm_kv.name)) is not None
    assert c.store_blocks(keys("after", 1), [[0, 1]], chain_parents(keys("after", 1))) == [None]
    c.close()
    wait_until(lambda: not server_maps(proc, shm_kv.path), 10, "buffer unmapped after the client closed")


def test_client_without_registration_falls_back_cleanly(server) -> None:
    _, sock = server
    c = connect(sock, NS, "bc-none")
    try:
        k = keys("none", 1)
        assert c.store_blocks(k, [[0, 1]], chain_parents(k)) == [WriteSkip.NO_ROOM]
        assert c.load_blocks(k, [None], [[0, 1]]) == [None]
        bad = KVRegister("shm", [ShmBuffer("kvtier-kvtest-missing", 8192)], (B, H, N, C), [(0, 0, 1024, 512, 32)] * 2)
        assert c.register_kv(bad) is None
        assert c.store_blocks(k, [[0, 1]], chain_parents(k)) == [WriteSkip.NO_ROOM]  # refused registration: still the slot path
    finally:
        c.close()


@pytest.mark.parametrize("req", [
    KVRegister("shm", [ShmBuffer("kvtier-kvtest-x", 4096)], (4, 1, 16, 32), [(0, 0, 2048, 512, 32), (0, 512, 2048, 512, 32)]),
    KVRegister("cuda", [P.CudaRegister(b"\x01" * 64, 4096, "uint8", 0, offset=512, ref_counter_handle=b"/torch_1_2",
                                       ref_counter_offset=8, event_handle=b"\x02" * 64, event_sync_required=True)],
               (4, 1, 16, 32), [(0, 0, 2048, 512, 32), (0, 512, 2048, 512, 32)]),
    StoreBlocks(keys("m", 2), [[0, 1], [2, 3]]),
    StoreBlocks(keys("m", 2), [[0, 1], [2, 3]], [None, keys("m", 1)[0]]),
    LoadBlocks(keys("m", 2), [None, keys("m", 1)[0]], [[0, 1], [3]], [0, 1]),
    KVRelease(),
], ids=lambda r: r.OP)
def test_block_messages_round_trip(req: P.Request) -> None:
    frame = P.encode_request(req, 9)
    assert P.decode_request(P.unpack_body(frame[4:]))[1] == req


@pytest.mark.parametrize("fields", [
    {"op": "kv_register", "kind": "rdma", "buffers": [{"name": "kvtier-kvtest-x", "size": 1}], "shape": [1, 1, 1, 1], "layers": [[0, 0, 1, 1, 1]]},
    {"op": "kv_register", "kind": "shm", "buffers": [{"name": "kvtier-kvtest-x", "size": 1}], "shape": [1, 1, 1], "layers": [[0, 0, 1, 1, 1]]},
    {"op": "kv_register", "kind": "shm", "buffers": [{"name": "kvtier-kvtest-x", "size": 1}], "shape": [1, 1, 1, 1], "layers": [[1, 0, 1, 1, 1]]},
    {"op": "store_blocks", "keys": b"k" * 32, "blocks": [[-1, 0]]},
    {"op": "store_blocks", "keys": b"k" * 32, "blocks": [[]]},
    {"op": "store_blocks", "keys": b"k" * 64, "blocks": [[0, 1]]},
    {"op": "load_blocks", "keys": b"k" * 32, "parents": [None], "blocks": [[0]], "offsets": [-1]},
])
def test_ill_formed_block_messages_are_refused(fields: dict) -> None:
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request({"v": P.PROTOCOL_VERSION, "id": 1, **fields})
    assert e.value.code == P.ErrorCode.BAD_MESSAGE


class FakeCudart:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr: int, n: int, flags: int) -> int:
        self.calls.append(("register", ptr, n, flags))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0


def test_segment_pins_register_once_keep_pages_and_unregister_last() -> None:
    seg = SharedSegment.create(4 * mmap.PAGESIZE, "kvtier-pin-test", sparse=True)
    try:
        fake = FakeCudart()
        pins = SegmentPins(lambda: fake)
        addr = seg.array.ctypes.data
        assert pins.acquire(b"d" * 32, seg) and pins.acquire(b"d" * 32, seg)
        assert fake.calls == [("register", addr, seg.size, 1)]
        seg.array[: mmap.PAGESIZE] = 7
        seg.release(0, mmap.PAGESIZE)  # pinned: the GPU maps these pages, they must stay
        assert seg.array[0] == 7
        pins.release(b"d" * 32)
        assert len(fake.calls) == 1 and pins.pinned() == [b"d" * 32]
        pins.release(b"d" * 32)
        assert fake.calls[-1] == ("unregister", addr) and pins.pinned() == []
        seg.release(0, mmap.PAGESIZE)  # unpinned: pages go back again
        assert seg.array[0] == 0
        assert pins.acquire(b"e" * 32, seg)
        pins.close()  # shutdown unpins everything
        assert fake.calls[-1] == ("unregister", addr) and pins.pinned() == []
    finally:
        seg.close()


def test_segment_pins_without_cuda_do_nothing() -> None:
    seg = SharedSegment.create(mmap.PAGESIZE, "kvtier-pin-test", sparse=True)
    try:
        pins = SegmentPins(lambda: None)
        assert pins.acquire(b"d" * 32, seg) is False and pins.pinned() == []
        pins.release(b"d" * 32)
        pins.close()
    finally:
        seg.close()


@pytest.mark.cuda
@needs_cuda
def test_cuda_store_and_load_by_block_id_through_ipc(server) -> None:
    _, sock = server
    kv = torch.randint(0, 256, (L, B, H, N, C), dtype=torch.uint8, device="cuda").view(torch.float16)
    layers = [kv[i] for i in range(L)]
    raw = kv.view(torch.uint8).view(L, B, -1)
    c = connect(sock, NS, "bc-cuda")
    try:
        reply = c.register_kv(kv_register_request(layers))
        assert reply is not None, "the server refused the CUDA registration"
        assert reply["device"].startswith("cuda") and reply["pinned"] is True
        k = keys("cuda", 2)
        want = [raw[:, [3, 1]].cpu(), raw[:, [6, 0]].cpu()]
        torch.cuda.synchronize()
        assert c.store_blocks(k, [[3, 1], [6, 0]], chain_parents(k)) == [None, None]
        raw[:, [2, 4, 5, 7]] = 0
        torch.cuda.synchronize()
        assert c.load_blocks(k, [None, k[0]], [[2, 4], [5, 7]]) == ["cpu", "cpu"]
        assert torch.equal(raw[:, [2, 4]].cpu(), want[0]) and torch.equal(raw[:, [5, 7]].cpu(), want[1])
        assert c.release_kv() is True
    finally:
        c.close()


@pytest.mark.cuda
@needs_cuda
def test_cuda_registration_over_several_allocations(server) -> None:
    _, sock = server
    layers = [torch.randint(0, 256, (B, H, N, C), dtype=torch.uint8, device="cuda") for _ in range(L)]
    c = connect(sock, NS, "bc-cuda-many")
    try:
        req = kv_register_request(layers)
        assert len(req.buffers) == L
        assert c.register_kv(req) is not None
        k = keys("cuda-many", 1)
        want = torch.stack([x[[1, 2]].reshape(2, -1) for x in layers]).cpu()
        torch.cuda.synchronize()
        assert c.store_blocks(k, [[1, 2]], chain_parents(k)) == [None]
        assert c.load_blocks(k, [None], [[6, 7]]) == ["cpu"]
        assert torch.equal(torch.stack([x[[6, 7]].reshape(2, -1) for x in layers]).cpu(), want)
    finally:
        c.close()


#: The engine of the kill test: registers ``argv[2]`` blocks of CUDA KV with the server at
#: ``argv[1]``, stores one chunk from them, says so, and waits to be killed.
KILLED_ENGINE = """
import sys, time, torch
from test_service_block_copy import NS, L, H, N, C, keys
from service_helpers import connect
from kvtier.service.kv_export import kv_register_request
kv = torch.randint(0, 256, (L, int(sys.argv[2]), H, N, C), dtype=torch.uint8, device="cuda")
c = connect(sys.argv[1], NS, "bc-cuda-killed")
assert c.register_kv(kv_register_request([kv[i] for i in range(L)])) is not None
torch.cuda.synchronize()
assert c.store_blocks(keys("killed", 1), [[0, 1]]) == [None]
print("registered", flush=True)
time.sleep(600)
"""


@pytest.mark.cuda
@needs_cuda
def test_cuda_kv_of_a_killed_engine_is_released_by_the_server(server) -> None:
    """The server's IPC mapping of an engine's KV dies with the engine's connection: the
    device memory comes back after a ``kill -9`` (a mapping kept open would hold it)."""
    import sys

    _, sock = server
    warm = torch.zeros(L, B, H, N, C, dtype=torch.uint8, device="cuda")  # the server's CUDA context first
    c = connect(sock, NS, "bc-cuda-warm")
    try:
        assert c.register_kv(kv_register_request([warm[i] for i in range(L)])) is not None
        assert c.release_kv() is True
    finally:
        c.close()
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    gib = 1 << 30
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", KILLED_ENGINE, str(sock), str(gib // (L * H * N * C))],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = child.stdout.readline()  # type: ignore[union-attr]
        assert "registered" in line, line + child.stdout.read(4000)  # type: ignore[union-attr]
        assert free0 - torch.cuda.mem_get_info()[0] >= 0.9 * gib, "the engine's KV allocation does not show"
    finally:
        child.kill()
        child.wait(30)
    wait_until(lambda: torch.cuda.mem_get_info()[0] >= free0 - (128 << 20), 30,
               "the killed engine's KV memory freed (the server released its IPC mapping)")


def _registered(kv: ShmKV) -> Any:
    from kvtier.integrations.vllm.gpu.layout import KVLayout, RegisteredKV

    views = [x.view(torch.uint8) for x in kv.layers]
    return RegisteredKV(KVLayout("TEST_ATTN", "LBHNC", L, B, H, N, C, "float16"), ["l0", "l1"], views, None)


class Spy:
    """Delegates to a client and records the names of the methods called."""

    def __init__(self, inner: Any):
        self._inner, self.called = inner, []

    def __getattr__(self, name: str) -> Any:
        self.called.append(name)
        return getattr(self._inner, name)


def test_worker_steps_use_server_copies_and_keep_the_slot_layout(server, shm_kv: ShmKV) -> None:
    from kvtier.integrations.vllm.gpu.server_copies import ServerCopies
    from kvtier.integrations.vllm.gpu.steps import TorchSteps
    from kvtier.integrations.vllm.types import ChunkCopy, TransferSpec

    _, sock = server
    c = connect(sock, NS, "bc-worker")
    errors: list[int] = []
    try:
        kv = _registered(shm_kv)
        spy = Spy(c)
        copies = ServerCopies.try_register(spy, kv, shm_name=shm_kv.name)
        assert copies is not None
        steps = TorchSteps(spy, kv, NS.blocks_per_chunk, errors.extend, server=copies)
        slot_steps = TorchSteps(c, kv, NS.blocks_per_chunk, errors.extend)  # the slot-copy path, same KV
        k = keys("worker", 3)
        want = [shm_kv.blocks([0, 1]), shm_kv.blocks([2, 3])]
        steps.set_saves([TransferSpec("r1", [ChunkCopy(k[0], (0, 1)), ChunkCopy(k[1], (2, 3), parent=k[0])])])
        steps.save_layer("l0")  # server copies: nothing until end_saves
        assert not c.contains(k[0])
        steps.end_saves()
        assert c.contains(k[0]) and c.contains(k[1])
        shm_kv.raw.view(L, B, -1)[:, 4:8] = 0
        # Loaded by the slot path: the server's stores have the slot layout.
        assert slot_steps.begin_loads([TransferSpec("r2", [ChunkCopy(k[0], (4, 5))])]) == set()
        slot_steps.end_loads()
        assert torch.equal(shm_kv.blocks([4, 5]), want[0])
        # Loaded by the server; the chunk after a miss is reported for recompute.
        spec = TransferSpec("r3", [ChunkCopy(k[1], (6, 7), parent=k[0]), ChunkCopy(k[2], (4, 5), parent=k[1])])
        assert steps.begin_loads([spec]) == {"r3"}
        assert torch.equal(shm_kv.blocks([6, 7]), want[1]) and errors == [4, 5]
        steps.end_loads()
        assert {"store_blocks", "load_blocks"} <= set(spy.called)
        assert not {"open_write_many", "open_read_many", "commit"} & set(spy.called)  # no slot copies here
        steps.close()
        assert c.store_blocks(keys("worker-closed", 1), [[0, 1]], chain_parents(keys("worker-closed", 1))) == [WriteSkip.NO_ROOM]  # released
    finally:
        c.close()


@pytest.mark.slow
def test_a_chain_without_room_stores_a_prefix_and_keeps_no_holds(short_dir: Path, shm_kv: ShmKV) -> None:  # noqa: F811
    from service_helpers import start_server

    with start_server(short_dir, cpu_chunks=2) as srv:
        c = connect(short_dir / "s.sock", NS, "bc-full")
        try:
            assert c.register_kv(kv_register_request(shm_kv.layers, shm_kv.name)) is not None
            k = keys("full", 4)
            got = c.store_blocks(k, [[0, 1], [2, 3], [4, 5], [6, 7]], chain_parents(k))
            n = got.index(WriteSkip.NO_ROOM)
            assert n >= 1 and got[:n] == [None] * n and got[n:] == [WriteSkip.NO_ROOM] * (4 - n)
            assert [c.contains(x) for x in k] == [True] * n + [False] * (4 - n)
            assert srv.total_holds() == 0 and srv._kv.registered() == 1
        finally:
            c.close()
        wait_until(lambda: srv._kv.registered() == 0, 10, "registration released")


@pytest.mark.slow
def test_the_shm_stand_in_is_refused_over_tcp(short_dir: Path, shm_kv: ShmKV) -> None:  # noqa: F811
    from service_helpers import start_server

    with start_server(short_dir, tcp_host="127.0.0.1", token="s3cret") as srv:
        host, port = srv.tcp_address
        c = connect(f"tcp://{host}:{port}", NS, "bc-tcp", token="s3cret")
        try:
            assert c.register_kv(kv_register_request(shm_kv.layers, shm_kv.name)) is None
            assert srv._kv.registered() == 0
        finally:
            c.close()
