"""Cache service lifecycles across processes: a client killed mid-store/mid-load, two engine
processes sharing one server, and a server restart served from its disk tier.

Child processes run this file as a script (``python tests/test_service_lifecycle.py MODE SOCKET``).
"""

from __future__ import annotations

import pytest

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from conftest import payload_for, small_namespace

KEYS = [bytes([0xA0 + i]) * 32 for i in range(4)]
HERE = Path(__file__).resolve()


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}


def run_child(mode: str, sock: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(HERE), mode, str(sock), *args],
        env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _store(c, keys: list[bytes]) -> None:  # type: ignore[no-untyped-def]
    parent = None
    for k in keys:
        buf = c.open_write(k, parent)
        assert buf is not None, "store skipped"
        buf[:] = payload_for(k, c.chunk_bytes)
        c.commit(k, parent)
        parent = k


def child_main(mode: str, sock: str, *args: str) -> None:
    from kvtier.service.client import ServiceClient

    c = ServiceClient(sock, small_namespace(), args[0] if args else f"engine-{mode}", timeout_s=5, wait_connected_s=30)
    assert c.connected
    if mode == "hold":
        # Commit one chunk, then stop mid-store (reserved slot) and mid-load (read reference), with a lease.
        _store(c, KEYS[:1])
        assert c.open_write(KEYS[1], None) is not None
        handle = c.open_read(KEYS[0])
        assert handle is not None
        assert c.lookup_keys(KEYS[:1], "req-1").num_tokens == 32
        print("READY", flush=True)
        time.sleep(600)
    elif mode == "store":
        _store(c, KEYS)
        assert c.flush(10)
        print(json.dumps({"stored": len(KEYS)}), flush=True)
    elif mode == "load":
        res = c.lookup_keys(KEYS, "req-b")
        ok = []
        for k in res.keys:
            with c.open_read(k) as h:
                ok.append(bool(np.array_equal(h.buffer, payload_for(k, c.chunk_bytes))))
        c.release("req-b")
        print(json.dumps({"hit_tokens": res.num_tokens, "tiers": res.tiers, "payload_ok": ok}), flush=True)
    c.close()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    child_main(*sys.argv[1:])
    sys.exit(0)

# ---------------------------------------------------------------------------------- tests
from service_helpers import connect, short_dir, start_server, start_server_process, wait_until  # noqa: E402,F401


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def test_sigkilled_client_releases_its_reservations_reads_and_leases(short_dir: Path) -> None:
    with start_server(short_dir, cpu_chunks=4) as srv:
        child = run_child("hold", short_dir / "s.sock")
        try:
            line = child.stdout.readline()  # type: ignore[union-attr]
            assert line.strip() == "READY", child.stderr.read()  # type: ignore[union-attr]
            host = srv.hosts()[0]
            m = host.manager
            assert srv.total_holds() == 2 and len(m.leases) == 1 and m.cpu.referenced_chunks() == 2
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
            wait_until(lambda: srv.num_sessions() == 0, what="killed client's session to end")
            assert srv.total_holds() == 0
            assert len(m.leases) == 0 and m.leases.pinned_keys == 0
            assert m.cpu.referenced_chunks() == 0
            assert m.contains(KEYS[0]), "a committed chunk must survive its writer"
            assert not m.contains(KEYS[1]) and len(m.cpu) == 1, "the half-written chunk must be dropped"
            assert host.pool.num_free == host.pool.num_slots - 1
            # The killed engine's chunk is served to the next client.
            c = connect(short_dir / "s.sock", client_id="engine-b")
            with c.open_read(KEYS[0]) as h:
                assert np.array_equal(h.buffer, payload_for(KEYS[0], c.chunk_bytes))
            c.close()
        finally:
            _stop(child)


@pytest.mark.slow
def test_two_engine_processes_share_one_server(short_dir: Path) -> None:
    server = start_server_process(short_dir, disk=False)
    try:
        a = run_child("store", short_dir / "s.sock", "engine-a")
        out_a, err_a = a.communicate(timeout=120)
        assert a.returncode == 0, err_a
        b = run_child("load", short_dir / "s.sock", "engine-b")
        out_b, err_b = b.communicate(timeout=120)
        assert b.returncode == 0, err_b
        got = json.loads(out_b.strip().splitlines()[-1])
        assert got["hit_tokens"] == len(KEYS) * 32 and got["tiers"] == ["cpu"] * len(KEYS)
        assert got["payload_ok"] == [True] * len(KEYS)  # B reads exactly the bytes A wrote
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.slow
def test_server_restart_serves_its_disk_tier_and_clients_reconnect(short_dir: Path) -> None:
    server = start_server_process(short_dir, disk=True)
    c = None
    try:
        c = connect(short_dir / "s.sock", timeout_s=0.5, backoff_max_s=0.2)
        for k in KEYS[:3]:
            buf = c.open_write(k, None)
            assert buf is not None
            buf[:] = payload_for(k, c.chunk_bytes)
            c.commit(k, None)
        assert c.flush(10)
        assert c.stats()["disk_written_chunks"] == 3
        server.kill()  # no clean shutdown
        server.wait(timeout=30)
        # Server down: calls are misses, quickly (the first one finds the connection dead).
        t0 = time.monotonic()
        assert c.lookup_keys(KEYS[:3]).num_tokens == 0
        assert c.open_read(KEYS[0]) is None and c.open_write(KEYS[3], None) is None
        assert time.monotonic() - t0 < 5  # hang guard
        assert not c.connected
        server = start_server_process(short_dir, disk=True)
        wait_until(lambda: c.connected, timeout_s=60, what="client to reconnect by itself")
        res = c.lookup_keys(KEYS[:3])
        assert res.num_tokens == 96 and res.tiers == ["disk"] * 3
        for k in KEYS[:3]:
            with c.open_read(k) as h:
                assert h.source == "disk"
                assert np.array_equal(h.buffer, payload_for(k, c.chunk_bytes))
        assert c.counters.connects == 2
    finally:
        if c is not None:
            c.close()
        server.terminate()
        server.wait(timeout=30)


def test_the_server_bounds_malloc_arenas_unless_the_environment_does(monkeypatch) -> None:
    """Unbounded glibc arenas let the server's RSS creep under client churn (bench soak: +14% in
    10 minutes); the server sets M_ARENA_MAX at start, and a user's MALLOC_ARENA_MAX wins."""
    import platform

    from kvtier.service.main import limit_malloc_arenas

    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas() is False  # glibc honours the user's own setting
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert limit_malloc_arenas() is True
