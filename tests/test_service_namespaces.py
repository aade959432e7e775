"""Namespaces share the server's CPU capacity dynamically (issue 14, item 6).

One byte budget (:mod:`kvtier.memory.budget`) for every hosted namespace: one
alone fills (nearly) the whole capacity, a newcomer takes back its fair share by
evicting the others' unreferenced, unpinned leaf chunks, and the memory backing
the segments stays within the capacity. Loopback Unix sockets; bounded waits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import payload_for, small_namespace
from service_helpers import connect, server_config, short_dir, start_server, wait_until  # noqa: F401 (fixture)

from kvtier.index.keys import KeyNamespace
from kvtier.memory.budget import ByteBudget
from kvtier.memory.pool import ChunkPool, PoolExhausted
from kvtier.service.client import ServiceClient
from kvtier.service.server import CacheServer, ServerOptions

PAGE = 4096


def keys(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i % 256, i // 256]) + bytes(29) for i in range(n)]


def store(c: ServiceClient, ks: list[bytes], chain: bool = True) -> int:
    """Store ``ks`` as one chain (or as one-chunk prompts); returns how many were stored."""
    parent, done = None, 0
    for k in ks:
        buf = c.open_write(k, parent)
        if buf is None:
            break
        buf[:] = payload_for(k, c.chunk_bytes)
        c.commit(k, parent)
        parent, done = (k if chain else None), done + 1
    return done


def ns_of(model: str, chunk_size: int = 64) -> KeyNamespace:
    """A namespace of ``chunk_size * 64`` byte chunks (64: one 4 KiB page)."""
    return small_namespace(model=model, chunk_size=chunk_size)


def used(srv: CacheServer) -> dict[str, int]:
    return {h.namespace.model: h.pool.charged_bytes for h in srv.hosts()}


def check(srv: CacheServer, capacity: int) -> None:
    """The budget's invariant, each pool's charge, and the pages really backed."""
    hosts = srv.hosts()
    for h in hosts:
        h.pool.check_budget()
        h.manager.cpu.check_invariants()
    assert sum(h.pool.charged_bytes for h in hosts) <= capacity
    assert sum(h.segment.resident_bytes() for h in hosts) <= capacity


def start(d: Path, capacity: int, **opts: object) -> CacheServer:
    cfg = server_config(chunk_size=64, cpu_capacity=capacity)
    return CacheServer(cfg, ServerOptions(socket_path=str(d / "s.sock"), **opts)).start()  # type: ignore[arg-type]


# -- the squatter of issue 14 item 6 -------------------------------------------------------------
def test_a_connected_squatter_does_not_lock_out_an_engine_of_another_model(short_dir: Path) -> None:
    # Before: max_namespaces defaulted to 1, so the engine was refused (namespace_mismatch).
    with start_server(short_dir, cpu_chunks=16) as srv:
        squatter = connect(short_dir / "s.sock", ns=small_namespace(model="squatter/any"), client_id="squatter",
                           sync_commit=True)
        assert store(squatter, keys(1, 16)) == 16  # and it fills the whole pool
        engine = connect(short_dir / "s.sock", client_id="engine", sync_commit=True)
        ks = keys(2, 8)
        assert store(engine, ks) == 8
        assert engine.lookup_keys(ks).num_tokens == 8 * engine.chunk_size
        h = engine.open_read(ks[-1], ks[-2])
        assert h is not None and np.array_equal(h.buffer, payload_for(ks[-1], engine.chunk_bytes))
        h.close()
        assert squatter.connected and squatter.lookup_keys(keys(1, 16)).num_tokens == 8 * squatter.chunk_size
        srv.check_invariants()
        engine.close()
        squatter.close()


# -- sharing -------------------------------------------------------------------------------------
def test_one_namespace_alone_fills_the_capacity(short_dir: Path) -> None:
    # Before: with --max-namespaces 4 one namespace got a fixed quarter (4 of 16 chunks).
    cap = 16 * PAGE
    with start(short_dir, cap, max_namespaces=4) as srv:
        a = connect(short_dir / "s.sock", ns=ns_of("test/a"), sync_commit=True)
        ks = keys(1, 16)
        assert store(a, ks) == 16
        assert a.lookup_keys(ks).num_tokens == 16 * a.chunk_size
        assert used(srv) == {"test/a": cap}
        check(srv, cap)
        a.close()


def test_two_namespaces_converge_to_fair_shares_and_pins_are_kept(short_dir: Path) -> None:
    cap = 16 * PAGE
    with start(short_dir, cap) as srv:
        a = connect(short_dir / "s.sock", ns=ns_of("test/a"), client_id="a", sync_commit=True)
        b = connect(short_dir / "s.sock", ns=ns_of("test/b", chunk_size=128), client_id="b", sync_commit=True)
        ka, kb = keys(1, 16), keys(2, 16)
        assert store(a, ka) == 16
        assert a.lookup_keys(ka[:2], "a-lease").num_tokens == 2 * a.chunk_size  # pinned: never evicted
        # 8 KiB one-chunk prompts: a's tail is evicted up to b's fair share, then b recycles its own.
        assert store(b, kb, chain=False) == 16
        assert used(srv) == {"test/a": cap // 2, "test/b": cap // 2}
        assert a.lookup_keys(ka).num_tokens == 8 * a.chunk_size  # the head (and its pins) stayed
        assert b.lookup_keys(kb[-4:][::-1][:1]).num_tokens == b.chunk_size
        more = keys(3, 8)
        assert store(a, more, chain=False) == 8  # at its fair share: it recycles its own slots
        assert used(srv) == {"test/a": cap // 2, "test/b": cap // 2}
        assert srv.hosts()[0].manager.stats()["cpu_evicted_chunks"] > 0
        check(srv, cap)
        a.close()
        b.close()


def test_three_namespaces_storing_at_once_keep_the_budget(short_dir: Path) -> None:
    cap = 24 * PAGE
    with start(short_dir, cap) as srv:
        clients = [
            connect(short_dir / "s.sock", ns=ns_of(f"test/{i}", 64 * (i + 1)), client_id=f"c{i}", sync_commit=True)
            for i in range(3)
        ]
        stored = [0, 0, 0]

        def run(i: int) -> None:
            for r in range(20):
                stored[i] += store(clients[i], keys(16 * i + r, 6), chain=r % 2 == 0)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a store hung"
        check(srv, cap)
        srv.check_invariants()
        assert all(v > 0 for v in used(srv).values()) and all(stored)
        for c in clients:
            c.close()


@pytest.mark.slow
def test_a_released_namespace_returns_its_share(short_dir: Path) -> None:
    cap = 8 * PAGE
    with start(short_dir, cap, namespace_idle_s=0.05) as srv:
        a = connect(short_dir / "s.sock", ns=ns_of("test/a"), client_id="a", sync_commit=True)
        b = connect(short_dir / "s.sock", ns=ns_of("test/b"), client_id="b", sync_commit=True)
        assert store(a, keys(1, 8)) == 8 and store(b, keys(2, 8), chain=False) == 8
        assert used(srv) == {"test/a": cap // 2, "test/b": cap // 2}
        a.close()
        wait_until(lambda: len(srv.hosts()) == 1, timeout_s=10, what="idle namespace released")
        assert store(b, keys(3, 8), chain=False) == 8
        assert used(srv) == {"test/b": cap}
        check(srv, cap)
        b.close()


@pytest.mark.slow
def test_disk_capacity_follows_the_hosted_namespaces(short_dir: Path) -> None:
    """A lone namespace gets the whole disk tier; a second halves both (evicting leaves); a release grows it back.

    Before: each namespace got ``disk_capacity / max_namespaces`` whatever was hosted
    (1/8 of the disk for a single-model server once max_namespaces defaulted to 8).
    """
    cap, disk = 16 * PAGE, 64 * PAGE
    cfg = server_config(chunk_size=64, cpu_capacity=cap, disk_path=short_dir / "disk", disk_capacity=disk)
    opts = ServerOptions(socket_path=str(short_dir / "s.sock"), namespace_idle_s=0.05)
    with CacheServer(cfg, opts).start() as srv:
        a = connect(short_dir / "s.sock", ns=ns_of("test/a"), client_id="a", sync_commit=True)
        (ha,) = srv.hosts()
        assert ha.manager.disk is not None and ha.manager.disk.capacity_bytes == disk
        for i in range(4):  # 4 chains of 8 chunks (write-behind fills the disk tier)
            assert store(a, keys(10 + i, 8)) == 8
            assert a.flush(10)
        before = len(ha.manager.disk)
        b = connect(short_dir / "s.sock", ns=ns_of("test/b"), client_id="b", sync_commit=True)
        assert b.lookup_keys(keys(1, 1)).num_tokens == 0  # registered
        hb = next(h for h in srv.hosts() if h is not ha)
        assert ha.manager.disk.capacity_bytes == hb.manager.disk.capacity_bytes == disk // 2
        assert ha.manager.disk.used_bytes <= disk // 2 and len(ha.manager.disk) < before
        ha.manager.disk.check_invariants()  # shrunk leaf-first: still prefix-closed
        b.close()
        wait_until(lambda: len(srv.hosts()) == 1, timeout_s=10, what="idle namespace released")
        wait_until(lambda: ha.manager.disk.capacity_bytes == disk, timeout_s=10, what="disk share grown back")
        a.close()


def test_pages_backed_outside_reservations_are_released(short_dir: Path) -> None:
    cap = 8 * PAGE
    with start(short_dir, cap) as srv:
        a = connect(short_dir / "s.sock", ns=ns_of("test/a"), sync_commit=True)
        assert store(a, keys(1, 2)) == 2
        host = srv.hosts()[0]
        assert host.segment.resident_bytes() == host.pool.charged_bytes == 2 * PAGE
        host.segment.array[4 * PAGE : 6 * PAGE] = 7  # as a client scribbling on free slots would
        assert host.segment.resident_bytes() == 4 * PAGE
        srv._namespaces.maintain()
        assert host.segment.resident_bytes() == 2 * PAGE and host.stats()["stray_page_trims"] == 1
        assert a.lookup_keys(keys(1, 2)).num_tokens == 2 * a.chunk_size
        check(srv, cap)
        a.close()


# -- the pool and the budget alone ---------------------------------------------------------------
def test_budget_pool_charges_spares_and_gives_back() -> None:
    budget = ByteBudget(4 * 100)
    released: list[int] = []
    s1 = budget.share(lambda: p1.release_spare())
    p1 = ChunkPool(100, 4, budget=s1, release_pages=released.append)
    p2 = ChunkPool(100, 4, budget=budget.share(lambda: False))
    slots = [p1.alloc() for _ in range(4)]  # room in the budget: p1 takes all of it
    assert budget.used_bytes == 400 and p1.charged_bytes == 400
    for s in slots:
        p1.free(s)  # spares stay charged (pages backed)
    assert budget.used_bytes == 400 and p1.num_free == 4
    p2.alloc(), p2.alloc()  # below its fair share (200 B): p1 gives two spares back
    assert p1.charged_bytes == 200 and p2.charged_bytes == 200 and len(released) == 2
    with pytest.raises(PoolExhausted):  # p2 at its fair share: it must recycle its own
        p2.alloc()
    p1.check_budget(), p2.check_budget(), budget.check_invariants()
    s1.close()  # p1's namespace released: its share is the others'
    assert budget.used_bytes == 200 and budget.fair_share_bytes() == 400
    p2.alloc(), p2.alloc()
    assert budget.used_bytes == 400
    budget.check_invariants()
    assert ChunkPool(100, 2).alloc() == 0  # a pool without a budget is unchanged


def test_a_large_slot_is_reclaimed_from_many_small_ones() -> None:
    budget = ByteBudget(1000)
    small = ChunkPool(10, 100, budget=budget.share(lambda: small.release_spare()))
    big = ChunkPool(500, 2, budget=budget.share(lambda: False))
    for s in [small.alloc() for _ in range(100)]:
        small.free(s)
    assert big.alloc() >= 0  # 50 small slots given back for one big one
    assert small.charged_bytes == 500 and big.charged_bytes == 500 and budget.reclaimed_bytes == 500
    assert budget.pending_bytes == 0
    budget.check_invariants()


# -- the bound on the server's memory ------------------------------------------------------------
def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
def test_server_rss_stays_within_the_cpu_capacity(short_dir: Path) -> None:
    cap = 48 << 20
    cmd = [sys.executable, "-m", "kvtier.cli", "server", "--socket", str(short_dir / "s.sock"),
           "--cpu-capacity", str(cap), "--no-metrics"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: (short_dir / "s.sock").exists(), timeout_s=30, what="server socket")
        base = _rss(proc.pid)
        big = 2048  # tokens: 128 KiB chunks, 384 of them fill the capacity
        a = connect(short_dir / "s.sock", ns=ns_of("test/a", big), client_id="a", sync_commit=True)
        b = connect(short_dir / "s.sock", ns=ns_of("test/b", big), client_id="b", sync_commit=True)
        n = cap // a.chunk_bytes
        assert store(a, keys(1, n)) == n
        assert store(b, keys(2, n), chain=False) == n  # takes half of a's, whose pages are released
        assert a.lookup_keys(keys(1, n)).num_tokens == (n // 2) * a.chunk_size
        rss = _rss(proc.pid)
        print(f"server RSS: {base >> 20} MiB at start, {rss >> 20} MiB after ({cap >> 20} MiB capacity)")
        # Before: two pre-touched segments (or released slots left backed) = base + 72 MiB or more.
        assert rss <= base + cap + (12 << 20), f"server RSS {rss >> 20} MiB over {base >> 20} + {cap >> 20} MiB"
        a.close()
        b.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _series(srv: CacheServer, name: str) -> float:
    line = next(ln for ln in srv.metrics.exposition().decode().splitlines() if ln.startswith(name + " "))
    return float(line.split()[1])


@pytest.mark.slow
def test_counters_never_go_down_when_a_namespace_is_released(short_dir: Path) -> None:
    """/metrics summed the hosted namespaces' counters: releasing an idle one took its counts away,
    which Prometheus reads as a counter reset (a false spike in increase() with two namespaces)."""
    cap = 8 * PAGE
    with start(short_dir, cap, namespace_idle_s=0.05) as srv:
        a = connect(short_dir / "s.sock", ns=ns_of("test/a"), client_id="a", sync_commit=True)
        b = connect(short_dir / "s.sock", ns=ns_of("test/b"), client_id="b", sync_commit=True)
        assert store(a, keys(1, 4)) == 4 and store(b, keys(2, 2), chain=False) == 2
        assert a.open_read_many([(k, None) for k in keys(9, 3)]) == [None] * 3  # 3 load failures in a
        before = {n: _series(srv, n) for n in ("kvtier_stored_chunks_total", "kvtier_load_failures_total")}
        assert before == {"kvtier_stored_chunks_total": 6.0, "kvtier_load_failures_total": 3.0}
        a.close()
        wait_until(lambda: len(srv.hosts()) == 1, timeout_s=10, what="idle namespace released")
        assert {n: _series(srv, n) for n in before} == before
        assert _series(srv, "kvtier_namespaces") == 1.0  # the kept totals are not a namespace
        assert store(b, keys(3, 1), chain=False) == 1
        assert _series(srv, "kvtier_stored_chunks_total") == 7.0
        b.close()
