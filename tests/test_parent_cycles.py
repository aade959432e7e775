"""The parent graph stays a forest whatever parents a caller names (kvtier.index.chains).

A chunk's parent is named by its writer; real keys are chain hashes, so the links form a
forest, but a malformed or hostile caller can name any key. A cycle (A's parent B, B's
parent A) used to pin CPU slots for good (leaf-first eviction never offers its chunks,
``clear`` skipped them) and hang the disk tier's ``clear`` (an unvisited descendant walk).

One smallest test per input that could form a cycle: one request (refused by the protocol
and by the operations' argument checks; the tiers drop the link if it gets through, as
on the embedded connector's direct calls), two requests (a commit naming an absent parent
that later names it back), ``store_blocks``, promotion into the CPU tier, write-behind and
promotion into the disk tier, a disk batch, cycle headers found on disk at open, a direct
caller's self-parent reaching write-behind, and two tiers' forests that make a cycle together
(the lineage walk). Then every walk is shown to end even on a cycle made behind the tiers' backs.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from conftest import CHUNK, payload_for, small_namespace
from service_helpers import connect, short_dir, start_server, start_server_process  # noqa: F401 (short_dir: fixture)
from kvtier import protocol as P
from kvtier.config import KVTierConfig
from kvtier.index.chains import closes_cycle, descendants, first_cycle, request_cycle
from kvtier.protocol.messages import LoadBlocks, StoreBlocks
from kvtier.storage.manager import StorageManager
from kvtier.storage.ops_args import OpError, check_parents
from kvtier.storage.types import WriteSkip
from kvtier.testing.memory_tier import MemoryTier
from kvtier.tiers.base import ChunkWrite
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import HEADER_BYTES, DiskTier
from kvtier.tiers.disk.index import Entry
from kvtier.tiers.policies import POLICIES, make_policy

NS = small_namespace()
CB = NS.chunk_bytes
FILE = HEADER_BYTES + CB


def key(tag: str) -> bytes:
    return (tag.encode() * 32)[:32]


A, B, C = key("a"), key("b"), key("c")


def ends(fn: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    """``fn()``'s result; fails (instead of hanging the run) when it does not return in time."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout_s)
    assert out, f"{fn} did not return within {timeout_s} s (a parent walk loops)"
    return out[0]


def cpu_commit(tier: CpuTier, k: bytes, parent: bytes | None) -> None:
    buf = tier.reserve(k, parent)
    assert buf is not None
    buf[:] = payload_for(k, CB)
    tier.commit(k, parent)


def manager(tmp_path: Path, cpu_chunks: int = 4, disk_chunks: int = 0, remote: MemoryTier | None = None) -> StorageManager:
    cfg = KVTierConfig(chunk_size=CHUNK, cpu_capacity=cpu_chunks * CB)
    if remote is None and not disk_chunks:
        return StorageManager(cfg, NS)

    def lower(is_pinned: Callable[[bytes], bool]) -> list[Any]:
        tiers: list[Any] = [DiskTier(tmp_path / "disk", disk_chunks * FILE, NS.digest(), make_policy("lru"), is_pinned)]
        return tiers + ([remote] if remote is not None else [])

    return StorageManager(cfg, NS, lower=lower)


def store(m: StorageManager, keys: list[bytes], parents: list[bytes | None]) -> None:
    """One ``open_write_many`` of ``keys``, then a commit of each with its parent (as a connector does)."""
    bufs = m.open_write_many(keys, parents)
    for k, p, buf in zip(keys, parents, bufs):
        assert isinstance(buf, np.ndarray), buf
        buf[:] = payload_for(k, CB)
        m.commit(k, p)


# -- the graph helpers -------------------------------------------------------------------------------
def test_request_cycle_finds_only_cycles_of_the_requests_own_links() -> None:
    assert request_cycle([A, B], [B, A]) == 0
    assert request_cycle([A, B, C], [None, C, B]) == 1
    assert request_cycle([A, B, C], [C, A, B]) == 0  # a chain in order whose first parent is its last key
    assert request_cycle([A, B], [B, None]) is None  # a parent later in the request is no cycle
    assert request_cycle([A, B, A], [None, A, B]) is None  # a repeated key links by its first position
    assert request_cycle([A], [B]) is None


def test_closes_cycle_counts_a_walk_longer_than_the_graph_as_a_cycle() -> None:
    links = {A: B, B: C}
    assert closes_cycle(C, A, links.get, len(links))
    assert not closes_cycle(key("d"), A, links.get, len(links))
    looping = {A: B, B: A}  # already a cycle that does not pass through the new key
    assert closes_cycle(C, A, looping.get, len(looping))
    assert first_cycle(looping) in (A, B) and first_cycle(links) is None
    assert sorted(descendants([A], lambda k: [B] if k == A else [A])) == sorted([A, B])


# -- one request -------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda ps: P.ReserveMany([A, B], ps),
    lambda ps: P.LoadMany([A, B], ps),
    lambda ps: StoreBlocks([A, B], [[0, 1], [2, 3]], ps),
    lambda ps: LoadBlocks([A, B], ps, [[0, 1], [2, 3]], [0, 0]),
], ids=["reserve_many", "load_many", "store_blocks", "load_blocks"])
def test_a_request_whose_parents_form_a_cycle_is_refused(make: Callable[[list[bytes | None]], Any]) -> None:
    with pytest.raises(ValueError, match="cycle"):
        make([B, A])
    make([None, A])  # a chain is fine


def test_operation_parents_that_form_a_cycle_are_refused() -> None:
    with pytest.raises(OpError, match="cycle"):
        check_parents([B, C, A], [A, B, C])
    assert check_parents([None, A], [A, B]) == [None, A]


def test_one_embedded_call_naming_a_cycle_stores_the_chunks_as_a_forest(tmp_path: Path) -> None:
    """The embedded connector calls the manager directly (no protocol check): the CPU tier drops the
    link that would close the cycle, so both chunks stay evictable and ``clear`` removes them."""
    m = manager(tmp_path, cpu_chunks=2)
    try:
        store(m, [A, B], [B, A])
        m.check_invariants()
        assert m.cpu.policy.parent_of(A) == B and m.cpu.policy.parent_of(B) is None
        store(m, [C], [None])  # a full pool: the pair's leaf goes
        assert m.where(C) == "cpu" and m.where(A) is None
        assert m.clear()["cpu"] == 2
    finally:
        m.close()


# -- across requests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_refuses_a_parent_that_closes_a_cycle(policy: str) -> None:
    p = make_policy(policy)
    p.insert(A, B)  # B absent
    p.insert(C, A)
    with pytest.raises(ValueError, match="cycle"):
        p.insert(B, C)  # B -> C -> A -> B
    assert B not in p and len(p) == 2
    p.check_invariants()
    p.insert(B, None)
    assert list(p.candidates()) == [C]


def test_a_commit_naming_an_absent_parent_that_later_names_it_back_leaves_a_forest() -> None:
    tier = CpuTier(CB, 2 * CB)
    cpu_commit(tier, A, B)  # B absent
    cpu_commit(tier, B, A)  # would close A -> B -> A: B is a chain head
    tier.check_invariants()
    assert tier.policy.parent_of(B) is None
    cpu_commit(tier, C, None)  # the pool is full: the pair is evictable, leaf first
    assert not tier.contains(A) and tier.contains(B)
    assert tier.clear() == 2 and tier.pool.num_free == tier.pool.num_slots


def test_cross_request_cycles_through_the_server_leave_the_pool_usable(short_dir: Path) -> None:
    """The hostile trial's attack split over requests (each passes the protocol's per-request
    check): 8 pairs in a 16-slot pool, then another client stores 16 chunks and clears."""
    with start_server(short_dir, cpu_chunks=16):
        c = connect(short_dir / "s.sock", NS, "hostile", sync_commit=True)
        victim = connect(short_dir / "s.sock", NS, "victim", sync_commit=True)
        try:
            for i in range(8):
                a, b = key(f"a{i}-"), key(f"b{i}-")
                for k, p in ((a, b), (b, a)):
                    buf = c.open_write_many([k], [p])[0]
                    assert isinstance(buf, np.ndarray)
                    c.commit(k, p)
            for i in range(16):  # one at a time: a client's reservations in flight are bounded
                fresh = key(f"v{i}-")
                assert isinstance(victim.open_write_many([fresh], [None])[0], np.ndarray), i
                victim.commit(fresh, None)
            assert victim.clear()["cpu"] == 16
        finally:
            c.close()
            victim.close()


@pytest.mark.slow
def test_store_blocks_across_requests_cannot_pin_the_pool(short_dir: Path) -> None:
    """``store_blocks`` commits with the parents it is given, one request at a time."""
    pytest.importorskip("torch")
    from test_service_block_copy import ShmKV  # the shm stand-in for an engine's KV export

    from kvtier.service.kv_export import kv_register_request

    proc = start_server_process(short_dir, cpu_chunks=2, disk=False)
    kv = ShmKV("cycle")
    try:
        seen: list[str] = []
        while not any("ready" in line for line in seen):
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, "".join(seen)
            seen.append(line)
        c = connect(short_dir / "s.sock", NS, "bc-hostile")
        try:
            assert c.register_kv(kv_register_request(kv.layers, kv.name)) is not None
            assert c.store_blocks([A], [[0, 1]], [B]) == [None]
            assert c.store_blocks([B], [[2, 3]], [A]) == [None]
            assert c.store_blocks([C], [[4, 5]], [None]) == [None]  # the full pool gives up the pair's leaf
            assert c.clear()["cpu"] == 2
        finally:
            c.close()
    finally:
        proc.terminate()
        proc.wait(30)
        kv.close()


# -- promotion and write-behind ------------------------------------------------------------------------
def test_promotion_from_disk_with_cycle_parents_leaves_a_forest(tmp_path: Path) -> None:
    m = manager(tmp_path, cpu_chunks=4, disk_chunks=4)
    try:
        assert m.disk is not None
        assert m.disk.put_many([ChunkWrite(A, None, payload_for(A, CB)), ChunkWrite(B, None, payload_for(B, CB))])
        for h in m.open_read_many([(A, B), (B, A)]):
            assert h is not None and h.source == "disk"
            h.close()
        m.check_invariants()
        assert m.cpu.policy.parent_of(A) == B and m.cpu.policy.parent_of(B) is None
        assert ends(m.clear) == {"cpu": 2, "disk": 2}
    finally:
        m.close()


def test_write_behind_of_a_cycle_into_the_disk_tier_leaves_a_forest(tmp_path: Path) -> None:
    """The second defect of the trial: write-behind made the cycle on disk and ``clear`` looped."""
    m = manager(tmp_path, cpu_chunks=4, disk_chunks=4)
    try:
        store(m, [A], [B])
        store(m, [B], [A])
        assert m.flush(10)
        disk: Any = m.disk
        disk.check_invariants()
        assert disk.parent_of(A) == B and disk.parent_of(B) is None
        assert ends(m.clear) == {"cpu": 2, "disk": 2}
    finally:
        m.close()


def test_promotion_from_a_remote_tier_writes_a_forest_into_cpu_and_disk(tmp_path: Path) -> None:
    remote = MemoryTier(namespace=NS.digest())
    assert remote.put_many([ChunkWrite(A, None, payload_for(A, CB)), ChunkWrite(B, None, payload_for(B, CB))])
    m = manager(tmp_path, cpu_chunks=4, disk_chunks=4, remote=remote)
    try:
        for h in m.open_read_many([(A, B), (B, A)]):
            assert h is not None and h.source == "remote"
            h.close()
        assert m.flush(10)
        disk: Any = m.disk
        m.check_invariants()
        disk.check_invariants()
        assert len(disk) == 2 and disk.parent_of(B) is None and m.cpu.policy.parent_of(B) is None
        assert ends(m.clear) == {"cpu": 2, "disk": 2, "remote": 2}
    finally:
        m.close()


def test_an_embedded_self_parent_commit_costs_no_write_behind_batch(tmp_path: Path) -> None:
    """A direct caller's chunk named as its own parent is a chain head in every tier: the disk's
    write-behind batch is not refused for it (a bad parent used to raise there, losing the batch)."""
    m = manager(tmp_path, cpu_chunks=4, disk_chunks=4)
    try:
        store(m, [A, B], [A, None])
        assert m.flush(10)
        disk: Any = m.disk
        assert disk.contains_many([A, B]) == [True, True] and disk.parent_of(A) is None
    finally:
        m.close()


def test_lineage_walk_ends_on_a_cycle_across_tiers(tmp_path: Path) -> None:
    """Each tier keeps a forest, but the disk's A -> B and the CPU's B -> A together make a cycle
    for a walk that asks every tier (a peer server's lineage check): it ends at the repeat."""
    m = manager(tmp_path, cpu_chunks=4, disk_chunks=4)
    try:
        disk: Any = m.disk
        assert disk.put_many([ChunkWrite(A, B, payload_for(A, CB))]) == [True]  # B absent on disk
        store(m, [B], [A])  # A absent in CPU: the CPU keeps B -> A
        assert m.cpu.policy.parent_of(B) == A and disk.parent_of(A) == B
        assert ends(lambda: m.lineage_of(B, max_steps=1 << 40), 5.0) is None
    finally:
        m.close()


# -- the disk tier -------------------------------------------------------------------------------------
def test_one_disk_batch_naming_a_cycle_is_indexed_as_a_forest(tmp_path: Path) -> None:
    t = DiskTier(tmp_path, 4 * FILE, NS.digest())
    try:
        assert t.put_many([ChunkWrite(A, B, payload_for(A, CB)), ChunkWrite(B, A, payload_for(B, CB))]) == [True, True]
        t.check_invariants()
        assert t.parent_of(B) is None
        assert ends(lambda: t.delete_many([B])) == 1 and len(t) == 0  # B and its descendant A
    finally:
        t.close()


def test_cycle_headers_found_on_disk_at_open_are_dropped_as_orphans(tmp_path: Path) -> None:
    """The records keep the parents their writers named (A's B, B's A): no first chunk leads to
    them, so the scan at open drops both, and does not loop."""
    t = DiskTier(tmp_path, 4 * FILE, NS.digest())
    assert t.put_many([ChunkWrite(A, B, payload_for(A, CB)), ChunkWrite(B, A, payload_for(B, CB))]) == [True, True]
    t.close()
    t = ends(lambda: DiskTier(tmp_path, 4 * FILE, NS.digest()))
    try:
        t.check_invariants()
        assert len(t) == 0
    finally:
        t.close()


# -- every walk ends, even on a cycle made behind the tiers' backs ----------------------------------------
def _force_cpu_cycle(tier: CpuTier) -> None:
    cpu_commit(tier, A, None)
    cpu_commit(tier, B, None)
    pol: Any = tier.policy
    pol._parent.update({A: B, B: A})
    pol._children.update({A: 1, B: 1})


@pytest.mark.parametrize("how", ["clear", "delete_tree"])
def test_cpu_clear_and_delete_tree_remove_a_cycle(how: str, caplog: pytest.LogCaptureFixture) -> None:
    tier = CpuTier(CB, 4 * CB)
    _force_cpu_cycle(tier)
    cpu_commit(tier, C, A)  # a chunk hanging off the cycle
    with caplog.at_level(logging.ERROR, "kvtier.tiers.cpu"):
        n = ends(tier.clear) if how == "clear" else len(ends(lambda: tier.delete_tree([A])))
    assert n == 3 and len(tier) == 0 and tier.pool.num_free == tier.pool.num_slots
    assert "parent cycles" in caplog.text
    tier.check_invariants()


def test_cpu_clear_keeps_a_cycle_whose_chunk_is_being_read() -> None:
    tier = CpuTier(CB, 4 * CB)
    _force_cpu_cycle(tier)
    cpu_commit(tier, C, None)
    assert tier.acquire(A) is not None
    assert ends(tier.clear) == 1 and tier.contains(A) and tier.contains(B)  # in use, and its ancestor
    tier.release(A)


def _force_disk_cycle(t: DiskTier) -> None:
    assert t.put_many([ChunkWrite(A, None, payload_for(A, CB)), ChunkWrite(B, None, payload_for(B, CB))])
    idx: Any = t._index
    idx.entries[A], idx.entries[B] = Entry(FILE, B), Entry(FILE, A)
    idx.children.update({A: {B}, B: {A}})


@pytest.mark.parametrize("how", ["clear", "delete_many"])
def test_disk_clear_and_delete_remove_a_cycle(tmp_path: Path, how: str) -> None:
    t = DiskTier(tmp_path, 4 * FILE, NS.digest(), make_policy("lru"))
    try:
        _force_disk_cycle(t)
        if how == "clear":
            assert ends(t.clear) == 2
        else:
            assert ends(lambda: t.delete_many([A])) == 1  # A existed; B, its descendant, went with it
        assert len(t) == 0 and t.used_bytes == 0
    finally:
        t.close()


def test_a_store_after_the_cycle_guard_is_still_a_chain(tmp_path: Path) -> None:
    """The guard costs nothing to honest chains: parents are recorded as given."""
    m = manager(tmp_path, cpu_chunks=4)
    try:
        keys = m.keys(list(range(3 * CHUNK)))
        store(m, keys, [None, *keys[:-1]])
        assert [m.cpu.policy.parent_of(k) for k in keys] == [None, *keys[:-1]]
        assert m.open_write_many(keys[:1], [None]) == [WriteSkip.PRESENT]
    finally:
        m.close()
