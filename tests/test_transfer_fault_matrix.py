"""The transfer fault matrix (issue 11 part 4) with real peer processes.

Each test runs one side in a child process (:class:`transfer_helpers.PeerProcess`: a
StorageManager serving peers, or one pulling from a peer) with a fault injected into the
real channel code path, over TCP and shared memory, and checks real state afterwards:
the serving side holds no read reference, lease or pin (its stats, invariants checked),
the pulling side holds only chunks byte-identical to the source (a chunk that did not
arrive intact is a miss, so the engine recomputes it), and every call returned within
a generous wall-clock guard (a hang guard, not a speed target).

Rows covered elsewhere: channel-level sender/receiver SIGKILL mid-batch
(tests/test_transfer_faults.py), PD aborts on either side and lease expiry with a real
``kvtier server`` (tests/test_pd_protocol.py), a SIGKILLed client's reads, reservations
and leases at the server (tests/test_service_lifecycle.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import CHUNK, free_port, payload_for, small_namespace, wait_until
from fake_vllm import expected_kv
from test_pd_protocol import CHUNK as PD_CHUNK
from test_pd_protocol import GEOM, cluster, decode, req, tokens_of, wait_sending  # noqa: F401 (fixture)
from transfer_helpers import CB, PeerProcess, peer_keys, store_chain
from kvtier.config import KVTierConfig
from kvtier.storage.manager import StorageManager
from kvtier.transfer.assembly import open_manager

#: Hang guard (seconds) of one pull or clean-up (peer timeouts here are 10 s; a dead peer is seen at once).
HANG_S = 30.0
NCHUNKS = 5


@pytest.fixture(autouse=True)
def _peer_keys(fleet, monkeypatch) -> None:
    """TCP peers authenticate: every process of a test finds the test fleet's keys in TEST_PEER_KEYS."""
    monkeypatch.setenv("TEST_PEER_KEYS", json.dumps({n: fleet.config(n) for n in ("a", "b", "c")}))


@pytest.fixture(params=["tcp", "shm"])
def url(request, tmp_path: Path) -> str:
    if request.param == "tcp":
        return f"tcp://127.0.0.1:{free_port()}"
    return f"shm://{tmp_path}/peer.sock"


def _tokens() -> list[int]:
    return list(range(NCHUNKS * CHUNK + 1))


def _puller(url: str, **kw: object) -> StorageManager:
    fields: dict[str, object] = dict(chunk_size=CHUNK, cpu_capacity=64 * CB, peers=[url], peer_timeout_s=10.0,
                                     peer_retry_s=0.2, **peer_keys(url, "c"))
    fields.update(kw)
    return open_manager(KVTierConfig(**fields), small_namespace())  # type: ignore[arg-type]


def _server(url: str) -> StorageManager:
    cfg = KVTierConfig(chunk_size=CHUNK, cpu_capacity=64 * CB, peer_listen=url, peer_timeout_s=2.0,
                       **peer_keys(url, "a"))
    return open_manager(cfg, small_namespace())


def _pull(b: StorageManager, keys: list[bytes]) -> list[bool]:
    """B pulls ``keys``; per key: hit. Asserts every hit is byte-identical and B's state is consistent."""
    t0 = time.monotonic()
    handles = b.open_read_many([(k, None) for k in keys])
    assert time.monotonic() - t0 < HANG_S, "pull hung"
    try:
        for k, h in zip(keys, handles):
            assert h is None or np.array_equal(h.buffer, payload_for(k, CB)), "wrong data served as a hit"
    finally:
        for h in handles:
            if h is not None:
                h.close()
    for k, h in zip(keys, handles):
        assert h is not None or not b.cpu.contains(k), "a failed chunk was left in B's CPU tier"
    b.check_invariants()
    s = b.stats()
    assert s["referenced_chunks"] == 0 and s["leases"] == 0 and s["pinned_chunks"] == 0
    return [h is not None for h in handles]


def _served_cleanly(a: PeerProcess) -> None:
    """The serving child ends with no reader reference, lease, pin or connection left (hang-guarded poll)."""
    def clean() -> bool:
        s = a.stats()
        return s["referenced_chunks"] == 0 and s["leases"] == 0 and s["pinned_chunks"] == 0 and s["connections"] == 0
    wait_until(clean, HANG_S, "serving peer released every reference, lease and connection")


# -- the sender side fails -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill_send:3", "abort_send:3", "corrupt:2", "truncate:3"])
def test_sender_fault_mid_transfer_is_a_miss_never_wrong_data(url: str, fault: str) -> None:
    """Peer killed (SIGKILL) or aborting mid-transfer, a corrupt chunk, a truncated payload: B gets misses for what
    did not arrive intact (recomputed by the engine), never wrong bytes, and stays usable."""
    if fault.startswith("truncate") and url.startswith("shm"):
        pytest.skip("shm payloads are not streamed: a truncated chunk is a size mismatch (test_transfer_channels)")
    a = PeerProcess("serve", url, NCHUNKS, fault)
    b = _puller(url)
    try:
        assert a.first is not None, "peer child did not start"
        keys = b.keys(_tokens())
        assert b.lookup(_tokens()).num_tokens == NCHUNKS * CHUNK  # B learns the chunks live on A
        hits = _pull(b, keys)
        if fault.startswith("corrupt"):
            assert hits == [True, False, True, True, True]  # only the corrupt chunk is a miss; the link goes on
            assert b.stats()["peer_get_corrupt"] == 1
            # A releases each read reference when B's ack for it arrives, on A's own thread:
            # B's call returns once it sent its acks, so poll (bounded) rather than race A.
            wait_until(lambda: a.stats()["referenced_chunks"] == 0, HANG_S, "serving peer released its reads")
            b.close()  # the link stayed up; once B hangs up A drops it
            _served_cleanly(a)
        else:
            assert hits == [False] * NCHUNKS  # a peer gone mid-pull: the whole call is a miss
            assert b.stats()["peer_errors"] == 1
            if fault.startswith("abort") or fault.startswith("truncate"):
                _served_cleanly(a)  # the aborting sender released its reads and dropped the link
    finally:
        b.close()
        a.stop()


# -- the receiver side fails ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill_recv:2", "abort"])
def test_receiver_killed_or_aborting_mid_transfer_leaks_nothing(url: str, fault: str) -> None:
    """B killed (SIGKILL) when its 2nd chunk arrives, or B giving up (its timeout) while A is slow: A releases
    every read reference of the transfer, drops the link and still serves the next peer correct bytes."""
    a = _server(url)
    try:
        store_chain(a, _tokens())
        real = a.open_read_many
        if fault == "abort":  # A is slower than B's timeout: B aborts the request and closes
            a.open_read_many = lambda items: (time.sleep(2.0), real(items))[1]  # type: ignore[method-assign]
        b = PeerProcess("pull", a.peer_server.url, NCHUNKS, "kill_recv:2" if fault != "abort" else "none",
                        timeout_s=0.5 if fault == "abort" else 10.0)
        try:
            if fault == "abort":
                assert b.first is not None and b.first["hits"] == [False] * NCHUNKS
                assert b.first["elapsed"] < HANG_S
            else:
                assert b.first is None  # it died mid-transfer
                b.proc.wait(HANG_S)
        finally:
            b.stop()
        wait_until(lambda: a.peer_server.connections == 0, HANG_S, "A dropped the dead/aborted link")
        wait_until(lambda: a.stats()["referenced_chunks"] == 0, HANG_S, "A released its read references")
        s = a.stats()
        assert s["leases"] == 0 and s["pinned_chunks"] == 0
        a.check_invariants()
        a.open_read_many = real  # type: ignore[method-assign]
        c = _puller(a.peer_server.url)
        try:
            assert _pull(c, c.keys(_tokens())) == [True] * NCHUNKS  # A still serves, intact
        finally:
            c.close()
    finally:
        a.close()


# -- the peer restarts ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_peer_restarted_between_lookup_and_pull(url: str) -> None:
    """A answers B's lookup, is SIGKILLed, and a new A process (fewer chunks) listens at the same address before
    B pulls: the pull is a miss or correct bytes, never a hang or an error; B then pulls what the new A holds."""
    a1 = PeerProcess("serve", url, NCHUNKS)
    b = _puller(url)
    a2 = None
    try:
        assert a1.first is not None
        keys = b.keys(_tokens())
        assert b.lookup(_tokens()).num_tokens == NCHUNKS * CHUNK
        a1.kill()
        a2 = PeerProcess("serve", url, 2)  # same address, a new process holding only the first 2 chunks
        assert a2.first is not None and a2.first["url"] == a1.first["url"], "restarted peer could not listen"
        first = _pull(b, keys)
        assert first[2:] == [False] * (NCHUNKS - 2)
        time.sleep(0.3)  # past peer_retry_s: B dials the new process
        assert _pull(b, [k for k, hit in zip(keys, first) if not hit]) == [True] * (2 - sum(first)) + \
            [False] * (NCHUNKS - 2)
        assert b.lookup(_tokens()).num_tokens == 2 * CHUNK
        _served_cleanly_after_close(b, a2)
    finally:
        b.close()
        a1.kill()
        if a2 is not None:
            a2.stop()


def _served_cleanly_after_close(b: StorageManager, a: PeerProcess) -> None:
    b.close()  # B's peer tier hangs up: A drops the link
    _served_cleanly(a)


# -- PD: a prefiller or decoder process killed (fake engines, a real kvtier server) ----------------------------
PD_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, sys.argv[1])
    import test_pd_protocol as t
    from fake_vllm import make_connectors
    import kvtier.integrations.vllm.worker as worker_mod
    role, sock, seed, length = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    cfg = dict(chunk_size=t.CHUNK, model_id="fake/pd-test", server=f"unix://{sock}", server_timeout_s=5.0,
               pd_role=role, lease_ttl_s=3600.0)
    prompt = t.tokens_of(seed, length)
    if role == "prefill":
        cfg["pd_port"] = int(sys.argv[6])
        side = t.Side(make_connectors(t.GEOM, cfg, engine_id="pd-prefill-child"))
        held, params = side.prefill(t.req("p-1", prompt, {"do_remote_decode": True}))
        print(json.dumps(params), flush=True)
        sys.stdin.readline()  # holds the blocks and its store lease until killed
    else:
        calls = [0]
        real = worker_mod.load_handle  # the worker's copy of one chunk into engine blocks
        def load_handle(*a, **kw):  # dies while loading its 2nd chunk (reads open at the server)
            calls[0] += 1
            if calls[0] == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **kw)
        worker_mod.load_handle = load_handle
        cfg["pd_sync_load_bytes"] = 0  # an async load: killed on the loader thread
        side = t.Side(make_connectors(t.GEOM, cfg, engine_id="pd-decode-child"))
        t.decode(side, t.req("d-1", prompt, json.loads(sys.argv[6])))
        print("NOT KILLED", flush=True)
""")


def _pd_child(role: str, sock: Path, seed: int, length: int, last: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    return subprocess.Popen([sys.executable, "-c", PD_CHILD, str(Path(__file__).parent), role, str(sock), str(seed),
                             str(length), last], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def _server_clean(srv) -> None:
    """The server holds no reservation, read reference or lease of any client (hang-guarded poll)."""
    m = srv.hosts()[0].manager
    wait_until(lambda: srv.total_holds() == 0 and m.cpu.referenced_chunks() == 0 and len(m.leases) == 0,
               HANG_S, "server released every hold, read and lease")
    srv.check_invariants()
    m.check_invariants()


@pytest.mark.slow  # waits out a lease: ~29 s on 2 cores
def test_pd_decoder_killed_mid_load_prefiller_frees_by_lease(cluster) -> None:  # noqa: F811 (fixture)
    """The decoder process dies while loading: the server drops its reads, the prefiller frees the request's
    blocks and store lease when pd_lease_s passes (no confirm), and a new decoder still gets the exact KV."""
    pre = cluster("prefill", free_port(), pd_lease_s=1.0)
    length = 4 * PD_CHUNK + 9
    prompt = tokens_of(21, length)
    held, params = pre.prefill(req("p-1", prompt, {"do_remote_decode": True}))
    assert held and params is not None
    child = _pd_child("decode", cluster.server.options.socket_path, 21, length, json.dumps(params))
    try:
        assert child.wait(HANG_S) == -signal.SIGKILL  # killed mid-load, as injected
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    wait_sending(pre, "p-1", timeout_s=HANG_S)  # freed by the lease, no confirm came
    pd = pre.worker.worker.pd
    assert pd.expired == 1 and pd.confirms == 0 and not pd.held
    pre.release_blocks("p-1")
    _server_clean(cluster.server)
    dec = cluster("decode", pd_sync_load_bytes=0)
    d = req("d-2", prompt, params)
    ext, errors = decode(dec, d, timeout_s=HANG_S)
    assert ext == length and not errors
    assert np.array_equal(dec.kv(d, 0, length), expected_kv(prompt, None, GEOM))


@pytest.mark.slow  # ~29 s on 2 cores
def test_pd_prefiller_killed_while_holding_decoder_gets_exact_kv_or_recomputes(cluster) -> None:  # noqa: F811
    """The prefiller process dies after handing out its params (holding blocks and a store lease): the server
    drops its lease, the decoder loads KV identical to the prompt's (or recomputes), and its confirm to the dead
    prefiller does not block."""
    port = free_port()
    length = 3 * PD_CHUNK + 5
    prompt = tokens_of(22, length)
    child = _pd_child("prefill", cluster.server.options.socket_path, 22, length, str(port))
    try:
        line = child.stdout.readline() if child.stdout else ""
        assert line.strip(), "prefiller child did not answer"
        params = json.loads(line)
        assert params["do_remote_prefill"] and params["remote_port"] == port
        child.kill()
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    _server_clean(cluster.server)  # the dead prefiller's lease ended with its connection
    dec = cluster("decode")
    d = req("d-1", prompt, params)
    t0 = time.monotonic()
    ext, errors = decode(dec, d, timeout_s=HANG_S, sync=True)  # the chunks are in the server's memory
    assert time.monotonic() - t0 < HANG_S
    good = ext if not errors else min(dec.blocks["d-1"].index(b) for b in errors) * GEOM.block_size
    assert np.array_equal(dec.kv(d, 0, good), expected_kv(prompt, None, GEOM)[:good])  # never wrong KV
    dec.step()  # the confirm to a dead prefiller was sent without blocking
    _server_clean(cluster.server)
