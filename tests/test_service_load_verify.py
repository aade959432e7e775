"""Client-side load verification (kvtier/service/load_verifier.py): every load still checked.

A client with ``verify="client"`` gets each CPU chunk's commit checksum with its handle
and hashes the slot on a helper thread; ``buffer`` waits for the verdict and raises
``ChunkUnavailable`` for a scribbled chunk, which the server then checks again and drops.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import payload_for
from kvtier import protocol as P
from kvtier.service.integrity import chunk_sum, chunk_sum_nogil
from kvtier.storage.types import ChunkUnavailable
from service_helpers import connect, short_dir, start_server, store, wait_until  # noqa: F401 (fixture)
from test_service_quotas import KEYS


def test_the_gil_free_hash_is_the_same_xxh3() -> None:
    rng = np.random.default_rng(5)
    for n in (1, 4095, 1 << 20, 5_898_240):
        a = rng.integers(0, 256, n, dtype=np.uint8)
        assert chunk_sum_nogil(a) == chunk_sum(a)
    strided = np.arange(1000, dtype=np.uint8)[::2]  # not contiguous: the python path
    assert chunk_sum_nogil(strided) == chunk_sum(np.ascontiguousarray(strided))


def _flat_view(flat: np.ndarray) -> np.ndarray:
    """A test namespace's flat slot as one layer of one block ``[1, 1, chunk_bytes]``."""
    return flat.reshape(1, 1, -1)


def _scribble(srv: object, short_dir: Path, key: bytes) -> None:
    """Overwrite ``key``'s committed slot through another client's read-write mapping."""
    host = srv.hosts()[0]  # type: ignore[attr-defined]
    wait_until(lambda: host.manager.cpu.contains(key), what="commit")
    h = host.manager.open_read(key)
    slot = host.pool.slot_of(h.buffer)
    h.close()
    evil = connect(short_dir / "s.sock", client_id="evil")
    view = evil._link.conn.slot(slot)
    assert view is not None
    view[:] = 0xEE
    evil.close()


def test_the_client_verifies_each_load_and_a_scribbled_chunk_raises_then_is_dropped(short_dir: Path) -> None:
    with start_server(short_dir) as srv:
        a = connect(short_dir / "s.sock", client_id="engine-a")
        store(a, KEYS[:3])
        _scribble(srv, short_dir, KEYS[1])
        b = connect(short_dir / "s.sock", client_id="engine-b", verify="client")
        handles = b.open_read_many([(KEYS[0], None), (KEYS[1], KEYS[0]), (KEYS[2], KEYS[1])])
        assert all(h is not None for h in handles)  # the server answered at once, unchecked
        assert np.array_equal(handles[0].buffer, payload_for(KEYS[0], b.chunk_bytes))
        with pytest.raises(ChunkUnavailable, match="commit checksum"):
            handles[1].buffer  # never the 0xEE bytes
        assert np.array_equal(handles[2].buffer, payload_for(KEYS[2], b.chunk_bytes))
        for h in handles:
            h.close()
        host = srv.hosts()[0]
        # The close reported it; the server checked the slot itself and counted it (a parent of a
        # resident chunk stays until that one goes, its sum kept: every later load of it fails).
        wait_until(lambda: host.sums.corrupt == 1, what="server confirms the scribbled chunk")
        assert b.counters.corrupt_loads == 1 and b._verifier.checked == 3
        again = b.open_read(KEYS[1], KEYS[0])
        assert again is not None
        with pytest.raises(ChunkUnavailable):
            again.buffer
        again.close()
        sv = connect(short_dir / "s.sock", client_id="engine-c")  # the server's own check agrees
        assert sv.open_read(KEYS[1]) is None
        sv.close()
        for c in (a, b):
            c.close()


def test_a_false_corrupt_report_changes_nothing(short_dir: Path) -> None:
    """The server is the authority: a client that reports a good chunk corrupt only costs a re-hash."""
    with start_server(short_dir) as srv:
        a = connect(short_dir / "s.sock", client_id="engine-a")
        store(a, KEYS[:1])
        host = srv.hosts()[0]
        wait_until(lambda: host.manager.cpu.contains(KEYS[0]), what="commit")
        reply, conn = a._link.call(P.LoadMany([KEYS[0]], [None], True))
        hid, _slot, source, want = reply["handles"][0]
        assert source == "cpu" and want == chunk_sum(payload_for(KEYS[0], a.chunk_bytes))
        a._link.call(P.Unload(hid, corrupt=True), gen=conn.gen)
        assert host.manager.cpu.contains(KEYS[0]) and host.sums.corrupt == 0
        a.close()


def test_the_server_check_stays_for_clients_that_do_not_verify(short_dir: Path) -> None:
    with start_server(short_dir) as srv:
        a = connect(short_dir / "s.sock", client_id="engine-a")
        store(a, KEYS[:2])
        _scribble(srv, short_dir, KEYS[1])
        b = connect(short_dir / "s.sock", client_id="engine-b")  # verify="server", the default
        assert b.open_read(KEYS[1]) is None
        reply, _ = b._link.call(P.LoadMany([KEYS[0]], [None]))
        assert len(reply["handles"][0]) == 3  # no checksum sent to a client that did not ask
        with pytest.raises(ValueError, match="verify"):
            connect(short_dir / "s.sock", client_id="x", verify="nobody")
        for c in (a, b):
            c.close()


def test_a_handle_closed_unread_is_not_reported_and_an_older_reply_is_trusted(short_dir: Path) -> None:
    with start_server(short_dir) as srv:
        a = connect(short_dir / "s.sock", client_id="engine-a", verify="client")
        store(a, KEYS[:2])
        host = srv.hosts()[0]
        wait_until(lambda: host.manager.cpu.contains(KEYS[1]), what="commit")
        for h in a.open_read_many([(KEYS[0], None), (KEYS[1], KEYS[0])]):
            h.close()  # never read: no verdict needed, nothing reported
        assert a.counters.corrupt_loads == 0 and host.sums.corrupt == 0
        from kvtier.service.client import ServiceReadHandle
        from kvtier.service.load_verifier import GOOD

        view = np.zeros(8, dtype=np.uint8)
        old = ServiceReadHandle(a, 0, 1, KEYS[0], view, "cpu", None)  # a 3-element reply: the server checked it
        assert old.verdict == GOOD and old.buffer is view
        a.close()


def test_a_chunk_the_helper_has_not_started_is_checked_by_the_caller(short_dir: Path) -> None:
    """No helper thread at all (a machine where it would get no core): every check runs inline, same verdicts."""
    with start_server(short_dir) as srv:
        a = connect(short_dir / "s.sock", client_id="engine-a")
        store(a, KEYS[:3])
        _scribble(srv, short_dir, KEYS[2])
        b = connect(short_dir / "s.sock", client_id="engine-b", verify="client")
        b._verifier.helper = False
        handles = b.open_read_many([(KEYS[0], None), (KEYS[1], KEYS[0]), (KEYS[2], KEYS[1])])
        assert b._verifier._thread is None and all(h.verdict == 0 for h in handles)  # all pending
        assert np.array_equal(handles[1].buffer, payload_for(KEYS[1], b.chunk_bytes))  # out of order is fine
        with pytest.raises(ChunkUnavailable):
            handles[2].buffer
        assert np.array_equal(handles[0].buffer, payload_for(KEYS[0], b.chunk_bytes))
        assert b._verifier.checked == 3 and not b._verifier._queue
        for h in handles:
            h.close()
        for c in (a, b):
            c.close()


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("offset", [0, 1])
def test_the_checked_copy_is_the_plain_copy_plus_the_whole_slot_checksum(stacked: bool, offset: int) -> None:
    from kvtier.integrations.block_copy import load_blocks, load_blocks_checked

    rng = np.random.default_rng(offset)
    layers, bpc, bb, nblocks = 3, 4, 64, 10
    chunk = rng.integers(0, 256, (layers, bpc, bb), dtype=np.uint8)
    ids = [7, 2, 5][: bpc - offset]
    kv_a = np.zeros((layers, nblocks, bb), dtype=np.uint8)
    kv_b = kv_a.copy()
    load_blocks(chunk, kv_a if stacked else list(kv_a), ids, offset)
    assert load_blocks_checked(chunk, kv_b if stacked else list(kv_b), ids, offset, chunk_sum(chunk))
    assert np.array_equal(kv_a, kv_b)
    bad = chunk.copy()
    bad[-1, -1, -1] ^= 1  # a byte no block of this load reads: still part of the checksum
    assert not load_blocks_checked(bad, kv_b if stacked else list(kv_b), ids, offset, chunk_sum(chunk))
    with pytest.raises(IndexError):
        load_blocks_checked(chunk, kv_b, [nblocks], 0, chunk_sum(chunk))


def test_the_connector_copy_checks_a_client_verified_load_as_it_copies(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.integrations.block_copy import load_handle
    from kvtier.service import load_verifier

    def second_pass(buf: np.ndarray) -> int:
        raise AssertionError("the chunk was hashed in a pass of its own, not as it was copied")

    monkeypatch.setattr(load_verifier, "chunk_sum_nogil", second_pass)

    with start_server(short_dir) as srv:
        a = connect(short_dir / "s.sock", client_id="engine-a")
        store(a, KEYS[:2])
        _scribble(srv, short_dir, KEYS[1])
        b = connect(short_dir / "s.sock", client_id="engine-b", verify="client")
        b._verifier.helper = False
        h0, h1 = b.open_read_many([(KEYS[0], None), (KEYS[1], KEYS[0])])
        kv = np.zeros((1, 4, b.chunk_bytes), dtype=np.uint8)

        load_handle(h0, _flat_view, kv, [2])
        assert np.array_equal(kv[0, 2], payload_for(KEYS[0], b.chunk_bytes)) and h0.verdict == 1
        with pytest.raises(ChunkUnavailable):
            load_handle(h1, _flat_view, kv, [3])
        assert b._verifier.checked == 2 and h1.claim() is None  # settled: nothing left to check
        for h in (h0, h1):
            h.close()
        host = srv.hosts()[0]
        wait_until(lambda: host.sums.corrupt == 1, what="the report reached the server")
        for c in (a, b):
            c.close()


def test_the_helper_thread_hashes_each_chunk_while_the_connector_copies_it(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify_helper=True: load_handle hands each chunk to the helper as its copy starts, copies,
    then waits for the verdict; a scribbled chunk's blocks are written but it raises, and the
    server hears of it. The copying thread never hashes (load_blocks_checked is not called)."""
    import threading

    from kvtier.integrations import block_copy
    from kvtier.service import load_verifier

    def not_inline(*a: object, **k: object) -> bool:
        raise AssertionError("the copying thread hashed the chunk itself")

    monkeypatch.setattr(block_copy, "load_blocks_checked", not_inline)
    hashed_on: list[str] = []
    real_sum = load_verifier.chunk_sum_nogil

    def recording_sum(buf: np.ndarray) -> int:
        hashed_on.append(threading.current_thread().name)
        return real_sum(buf)

    monkeypatch.setattr(load_verifier, "chunk_sum_nogil", recording_sum)
    real_copy = block_copy.load_blocks

    def copy_once_the_helper_has_it(*args: object) -> None:
        # Tiny test chunks copy in microseconds: let the helper pick the chunk up first, as it
        # does beside a real chunk's copy (if it never does, the verdict wait hashes inline).
        wait_until(lambda: not b._verifier._queue, what="the helper took the chunk")
        real_copy(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(block_copy, "load_blocks", copy_once_the_helper_has_it)
    with start_server(short_dir) as srv:
        a = connect(short_dir / "s.sock", client_id="engine-a")
        store(a, KEYS[:3])
        _scribble(srv, short_dir, KEYS[1])
        b = connect(short_dir / "s.sock", client_id="engine-b", verify="client", verify_helper=True)
        assert b._verifier.helper
        handles = b.open_read_many([(KEYS[0], None), (KEYS[1], KEYS[0]), (KEYS[2], KEYS[1])])
        assert all(h is not None and h.verdict == 0 for h in handles)  # nothing hashed before the copies
        kv = np.zeros((1, 4, b.chunk_bytes), dtype=np.uint8)

        block_copy.load_handle(handles[0], _flat_view, kv, [0])
        assert np.array_equal(kv[0, 0], payload_for(KEYS[0], b.chunk_bytes)) and handles[0].verdict == 1
        with pytest.raises(ChunkUnavailable, match="commit checksum"):
            block_copy.load_handle(handles[1], _flat_view, kv, [1])
        block_copy.load_handle(handles[2], _flat_view, kv, [2])
        assert np.array_equal(kv[0, 2], payload_for(KEYS[2], b.chunk_bytes))
        assert [h.verdict for h in handles] == [1, 2, 1] and b._verifier.checked == 3
        assert hashed_on == ["kvtier-load-verify"] * 3
        for h in handles:
            h.close()
        host = srv.hosts()[0]
        wait_until(lambda: host.sums.corrupt == 1, what="the report reached the server")
        assert b.counters.corrupt_loads == 1
        for c in (a, b):
            c.close()


def test_a_chunk_handed_to_a_helper_that_never_runs_is_checked_by_the_copier(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A helper that gets no CPU (here: one that never takes anything) never stalls a load: the
    copier's wait for the verdict takes the chunk back and hashes it itself, same verdicts."""
    from kvtier.integrations.block_copy import load_handle
    from kvtier.service.load_verifier import LoadVerifier

    monkeypatch.setattr(LoadVerifier, "_run", lambda self: None)
    with start_server(short_dir) as srv:
        a = connect(short_dir / "s.sock", client_id="engine-a")
        store(a, KEYS[:2])
        _scribble(srv, short_dir, KEYS[1])
        b = connect(short_dir / "s.sock", client_id="engine-b", verify="client", verify_helper=True)
        h0, h1 = b.open_read_many([(KEYS[0], None), (KEYS[1], KEYS[0])])
        kv = np.zeros((1, 2, b.chunk_bytes), dtype=np.uint8)

        load_handle(h0, _flat_view, kv, [0])
        with pytest.raises(ChunkUnavailable):
            load_handle(h1, _flat_view, kv, [1])
        assert (h0.verdict, h1.verdict) == (1, 2) and not b._verifier._queue
        for h in (h0, h1):
            h.close()
        for c in (a, b):
            c.close()


def test_the_helper_is_opt_in_and_its_flag_is_checked(short_dir: Path) -> None:
    """The default checks in the copy itself (the helper's hash may read a region before the copy
    does, so a scribble between the two reads would pass); True opts in; other values are refused."""
    with start_server(short_dir):
        c = connect(short_dir / "s.sock", client_id="engine-default", verify="client")
        assert not c._verifier.helper
        c.close()
        c = connect(short_dir / "s.sock", client_id="engine-on", verify="client", verify_helper=True)
        assert c._verifier.helper
        c.close()
        for bad in ("yes", 1, 0.0, None):
            with pytest.raises(ValueError, match="verify_helper"):
                connect(short_dir / "s.sock", client_id="engine-bad", verify="client", verify_helper=bad)
        # With the server checking, a helper would never run: refused, not silently unused.
        with pytest.raises(ValueError, match="verify='client'"):
            connect(short_dir / "s.sock", client_id="engine-bad", verify="server", verify_helper=True)


def test_the_default_copy_sees_a_scribble_that_lands_after_a_helper_would_have_hashed(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hostile trial (December 6): with the helper on by default, a copier that ran late copied a
    chunk scribbled after the helper's GOOD verdict, and nothing was raised. The default path
    hashes each run after copying it, so the late scribble is seen."""
    from kvtier.integrations import block_copy

    with start_server(short_dir) as srv:
        a = connect(short_dir / "s.sock", client_id="engine-a")
        store(a, KEYS[:1])
        b = connect(short_dir / "s.sock", client_id="engine-b", verify="client")
        (h,) = b.open_read_many([(KEYS[0], None)])
        _scribble(srv, short_dir, KEYS[0])  # after the handle was handed out, before the copy
        kv = np.zeros((1, 2, b.chunk_bytes), dtype=np.uint8)
        with pytest.raises(ChunkUnavailable):
            block_copy.load_handle(h, _flat_view, kv, [1])
        h.close()
        for c in (a, b):
            c.close()


def test_a_failing_hash_is_a_miss_and_the_helper_lives_on(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hostile trial: a hash that raised killed the helper thread with the handle taken, so every
    read of it waited the full 10 s verdict timeout. Now the chunk is a mismatch at once and the
    helper hashes the next one."""
    from kvtier.integrations.block_copy import load_handle
    from kvtier.service import load_verifier

    real = load_verifier.chunk_sum_nogil
    calls = []

    def once_broken(buf: np.ndarray) -> int:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("simulated hashing failure")
        return real(buf)

    monkeypatch.setattr(load_verifier, "chunk_sum_nogil", once_broken)
    with start_server(short_dir):
        a = connect(short_dir / "s.sock", client_id="engine-a")
        store(a, KEYS[:2])
        b = connect(short_dir / "s.sock", client_id="engine-b", verify="client", verify_helper=True)
        h0, h1 = b.open_read_many([(KEYS[0], None), (KEYS[1], KEYS[0])])
        kv = np.zeros((1, 2, b.chunk_bytes), dtype=np.uint8)

        for h, blk in ((h0, 0), (h1, 1)):  # whichever thread hashes first meets the failure
            try:
                load_handle(h, _flat_view, kv, [blk])
            except ChunkUnavailable:
                pass
        assert sorted((h0.verdict, h1.verdict)) == [1, 2], "one failed hash is one miss, the other chunk good"
        assert b._verifier._thread is None or b._verifier._thread.is_alive()
        for h in (h0, h1):
            h.close()
        for c in (a, b):
            c.close()


def test_a_retried_copy_hands_its_chunk_over_once_and_the_first_verdict_stands(short_dir: Path) -> None:
    """Hostile trial: a copy that failed after the hand-off (a bad block id) and was retried queued
    the handle twice; two hashes, and a late settle could overwrite the verdict."""
    from kvtier.integrations.block_copy import load_handle
    from kvtier.service.load_verifier import BAD, GOOD, LoadVerifier

    with start_server(short_dir):
        a = connect(short_dir / "s.sock", client_id="engine-a")
        store(a, KEYS[:1])
        b = connect(short_dir / "s.sock", client_id="engine-b", verify="client", verify_helper=True)
        (h,) = b.open_read_many([(KEYS[0], None)])
        kv = np.zeros((1, 2, b.chunk_bytes), dtype=np.uint8)

        with pytest.raises(IndexError):
            load_handle(h, _flat_view, kv, [5])
        assert b._verifier.submit_now(h) in (True, False)  # handed over at most once
        assert sum(1 for x in b._verifier._queue if x is h) <= 1
        load_handle(h, _flat_view, kv, [1])
        assert h.verdict == GOOD and b._verifier.checked == 1
        b._verifier.settle(h, False)  # a late second verdict is ignored
        assert h.verdict == GOOD and b._verifier.checked == 1
        h.close()
        for c in (a, b):
            c.close()
    v = LoadVerifier()
    assert BAD != GOOD and not v.closed
    v.close()
    assert v.closed


def test_a_copy_that_raises_gives_its_claim_back_and_the_next_read_checks_at_once(short_dir: Path) -> None:
    """Hostile re-check: load_handle claimed the chunk, then its copy raised (a bad block id), and
    the handle stayed taken with no verdict: the next read waited the full 10 s timeout."""
    import time

    from kvtier.integrations.block_copy import load_handle

    with start_server(short_dir):
        a = connect(short_dir / "s.sock", client_id="engine-a")
        store(a, KEYS[:1])
        b = connect(short_dir / "s.sock", client_id="engine-b", verify="client")
        (h,) = b.open_read_many([(KEYS[0], None)])
        kv = np.zeros((1, 2, b.chunk_bytes), dtype=np.uint8)

        with pytest.raises(IndexError):
            load_handle(h, _flat_view, kv, [7])
        assert not h.taken and h.verdict == 0
        t0 = time.monotonic()
        load_handle(h, _flat_view, kv, [1])
        assert time.monotonic() - t0 < 5 and h.verdict == 1
        assert np.array_equal(kv[0, 1], payload_for(KEYS[0], b.chunk_bytes))
        h.close()
        for c in (a, b):
            c.close()


def test_the_checked_copy_hashes_what_the_engine_received(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hostile re-check: a scribble written before a run's copy and undone before its hash passed,
    since both read the slot. The copied runs are hashed from their destination now."""
    from kvtier.integrations import block_copy

    rng = np.random.default_rng(9)
    chunk = rng.integers(0, 256, (2, 2, 64), dtype=np.uint8)
    want = chunk_sum(chunk)
    kv = np.zeros((2, 4, 64), dtype=np.uint8)
    real_copyto = np.copyto

    def scribble_then_undo(dst: np.ndarray, src: np.ndarray) -> None:
        saved = src.copy()
        src[...] = 0xEE  # another client writes just before the copy reads ...
        real_copyto(dst, src)
        src[...] = saved  # ... and puts the bytes back before the hash would read the slot

    monkeypatch.setattr(block_copy.np, "copyto", scribble_then_undo)
    assert not block_copy.load_blocks_checked(chunk, kv, [3, 1], 0, want)
