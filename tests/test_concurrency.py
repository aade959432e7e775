"""StorageManager under interleavings and threads: loads are exact, leases hold, nothing leaks.

1. A hypothesis state machine drives a manager with a CPU tier of 2 chunks and a
   disk tier of 4 (so eviction and promotion happen all the time) through store,
   aborted store, lookup with and without a lease, release, load, eviction
   pressure, flush and clear (write-behind is awaited after each store, so runs are
   reproducible), against a reference model (key -> version of the
   bytes last stored). Invariants: every successful load returns exactly the bytes
   last stored for its key; a key a live lease covers is loadable until released
   (a leased chunk always loads); lease and pin counts match the model; at the end
   no lease, pin or reference is left.
2. Threads doing random store/lookup/load/release/flush/clear on overlapping keys,
   every read checked against the key's deterministic payload, then counters at zero
   and every chunk on disk readable by a restarted manager.
"""

from __future__ import annotations

import random
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from conftest import CHUNK, small_namespace
from kvtier.config import KVTierConfig
from kvtier.storage.manager import StorageManager
from kvtier.tiers.disk import HEADER_BYTES

CB = small_namespace().chunk_bytes  # 2,048
DISK_CHUNK = HEADER_BYTES + CB

def key_of(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def payload(i: int, version: int = 0) -> np.ndarray:
    """Deterministic chunk bytes of key ``i`` in its ``version``-th store (distinct per pair)."""
    out = ((np.arange(CB, dtype=np.uint32) * (2 * i + 1) + 131 * version + i) % 251).astype(np.uint8)
    out[:8] = np.frombuffer(i.to_bytes(4, "little") + version.to_bytes(4, "little"), dtype=np.uint8)
    return out


def make_manager(path: Path, cpu_chunks: int, disk_chunks: int) -> StorageManager:
    cfg = KVTierConfig(
        chunk_size=CHUNK,
        cpu_capacity=cpu_chunks * CB,
        disk_path=path,
        disk_capacity=disk_chunks * DISK_CHUNK,
        lease_ttl_s=3600.0,
    )
    return StorageManager(cfg, small_namespace())


# -- 1. state machine ------------------------------------------------------------------------------

MAIN_KEYS = list(range(4))
FILLER_KEYS = list(range(100, 112))
OWNERS = ["a", "b", "c"]
ALL_KEYS = [key_of(i) for i in MAIN_KEYS + FILLER_KEYS]


class ManagerMachine(RuleBasedStateMachine):
    """StorageManager (CPU 2 chunks + disk 4 chunks) against a dict key -> version."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-sm-"))
        self.m = make_manager(self.dir / "disk", cpu_chunks=2, disk_chunks=4)
        self.version: dict[int, int] = {}  # key -> version of the bytes last stored
        self.next_version: dict[int, int] = {}
        self.lease_keys: dict[str, list[int]] = {}  # owner -> keys its live lease covers
        self.promised: dict[str, list[int]] = {}  # owner -> leased keys that must load (until clear)

    # -- helpers --
    def _store(self, i: int, commit: bool = True, parent: int | None = None) -> bool:
        key = key_of(i)
        pkey = None if parent is None else key_of(parent)
        buf = self.m.open_write(key, pkey)
        if buf is None:
            return False
        assert self.m.where(key) is None, "open_write gave a slot for a chunk a tier already holds"
        v = self.next_version.get(i, 0)
        buf[:] = payload(i, v)
        if not commit:
            self.m.abort(key)
            assert self.m.where(key) is None, "an aborted store became visible"
            return False
        self.m.commit(key, pkey)
        # Wait for write-behind: the disk writer thread's timing must not change what the
        # next rule sees (hypothesis needs reproducible runs; threads are tested below).
        assert self.m.flush(10)
        self.next_version[i] = v + 1
        self.version[i] = v
        return True

    def _load(self, i: int, must: bool) -> None:
        key = key_of(i)
        h = self.m.open_read(key)
        if h is None:
            if must:
                raise AssertionError(f"key {i} is leased but cannot be loaded")
            return
        with h:
            event(f"load from {h.source}" + (" (leased)" if must else ""))
            assert i in self.version, f"key {i} loaded but never stored"
            expect = payload(i, self.version[i])
            if not np.array_equal(h.buffer, expect):
                got_v = int.from_bytes(bytes(h.buffer[4:8]), "little")
                raise AssertionError(f"key {i}: loaded version {got_v}, last stored {self.version[i]}")

    def _promised_keys(self) -> set[int]:
        return {i for keys in self.promised.values() for i in keys}

    # -- rules --
    @initialize(order=st.permutations(MAIN_KEYS))
    def store_all(self, order: list[int]) -> None:
        for i in order:
            self._store(i)

    @rule(keys=st.lists(st.sampled_from(MAIN_KEYS), min_size=1, max_size=3, unique=True))
    def store(self, keys: list[int]) -> None:
        for i in keys:
            self._store(i)

    @rule(i=st.sampled_from(MAIN_KEYS), parent=st.sampled_from(MAIN_KEYS))
    def store_naming_any_parent(self, i: int, parent: int) -> None:
        # A caller may name any key (itself, a descendant: a cycle) as parent; the tiers keep a forest.
        self._store(i, parent=parent)

    @rule(i=st.sampled_from(MAIN_KEYS))
    def store_aborted(self, i: int) -> None:
        self._store(i, commit=False)

    @rule(owner=st.sampled_from(OWNERS), keys=st.lists(st.sampled_from(MAIN_KEYS), min_size=1, max_size=4, unique=True))
    def lookup_with_lease(self, owner: str, keys: list[int]) -> None:
        res = self.m.lookup_keys([key_of(i) for i in keys], lease_owner=owner)
        n = len(res.keys)
        assert res.keys == [key_of(i) for i in keys[:n]], "a lookup hit is not a prefix of the keys asked"
        assert res.num_tokens == n * CHUNK and all(t in ("cpu", "disk") for t in res.tiers)
        for i in keys[:n]:
            assert i in self.version, f"lookup hit key {i}, never stored"
        if n:
            self.lease_keys[owner] = keys[:n]
            self.promised[owner] = keys[:n]
        else:  # an empty hit ends the owner's previous lease
            self.lease_keys.pop(owner, None)
            self.promised.pop(owner, None)

    @rule(keys=st.lists(st.sampled_from(MAIN_KEYS), min_size=1, max_size=4, unique=True))
    def lookup_without_lease(self, keys: list[int]) -> None:
        res = self.m.lookup_keys([key_of(i) for i in keys])
        assert res.keys == [key_of(i) for i in keys[: len(res.keys)]]

    @rule(owner=st.sampled_from(OWNERS))
    def release(self, owner: str) -> None:
        self.m.release(owner)
        self.lease_keys.pop(owner, None)
        self.promised.pop(owner, None)

    @rule(i=st.sampled_from(MAIN_KEYS + FILLER_KEYS[:2]))
    def load(self, i: int) -> None:
        self._load(i, must=i in self._promised_keys())

    @rule(owner=st.sampled_from(OWNERS))
    def load_everything_leased(self, owner: str) -> None:
        for i in self.promised.get(owner, []):
            self._load(i, must=True)

    @rule(n=st.integers(1, 6), start=st.integers(0, len(FILLER_KEYS) - 1))
    def evict_pressure(self, n: int, start: int) -> None:
        for j in range(n):
            self._store(FILLER_KEYS[(start + j) % len(FILLER_KEYS)])

    @rule()
    def flush(self) -> None:
        assert self.m.flush(10)

    @rule()
    def clear(self) -> None:
        self.m.clear()
        for i in MAIN_KEYS + FILLER_KEYS:
            assert self.m.where(key_of(i)) is None, f"clear left key {i}"
        self.promised.clear()  # clear removes leased chunks too; their loads then miss (reported)

    # -- invariants --
    @invariant()
    def tier_and_lease_invariants_hold(self) -> None:
        self.m.check_invariants()  # CPU slots/refs/states/prefix closure, lease pins
        disk = self.m.disk
        if disk is not None and hasattr(disk, "check_invariants"):
            disk.check_invariants()

    @invariant()
    def lease_counts_match_the_model(self) -> None:
        st_ = self.m.stats()
        assert st_["leases"] == len(self.lease_keys)
        assert st_["pinned_chunks"] == len({i for ks in self.lease_keys.values() for i in ks})

    def teardown(self) -> None:
        try:
            for owner in OWNERS:
                self.m.release(owner)
            assert self.m.flush(10)
            s = self.m.stats()
            assert (s["leases"], s["pinned_chunks"], s["referenced_chunks"]) == (0, 0, 0), s
            for i in MAIN_KEYS + FILLER_KEYS:
                self._load(i, must=False)
            assert self.m.stats()["referenced_chunks"] == 0
        finally:
            self.m.close()
            shutil.rmtree(self.dir, ignore_errors=True)


ManagerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_manager_state_machine = ManagerMachine.TestCase


@pytest.mark.parametrize("pinned_by", ["own lease", "other lease"])
def test_leased_disk_chunk_loads_when_cpu_slots_are_all_pinned(tmp_path: Path, pinned_by: str) -> None:
    """A leased disk chunk loads even when no CPU slot can be freed (read into a private buffer).

    "own lease": one lookup leases 3 disk chunks and the CPU tier has 2 slots; each
    promoted chunk stays pinned in CPU, so the third cannot be promoted. "other
    lease": another request's lease pins both CPU slots.
    """
    m = make_manager(tmp_path / "disk", cpu_chunks=2, disk_chunks=8)
    try:
        for i in range(3):
            buf = m.open_write(key_of(i), None)
            buf[:] = payload(i)
            m.commit(key_of(i), None)
            assert m.flush(10)
        m.cpu.clear()  # chunks 0..2 now only on disk
        if pinned_by == "other lease":
            for i in (10, 11):  # two other chunks fill the CPU tier, leased by another request
                buf = m.open_write(key_of(i), None)
                buf[:] = payload(i)
                m.commit(key_of(i), None)
            assert m.flush(10)
            assert m.lookup_keys([key_of(10), key_of(11)], lease_owner="other").num_tokens == 2 * CHUNK
            wanted = [0]
        else:
            wanted = [0, 1, 2]
        res = m.lookup_keys([key_of(i) for i in wanted], lease_owner="me")
        assert res.tiers == ["disk"] * len(wanted)
        handles = [m.open_read(key_of(i)) for i in wanted]  # loaded one after the other, as the connector does
        for h in handles:
            if h is not None:
                h.close()
        for i, h in zip(wanted, handles):
            assert h is not None, f"leased chunk {i} could not be loaded"
            assert np.array_equal(h.buffer, payload(i))
    finally:
        m.release("me")
        m.release("other")
        m.close()


# -- 2. threads --------------------------------------------------------------------------------------

THREADS = 4
OPS_PER_THREAD = 25_000
THREAD_KEYS = 16


@pytest.mark.slow  # over 5 s on 2 cores: out of the fast loop
def test_threads_on_overlapping_keys_read_exact_bytes_and_leak_nothing(tmp_path: Path) -> None:
    m = make_manager(tmp_path / "disk", cpu_chunks=4, disk_chunks=8)
    payloads = [payload(i) for i in range(THREAD_KEYS)]
    failures: list[str] = []
    counts = {"loads": 0, "hits": 0, "stores": 0, "leased_misses": 0}
    counts_lock = threading.Lock()
    start = threading.Barrier(THREADS)

    def run(tid: int) -> None:
        rng = random.Random(1000 + tid)
        owner = f"thread-{tid}"
        leased: list[int] = []
        local = dict.fromkeys(counts, 0)
        try:
            start.wait()
            for _ in range(OPS_PER_THREAD):
                op = rng.random()
                i = rng.randrange(THREAD_KEYS)
                key = key_of(i)
                if op < 0.30:
                    buf = m.open_write(key, key_of(i - 1) if i else None)
                    if buf is not None:
                        buf[:] = payloads[i]
                        if rng.random() < 0.1:
                            m.abort(key)
                        else:
                            m.commit(key, key_of(i - 1) if i else None)
                            local["stores"] += 1
                elif op < 0.45:
                    chain = [key_of(j) for j in range(i, min(THREAD_KEYS, i + rng.randint(1, 3)))]
                    res = m.lookup_keys(chain, lease_owner=owner)
                    leased = list(range(i, i + len(res.keys)))
                elif op < 0.85:
                    if leased and rng.random() < 0.5:
                        i = rng.choice(leased)
                        key = key_of(i)
                    h = m.open_read(key)
                    local["loads"] += 1
                    if h is None:
                        local["leased_misses"] += i in leased
                        continue
                    with h:
                        local["hits"] += 1
                        if not np.array_equal(h.buffer, payloads[i]):
                            failures.append(f"thread {tid}: key {i} read wrong bytes from {h.source}")
                elif op < 0.97:
                    m.release(owner)
                    leased = []
                elif tid == 0 and op < 0.975:
                    m.clear()
                else:
                    m.flush(10)
            m.release(owner)
        except Exception as exc:  # surfaces in the main thread
            failures.append(f"thread {tid}: {type(exc).__name__}: {exc}")
        finally:
            with counts_lock:
                for k, v in local.items():
                    counts[k] += v

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: more interleavings
    try:
        threads = [threading.Thread(target=run, args=(t,), name=f"kvtier-test-{t}") for t in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a thread hung (deadlock?)"
    finally:
        sys.setswitchinterval(old)
    assert not failures, failures[:5]
    assert counts["hits"] > 1000 and counts["stores"] > 100, counts
    assert m.flush(10)
    s = m.stats()
    assert (s["leases"], s["pinned_chunks"], s["referenced_chunks"]) == (0, 0, 0), s
    assert s["cpu_evicted_chunks"] > 0 and s["disk_evicted_chunks"] > 0 and s["promoted_chunks"] > 0, s
    on_disk = [i for i in range(THREAD_KEYS) if m.disk.contains(key_of(i))]
    m.close()
    # every file the threads left is complete: a restarted manager serves each one exactly
    m2 = make_manager(tmp_path / "disk", cpu_chunks=4, disk_chunks=8)
    try:
        # the rebuilt index is prefix-closed: a chunk whose parent (key i-1) is not on disk is dropped
        reachable = [i for i in on_disk if all(j in on_disk for j in range(i))]
        assert sorted(i for i in range(THREAD_KEYS) if m2.disk.contains(key_of(i))) == reachable
        for i in reachable:
            h = m2.open_read(key_of(i))
            assert h is not None, f"key {i} on disk but unreadable after restart"
            with h:
                assert np.array_equal(h.buffer, payloads[i])
    finally:
        m2.close()
    print(f"threads: {counts}")


@pytest.mark.slow
def test_threads_with_disk_and_remote_tiers_read_exact_bytes_and_leak_nothing(tmp_path: Path) -> None:
    """Promotion from disk and remote, write-behind to both, eviction everywhere, from 4 threads."""
    from kvtier.storage.lower_tiers import open_storage_tiers
    from kvtier.testing.memory_tier import MemoryStore, MemoryTier

    cfg = KVTierConfig(
        chunk_size=CHUNK, cpu_capacity=3 * CB, disk_path=tmp_path / "disk", disk_capacity=5 * DISK_CHUNK,
        lease_ttl_s=3600.0,
    )
    ns = small_namespace()
    remote = MemoryTier(MemoryStore(capacity_chunks=10), ns.digest())
    m = StorageManager(cfg, ns, lower=lambda pinned: [*open_storage_tiers(cfg, ns, pinned), remote])
    payloads = [payload(i) for i in range(THREAD_KEYS)]
    failures: list[str] = []
    hits = [0]
    lock = threading.Lock()

    def run(tid: int) -> None:
        rng = random.Random(2000 + tid)
        owner = f"t{tid}"
        try:
            for _ in range(3000):
                i = rng.randrange(THREAD_KEYS)
                key, parent = key_of(i), key_of(i - 1) if i else None
                op = rng.random()
                if op < 0.3:
                    (buf,) = m.open_write_many([key], [parent])
                    if isinstance(buf, np.ndarray):
                        buf[:] = payloads[i]
                        m.commit(key, parent)
                elif op < 0.5:
                    m.lookup_keys([key_of(j) for j in range(i, min(THREAD_KEYS, i + 3))], lease_owner=owner)
                elif op < 0.9:
                    for h, j in zip(m.open_read_many([(key, parent), (key_of((i + 1) % THREAD_KEYS), key)]), (i, (i + 1) % THREAD_KEYS)):
                        if h is None:
                            continue
                        with h:
                            if not np.array_equal(h.buffer, payloads[j]):
                                failures.append(f"key {j}: wrong bytes from {h.source}")
                            with lock:
                                hits[0] += 1
                elif op < 0.97:
                    m.release(owner)
                else:
                    m.prefetch([0] * (CHUNK * (i + 1) + 1))  # a prompt no tier holds: harmless
            m.release(owner)
        except Exception as exc:
            failures.append(f"thread {tid}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    try:
        assert not any(t.is_alive() for t in threads), "a thread hung"
        assert not failures, failures[:5]
        assert m.flush(10)
        s = m.stats()
        assert hits[0] > 500, s
        assert (s["leases"], s["pinned_chunks"], s["referenced_chunks"]) == (0, 0, 0), s
        assert s["remote_put_ok"] > 0 and s["disk_evicted_chunks"] > 0, s
        assert s["promoted_chunks"] > 0 and s["promoted_chunks_remote"] > 0, s
        m.check_invariants()
        m.disk.check_invariants()
    finally:
        m.close()
