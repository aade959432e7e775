"""Hostile-user trial of the cache-service protocol (msgspec fast path, typed replies, lookup endpoint).

Each test is one attack that succeeded against the code as merged (``8c6107f``): it fails until the
product is fixed. Everything runs on loopback Unix sockets in temporary directories, with bounded
timeouts; the server tests start a real ``kvtier server`` process (so a crash is seen as its exit code).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack
import pytest

from conftest import CHUNK, payload_for, small_namespace
from kvtier import protocol as P
from kvtier.config import KVTierConfig
from kvtier.protocol.envelope import decode_request_body
from kvtier.protocol.fields import namespace_to_wire
from kvtier.service.client import ServiceClient
from kvtier.service.lookup_endpoint import LookupClient, LookupServer
from kvtier.storage.manager import StorageManager
from kvtier.storage.types import WriteSkip

NS = small_namespace()
CB = NS.chunk_bytes


# -- helpers ---------------------------------------------------------------------------------------
@pytest.fixture
def tmp_short() -> Iterator[Path]:
    d = tempfile.mkdtemp(prefix="kvhx-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


class Server:
    """A ``kvtier server`` child process on ``d/s.sock``."""

    def __init__(self, d: Path, cpu_chunks: int = 64, *extra: str):
        self.sock_path = str(d / "s.sock")
        self.log = open(d / "server.log", "w")
        cmd = [sys.executable, "-m", "kvtier.cli", "server", "--socket", self.sock_path,
               "--cpu-capacity", str(cpu_chunks * CB), "--no-metrics", *extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "server exited at start"
            try:
                s = socket.socket(socket.AF_UNIX)
                s.connect(self.sock_path)
                s.close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("server did not start")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


@pytest.fixture
def server(tmp_short: Path) -> Iterator[Server]:
    srv = Server(tmp_short)
    yield srv
    srv.close()


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def recv_reply(s: socket.socket, timeout: float = 5.0) -> dict[str, Any] | None:
    """One reply frame, or None on EOF (raises socket.timeout when none comes)."""
    s.settimeout(timeout)
    head = b""
    while len(head) < 4:
        c = s.recv(4 - len(head))
        if not c:
            return None
        head += c
    (n,) = struct.unpack(">I", head)
    body = b""
    while len(body) < n:
        c = s.recv(n - len(body))
        if not c:
            return None
        body += c
    return msgpack.unpackb(body, raw=False, strict_map_key=False)


def register_body(rid: int = 0, client_id: str = "hostile") -> bytes:
    obj: dict[str, Any] = {"v": P.PROTOCOL_VERSION, "op": "register", "id": rid}
    fields = P.Register(client_id, os.getpid(), NS, NS.digest(), CB).fields_to_wire()
    fields["namespace"] = namespace_to_wire(NS)
    obj.update(fields)
    return msgpack.packb(obj, use_bin_type=True)


def raw_conn(path: str) -> tuple[socket.socket, int]:
    """A registered raw connection and the segment fd the server passed."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.settimeout(5)
    s.sendall(frame(register_body()))
    head, fds, _, _ = socket.recv_fds(s, 4, 4)
    (n,) = struct.unpack(">I", head)
    body = b""
    while len(body) < n:
        body += s.recv(n - len(body))
    reply = msgpack.unpackb(body, raw=False)
    assert reply["ok"], reply
    assert len(fds) == 1
    return s, fds[0]


def call(s: socket.socket, obj: dict[str, Any], timeout: float = 5.0) -> dict[str, Any] | None:
    s.sendall(frame(msgpack.packb(obj, use_bin_type=True)))
    return recv_reply(s, timeout)


def normal_client_works(path: str) -> None:
    """Register, reserve/commit a 3-chunk chain, look it up and load it back byte-exact."""
    c = ServiceClient(path, NS, "normal", wait_connected_s=10, timeout_s=5)
    try:
        assert c.connected
        keys = [os.urandom(32) for _ in range(3)]
        parent = None
        for k in keys:
            buf = c.open_write(k, parent)
            assert buf is not None, "no slot for a normal client"
            buf[:] = payload_for(k, CB)
            c.commit(k, parent)
            parent = k
        assert c.flush(5)
        assert c.lookup_keys(keys).num_tokens == 3 * CHUNK
        handles = c.open_read_many(list(zip(keys, [None, *keys[:-1]])))
        for k, h in zip(keys, handles):
            assert h is not None
            assert (h.buffer == payload_for(k, CB)).all()
            h.close()
    finally:
        c.close()


V = P.PROTOCOL_VERSION


# -- 1. a client truncates the shared segment it was handed: SIGBUS kills the server -----------------
@pytest.mark.slow
def test_client_truncating_the_passed_segment_does_not_crash_the_server(server: Server) -> None:
    """The register reply passes the namespace's memfd (read-write, unsealed); ``ftruncate(fd, 0)`` on it
    makes every later touch of the pool a SIGBUS: the server's commit checksum dies on it (exit -7),
    and every engine with the segment mapped would too. Expected: the segment is sealed against
    shrinking (F_SEAL_SHRINK), or the attack is otherwise refused; the server keeps serving."""
    s, fd = raw_conn(server.sock_path)
    key = os.urandom(32)
    r = call(s, {"v": V, "id": 1, "op": "reserve", "key": key})
    assert r is not None and r["ok"] and r["slot"] is not None
    try:
        os.ftruncate(fd, 0)
    except OSError:
        pass  # sealed: the fix
    finally:
        os.close(fd)
    try:
        call(s, {"v": V, "id": 2, "op": "commit", "key": key}, timeout=5)
    except OSError:
        pass
    time.sleep(0.5)
    assert server.proc.poll() is None, f"server died (exit {server.proc.returncode}) after a client truncated its segment"
    normal_client_works(server.sock_path)


# -- 2. a parent cycle pins the CPU pool for good ----------------------------------------------------
@pytest.mark.slow
def test_parent_cycle_cannot_pin_the_pool_forever(tmp_short: Path) -> None:
    """``reserve_many`` refuses a chunk that is its own parent, but not two chunks that are each other's
    (A's parent B, B's parent A): both then have a resident child, so leaf-first eviction never offers
    them, ``clear`` skips them (cpu.py: "a parent cycle; cannot happen"), and 8 such pairs from one
    client fill a 16-slot pool for every other client until the server restarts."""
    srv = Server(tmp_short, 16)
    try:
        s, fd = raw_conn(srv.sock_path)
        os.close(fd)
        for i in range(8):
            a, b = os.urandom(32), os.urandom(32)
            r = call(s, {"v": V, "id": 3 * i + 1, "op": "reserve_many", "keys": a + b, "parents": [b, a]})
            assert r is not None
            if not r["ok"]:
                return  # refused: the fix
            call(s, {"v": V, "id": 3 * i + 2, "op": "commit", "key": a, "parent": b})
            call(s, {"v": V, "id": 3 * i + 3, "op": "commit", "key": b, "parent": a})
        s.close()
        c = ServiceClient(srv.sock_path, NS, "victim", wait_connected_s=10, timeout_s=5)
        try:
            assert c.connected
            c.clear()
            got = c.open_write_many([os.urandom(32)], [None])
            assert got[0] is not WriteSkip.NO_ROOM, (
                "after a hostile client's 2-chunk parent cycles (and a clear), the pool has no room for anyone"
            )
        finally:
            c.close()
    finally:
        srv.close()


# -- 3. a one-way request with a bad field is answered ----------------------------------------------
@pytest.mark.slow
def test_noreply_request_with_a_bad_field_gets_no_reply(server: Server) -> None:
    """messages.py: 'Requests with "noreply": true ... get no reply, even on error, so the stream stays
    in step.' A one-way commit whose key is 31 bytes (or whose parent is its key) is answered with a
    bad_message reply, which the sender reads as the reply of its next request."""
    s, fd = raw_conn(server.sock_path)
    os.close(fd)
    s.sendall(frame(msgpack.packb({"v": V, "id": 5, "op": "commit", "noreply": True, "key": b"x" * 31},
                                  use_bin_type=True)))
    r = call(s, {"v": V, "id": 6, "op": "health"})
    assert r is not None
    assert r["id"] == 6, f"the one-way commit was answered ({r}): the stream is out of step"


# -- 4. v = 2.0 accepted -----------------------------------------------------------------------------
@pytest.mark.slow
def test_float_version_is_refused(server: Server) -> None:
    """The envelope's ``v`` is an int (``_WireEnvelope.v: int``); 2.0 fails the fast path, and the
    fallback's ``obj.get("v") != PROTOCOL_VERSION`` lets it through (2.0 == 2)."""
    s, fd = raw_conn(server.sock_path)
    os.close(fd)
    r = call(s, {"v": float(V), "id": 7, "op": "stats"})
    assert r is not None and r["id"] == 7
    assert r["ok"] is False and r["code"] == "bad_version", f"a float version was accepted: {str(r)[:120]}"


# -- 5. msgpack extension types slip through the fast path -------------------------------------------
@pytest.mark.slow
def test_extension_type_in_a_request_is_refused_where_it_is_read(server: Server) -> None:
    """An ext value where the server reads a field (``op``) is BAD_MSGPACK naming the request; in a field
    no request has, it is skipped unread (the design, envelope.py: a newer client's extra fields reach an
    older server harmlessly; nothing of it is decoded or kept) and the request is served."""
    s, fd = raw_conn(server.sock_path)
    os.close(fd)
    body = b"\x83\xa1v" + bytes([V]) + b"\xa2id\x08\xa2op\xd4\x05\x00"  # op: fixext1 type 5
    s.sendall(frame(body))
    r = recv_reply(s)
    assert r is not None and r["id"] == 8 and r["ok"] is False and r["code"] == "bad_msgpack"
    body = b"\x84\xa1v" + bytes([V]) + b"\xa2id\x09\xa2op\xa5stats\xa1x\xd4\x05\x00"  # x: fixext1 type 5
    assert msgpack.unpackb(body, raw=False, ext_hook=lambda c, d: ("ext", c))["x"] == ("ext", 5)
    s.sendall(frame(body))
    r = recv_reply(s)
    assert r is not None and r["id"] == 9 and r["ok"] is True, "an unknown field was not skipped"


# -- 6. a 1 MiB frame decodes into ~65 MB ------------------------------------------------------------
def test_one_frame_cannot_make_the_server_allocate_fifty_times_its_size() -> None:
    """listener.py bounds what a peer makes the server hold to one frame body per connection; but
    ``kv_register.buffers`` is ``list[Any]`` (and the fallback ``unpack_body`` decodes any invalid body
    whole), so 1 MiB of nested empty arrays becomes ~1M Python lists (~65 MB) before the type check
    refuses it. Expected: bounded well below that (here: 16 MiB)."""
    inner = [[] for _ in range(16_000)]
    body = msgpack.packb({"v": V, "id": 1, "op": "kv_register", "kind": "shm", "buffers": [inner] * 64,
                          "shape": [1, 1, 1, 1], "layers": [[0, 0, 0, 0, 0]]})
    assert len(body) <= P.MAX_FRAME_BYTES
    tracemalloc.start()
    try:
        with pytest.raises(P.ProtocolError):
            decode_request_body(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"decoding one {len(body)} B frame allocated {peak / 1e6:.0f} MB"


# -- 7. the lookup endpoint has no timeouts: 16 stalled sockets lock the scheduler out ----------------
@pytest.mark.slow
def test_stalled_connections_do_not_lock_the_scheduler_out_of_the_lookup_endpoint(tmp_short: Path) -> None:
    """``LookupServer`` builds its ``FrameServer`` without ``ConnLimits`` (no handshake, idle or frame
    timeout) and refuses connections past 16: 16 sockets that each sent half a header hold every slot
    forever, and the scheduler's every lookup is a miss."""
    m = StorageManager(KVTierConfig(chunk_size=CHUNK, cpu_capacity=8 * CB), NS)
    path = str(tmp_short / "l.sock")
    srv = LookupServer(m, path)
    stalled: list[socket.socket] = []
    try:
        keys = m.keys(list(range(2 * CHUNK)))
        buf = m.open_write(keys[0], None)
        assert buf is not None
        buf[:] = payload_for(keys[0], CB)
        m.commit(keys[0], None)
        for _ in range(16):
            x = socket.socket(socket.AF_UNIX)
            x.connect(path)
            x.sendall(b"\x00\x00")  # half a frame header, then nothing
            stalled.append(x)
        time.sleep(6)  # longer than the cache server's default handshake timeout (5 s)
        cl = LookupClient(path, CHUNK, timeout_s=1.0)
        try:
            got = cl.lookup_keys(keys, None)
        finally:
            cl.close()
        assert got.num_tokens == CHUNK, "the scheduler is locked out by 16 stalled connections"
    finally:
        for x in stalled:
            x.close()
        srv.close()
        m.close()


# -- 8. the client hands out one slot for two keys -------------------------------------------------
class FakeServer:
    """Registers clients with a memfd segment, then answers each request with ``respond(request)``."""

    def __init__(self, d: Path, respond: Callable[[dict[str, Any]], dict[str, Any]], num_slots: int = 8,
                 sealed: bool = True):
        self.path = str(d / "fake.sock")
        self.respond = respond
        self.num_slots = num_slots
        self.ls = socket.socket(socket.AF_UNIX)
        self.ls.bind(self.path)
        self.ls.listen(4)
        # sealed against resizing as a real server's segment is (clients refuse an unsealed one)
        self.fd = os.memfd_create("fake-kvtier", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealed else 0))
        os.ftruncate(self.fd, CB * num_slots)
        if sealed:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        try:
            while True:
                r = recv_reply(c, timeout=30)
                if r is None:
                    return
                if r["op"] == "register":
                    rep = {"v": V, "id": r["id"], "ok": True, "server_pid": 1, "instance": b"12345678",
                           "segment": {"size": CB * self.num_slots, "slot_bytes": CB, "num_slots": self.num_slots},
                           "chunk_size": CHUNK}
                    socket.send_fds(c, [frame(msgpack.packb(rep, use_bin_type=True))], [os.dup(self.fd)])
                elif not r.get("noreply"):
                    c.sendall(frame(msgpack.packb(self.respond(r), use_bin_type=True)))
        except OSError:
            return

    def close(self) -> None:
        self.ls.close()
        for c in self.conns:
            c.close()
        os.close(self.fd)


def test_client_never_hands_out_one_slot_for_two_keys(tmp_short: Path) -> None:
    """A ``reserve_many`` reply that grants the same slot to two keys (malformed: a slot holds one chunk)
    is taken as is: ``open_write_many`` returns two views of one slot, so one chunk's bytes are
    committed under the other's key. Expected: the reply is refused (a miss / NO_ROOM)."""
    fake = FakeServer(tmp_short, lambda r: {"v": V, "id": r["id"], "ok": True, "slots": [0, 0], "skips": [0, 0]})
    c = ServiceClient(fake.path, NS, "c", wait_connected_s=5, timeout_s=1.0)
    try:
        assert c.connected
        k1, k2 = os.urandom(32), os.urandom(32)
        got = c.open_write_many([k1, k2], [None, k1])
        views = [g for g in got if not isinstance(g, WriteSkip)]
        ptrs = {v.__array_interface__["data"][0] for v in views}
        assert len(ptrs) == len(views), "two keys were handed the same shared-memory slot"
    finally:
        c.close()
        fake.close()


# -- 9. with a disk tier, one parent cycle and a clear hang the namespace and grow memory without bound ----
def test_clear_after_a_parent_cycle_on_disk_answers_and_keeps_the_namespace_serving(tmp_short: Path) -> None:
    """Two commits (A with parent B, B with parent A) reach the disk tier by write-behind; ``clear`` then
    runs ``DiskIndex.remove``, whose descendant walk has no visited set: it loops A, B, A, ... under the
    disk tier's lock, appending to a list (~17 MB/s of server RSS, 100% of a core) and never answers,
    and every other client's lookup of that namespace times out. Expected: clear answers in seconds."""
    srv = Server(tmp_short, 16, "--disk-path", str(tmp_short / "disk"), "--disk-capacity", str(1 << 20))
    try:
        s, fd = raw_conn(srv.sock_path)
        os.close(fd)
        a, b = os.urandom(32), os.urandom(32)
        r = call(s, {"v": V, "id": 1, "op": "reserve_many", "keys": a + b, "parents": [b, a]})
        assert r is not None
        if not r["ok"]:
            return  # refused: the fix
        call(s, {"v": V, "id": 2, "op": "commit", "key": a, "parent": b})
        call(s, {"v": V, "id": 3, "op": "commit", "key": b, "parent": a})
        r = call(s, {"v": V, "id": 4, "op": "flush", "timeout_s": 5.0}, timeout=10)
        assert r is not None and r.get("done") is True
        try:
            r = call(s, {"v": V, "id": 5, "op": "clear"}, timeout=5)
        except socket.timeout:
            r = None
        assert r is not None and r.get("ok") is True, "clear never answered (the server loops in DiskIndex.remove)"
        normal_client_works(srv.sock_path)
    finally:
        srv.proc.kill()  # a looping server would keep growing
        srv.close()


# -- 10. a field over a msgpack bound gets an error without the request id -----------------------------
@pytest.mark.slow
def test_error_for_a_string_over_the_msgpack_bound_names_the_request(server: Server) -> None:
    """A lookup whose owner has 70,000 characters (inside the 1 MiB frame) fails the fast path, and the
    fallback's ``unpack_body`` (``max_str_len`` 64 KiB) answers bad_msgpack with id -1 (a 300-character
    owner gets bad_message with its id and ``$.owner``). The client reads id -1 as a reply for another
    request and drops its connection, releasing every reservation, read and lease it held (the failure
    framing.py's MAX_ARRAY_LEN note says was fixed for arrays). Same for an array over 16,384 entries
    in a request with any other mistake (store_blocks with 20,000 block ids and a duplicate key)."""
    s, fd = raw_conn(server.sock_path)
    os.close(fd)
    r = call(s, {"v": V, "id": 4, "op": "lookup", "keys": os.urandom(32), "owner": "o" * 70_000})
    assert r is not None and r["ok"] is False
    assert r["id"] == 4, f"the error reply does not name the request: {r}"
    c = ServiceClient(server.sock_path, NS, "cl", wait_connected_s=10, timeout_s=2)
    try:
        assert c.connected
        c.lookup_keys([os.urandom(32)], "o" * 70_000)
        assert c.counters.disconnects == 0, "one over-long lease owner cost the client its connection"
    finally:
        c.close()


# -- 11. the frame and handshake deadlines are per recv, not per frame: a drip-feeding client outlives them --
def _drip_then_finish(s: socket.socket, body: bytes, secs: float, step: float = 0.4) -> dict[str, Any] | None:
    s.sendall(struct.pack(">I", len(body)))
    t0, i = time.monotonic(), 0
    try:
        while time.monotonic() - t0 < secs and i < len(body) - 1:
            s.send(body[i:i + 1])
            i += 1
            time.sleep(step)
        s.sendall(body[i:])
        return recv_reply(s, 3)
    except OSError:
        return None  # closed: the fix


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["registered", "handshake"])
def test_a_drip_fed_frame_is_cut_off_at_the_frame_or_handshake_deadline(tmp_short: Path, phase: str) -> None:
    """``--frame-timeout-s``: 'Seconds to receive a started request'; ``--handshake-timeout-s``: 'Seconds a
    new connection has to register'. listener.py sets them with ``sock.settimeout`` before ``recv_exact``,
    which bounds each ``recv`` only: one byte every 0.4 s keeps a frame open indefinitely (here 3 s
    against deadlines of 1 s), and a register sent that way is accepted long after the handshake deadline."""
    srv = Server(tmp_short, 64, "--frame-timeout-s", "1", "--handshake-timeout-s", "1")
    try:
        if phase == "registered":
            s, fd = raw_conn(srv.sock_path)
            os.close(fd)
            body = msgpack.packb({"v": V, "id": 1, "op": "health"})
        else:
            s = socket.socket(socket.AF_UNIX)
            s.connect(srv.sock_path)
            body = register_body()
        r = _drip_then_finish(s, body, 3.0)
        assert r is None, f"a frame drip-fed over 3 s was served despite a 1 s deadline: {str(r)[:100]}"
    finally:
        srv.close()


# -- 12. --max-clients is exceeded by --max-unauthenticated registered connections -----------------------
@pytest.mark.slow
def test_max_clients_bounds_registered_connections(tmp_short: Path) -> None:
    """``--max-clients 8``: 'Concurrent client connections' (options: 'more are refused'). The session table
    is sized ``max_clients + max_unauthenticated`` (server.py) so that unregistered sockets cannot keep an
    engine out, but nothing caps the *registered* ones at ``max_clients``: 24 register (and each may hold a
    1 MiB frame buffer and a thread), the 25th is refused."""
    srv = Server(tmp_short, 64, "--max-clients", "8")
    socks: list[socket.socket] = []
    try:
        registered = 0
        for _ in range(12):
            s = socket.socket(socket.AF_UNIX)
            s.connect(srv.sock_path)
            s.settimeout(3)
            socks.append(s)
            try:
                s.sendall(frame(register_body()))
                head, fds, _, _ = socket.recv_fds(s, 4, 4)
                for f in fds:
                    os.close(f)
                (n,) = struct.unpack(">I", head)
                body = b""
                while len(body) < n:
                    body += s.recv(n - len(body))
                registered += bool(msgpack.unpackb(body).get("ok"))
            except OSError:
                pass
        assert registered <= 8, f"{registered} connections registered with --max-clients 8"
    finally:
        for s in socks:
            s.close()
        srv.close()


# -- 13. a full-size load_blocks reply does not fit the client's 64 KiB reply buffer -------------------
def test_client_reads_the_reply_of_a_max_size_load_blocks(tmp_short: Path) -> None:
    """``load_blocks`` takes up to MAX_KEYS (16,384) keys in one frame (~600 KB here); the server answers
    ``sources`` with one tier name per loaded chunk: 16,384 x "cpu" is 65,536+ bytes of msgpack, over the
    client's fixed 64 KiB reply buffer (connection.py ``_RECV_BYTES``). The client raises TOO_LARGE,
    drops its connection and reports every chunk a miss although the server loaded them all. The fake
    server here sends exactly the reply the real one would."""
    from kvtier.protocol.messages import KVRegister, ShmBuffer

    def respond(r: dict[str, Any]) -> dict[str, Any]:
        if r["op"] == "kv_register":
            return {"v": V, "id": r["id"], "ok": True, "num_layers": 1, "num_blocks": 4, "page_bytes": 512,
                    "device": "cpu", "pinned": False}
        if r["op"] == "load_blocks":
            n = len(r["keys"]) // 32
            return {"v": V, "id": r["id"], "ok": True, "sources": ["cpu"] * n}
        return {"v": V, "id": r["id"], "ok": True}

    fake = FakeServer(tmp_short, respond)
    c = ServiceClient(fake.path, NS, "c", wait_connected_s=5, timeout_s=2.0)
    try:
        assert c.connected
        req = KVRegister("shm", [ShmBuffer("kvtier-kvtest-x", 4096)], (4, 1, 16, 32), [(0, 0, 2048, 512, 32)])
        assert c.register_kv(req) is not None
        n = P.MAX_KEYS
        ks = [i.to_bytes(32, "big") for i in range(1, n + 1)]
        got = c.load_blocks(ks, [None, *ks[:-1]], [[i % 4] for i in range(n)])
        assert got == ["cpu"] * n, (
            f"a well-formed {n}-chunk load_blocks reply was dropped "
            f"({sum(g is None for g in got)} misses, disconnects={c.counters.disconnects})"
        )
    finally:
        c.close()
        fake.close()


# -- 14. a server that shrinks the segment it passed kills the engine with SIGBUS ------------------------
_CLIENT_CHILD = r"""
import os, sys
sys.path.insert(0, sys.argv[2])
from conftest import small_namespace
from kvtier.service.client import ServiceClient
ns = small_namespace()
c = ServiceClient(sys.argv[1], ns, "child", wait_connected_s=5, timeout_s=1.0)
assert c.connected
print("connected", flush=True)
sys.stdin.readline()  # the parent shrinks the segment now
buf = c.open_write(os.urandom(32), None)
if buf is not None:
    buf[:] = 7  # the engine's copy into the slot
print("survived", flush=True)
c.close()
"""


@pytest.mark.slow
def test_client_survives_a_server_that_shrinks_the_segment(tmp_short: Path) -> None:
    """The client maps the fd the server passed after checking its size once (``attach_fd``), and does
    not require it sealed: a server (or any process holding the fd) that ``ftruncate``s it afterwards
    makes the engine's next copy into a slot a SIGBUS (exit -7). Expected: the client refuses an
    unsealed segment (F_SEAL_SHRINK) or otherwise survives."""
    fake = FakeServer(tmp_short, lambda r: {"v": V, "id": r["id"], "ok": True, "slots": [0], "skips": [0]},
                      sealed=False)
    tests_dir = str(Path(__file__).resolve().parent)
    child = subprocess.Popen([sys.executable, "-c", _CLIENT_CHILD, fake.path, tests_dir],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline()
        if "connected" not in line:
            child.wait(10)
            return  # refused the unsealed segment: the fix
        os.ftruncate(fake.fd, 0)
        child.stdin.write("go\n")
        child.stdin.flush()
        rc = child.wait(20)
        assert rc == 0, f"the client process died with exit {rc} after the server shrank its segment"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(5)
        fake.close()
