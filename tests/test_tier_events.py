"""Tier change notifications: stored / removed / cleared chunks of every tier reach the listeners."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import CHUNK, small_namespace
from kvtier.config import KVTierConfig
from kvtier.serde.record import HEADER_BYTES
from kvtier.storage.instance_ops import InstanceOps
from kvtier.storage.manager import StorageManager
from kvtier.storage.tier_events import TierChange

CB = 2048


def prompt(seed: int, n_chunks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n_chunks * CHUNK)]


def store(mgr: StorageManager, seed: int, n_chunks: int) -> list[bytes]:
    keys = mgr.keys(prompt(seed, n_chunks))
    for i, k in enumerate(keys):
        buf = mgr.open_write(k, keys[i - 1] if i else None)
        if buf is None:
            continue
        buf[:] = np.frombuffer(k * (CB // 32), dtype=np.uint8)
        mgr.commit(k, keys[i - 1] if i else None)
    return keys


def make(tmp: Path, cpu_chunks: int = 4, disk_chunks: int = 4, remote: bool = True) -> StorageManager:
    fields: dict[str, object] = dict(
        chunk_size=CHUNK, cpu_capacity=cpu_chunks * CB, disk_path=tmp / "disk",
        disk_capacity=disk_chunks * (HEADER_BYTES + CB),
    )
    if remote:
        fields["remote_url"] = f"fs://{tmp / 'share'}"
    return StorageManager(KVTierConfig(**fields), small_namespace())  # type: ignore[arg-type]


def of(changes: list[TierChange], tier: str, op: str) -> list[bytes]:
    return [k for c in changes if c.tier == tier and c.op == op for k in c.keys]


def replay(changes: list[TierChange]) -> dict[str, set[bytes]]:
    state: dict[str, set[bytes]] = {}
    for c in changes:
        s = state.setdefault(c.tier, set())
        if c.op == "s":
            assert len(c.parents) == len(c.keys)
            s.update(c.keys)
        elif c.op == "r":
            s.difference_update(c.keys)
        else:
            s.clear()
    return state


def test_commit_write_behind_eviction_delete_clear(tmp_path: Path) -> None:
    mgr = make(tmp_path)
    seen: list[TierChange] = []
    mgr.subscribe(seen.append)
    try:
        keys = store(mgr, 1, 3)
        assert [c for c in seen if c.tier == "cpu"] == [
            TierChange("s", "cpu", (keys[0],), (None,)),
            TierChange("s", "cpu", (keys[1],), (keys[0],)),
            TierChange("s", "cpu", (keys[2],), (keys[1],)),
        ]
        assert mgr.flush(10)
        assert of(seen, "disk", "s") == keys  # the disk tier reports its own writes, in order
        assert sorted(of(seen, "remote", "s")) == sorted(keys)  # write-behind put into fs
        disk_parents = {c.keys[0]: c.parents[0] for c in seen if c.tier == "disk" and c.op == "s"}
        assert disk_parents == {keys[0]: None, keys[1]: keys[0], keys[2]: keys[1]}
        seen.clear()
        more = store(mgr, 2, 1) + store(mgr, 3, 1)  # 5 chunks into 4 CPU slots: one eviction
        assert mgr.flush(10)
        evicted = of(seen, "cpu", "r")
        assert len(evicted) == 1 and not mgr.cpu.contains(evicted[0])
        assert len(of(seen, "disk", "r")) == 1  # 5 chunks into a 4-chunk disk: capacity eviction inside DiskTier
        assert set(of(seen, "disk", "r")) == set(keys + more) - {k for k, _ in mgr.disk.scan_keys()}  # type: ignore[union-attr]
        seen.clear()
        ops = InstanceOps(mgr)
        ops.delete([more[0]], None)
        assert of(seen, "cpu", "r") == [more[0]] and of(seen, "disk", "r") == [more[0]]
        assert of(seen, "remote", "r") == [more[0]]
        seen.clear()
        ops.clear(None)
        assert [(c.op, c.tier, c.keys) for c in seen] == [("c", "cpu", ()), ("c", "disk", ()), ("c", "remote", ())]
    finally:
        mgr.close()


def test_promotion_is_a_cpu_store(tmp_path: Path) -> None:
    mgr = make(tmp_path, remote=False)
    keys = store(mgr, 4, 2)
    assert mgr.flush(10)
    InstanceOps(mgr).clear("cpu")
    seen: list[TierChange] = []
    mgr.subscribe(seen.append)
    try:
        h = mgr.open_read(keys[0])
        assert h is not None and h.source == "disk"
        h.close()
        assert seen == [TierChange("s", "cpu", (keys[0],), (None,))]
    finally:
        mgr.close()


def test_listener_errors_are_swallowed_and_unsubscribe_stops_hooks(tmp_path: Path) -> None:
    mgr = make(tmp_path)
    seen: list[TierChange] = []

    def broken(change: TierChange) -> None:
        raise RuntimeError("boom")

    mgr.subscribe(broken)
    mgr.subscribe(seen.append)
    try:
        keys = store(mgr, 5, 2)
        assert mgr.flush(10)
        assert all(mgr.cpu.contains(k) for k in keys) and mgr.disk.contains(keys[1])  # type: ignore[union-attr]
        assert of(seen, "cpu", "s") == keys  # the second listener still hears everything
        mgr.unsubscribe(broken)
        mgr.unsubscribe(seen.append)
        assert mgr.cpu._on_change is None and mgr.disk._index.on_change is None  # type: ignore[union-attr]
        assert not any(t.reporting for t in mgr.write_behind.tiers)  # type: ignore[attr-defined]
        n = len(seen)
        store(mgr, 6, 2)
        assert mgr.flush(10)
        assert len(seen) == n
        with pytest.raises(TypeError):
            mgr.subscribe("not callable")  # type: ignore[arg-type]
    finally:
        mgr.close()


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.integers(0, 6), st.integers(1, 3)),
        st.tuples(st.just("read"), st.integers(0, 6), st.integers(1, 3)),
        st.tuples(st.just("delete"), st.integers(0, 6), st.sampled_from(["cpu", "disk", "remote", None])),
        st.tuples(st.just("clear"), st.integers(0, 6), st.sampled_from(["cpu", "disk", "remote", None])),
        st.tuples(st.just("move"), st.integers(0, 6), st.sampled_from(["cpu", "disk", "remote"])),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_replayed_changes_equal_the_snapshot(workload) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mgr = make(Path(tmp), cpu_chunks=4, disk_chunks=5)
        ops = InstanceOps(mgr)
        seen: list[TierChange] = []
        mgr.subscribe(seen.append)
        try:
            for op, seed, arg in workload:
                if op == "store":
                    store(mgr, seed, arg)
                elif op == "read":
                    for h in mgr.open_read_many([(k, None) for k in mgr.keys(prompt(seed, arg))]):
                        if h is not None:
                            h.close()
                elif op == "delete":
                    ops.delete(mgr.keys(prompt(seed, 2))[1:], arg)
                elif op == "clear":
                    ops.clear(arg)
                else:
                    keys = mgr.keys(prompt(seed, 2))
                    dst = "disk" if arg != "disk" else "remote"
                    ops.move_local(keys, None, arg, dst, copy=False)
            assert mgr.flush(10)
            snap = {t: {k for k, _ in items} for t, items in ops.snapshot().items()}
            state = replay(seen)
            for tier in ("cpu", "disk", "remote"):
                assert state.get(tier, set()) == snap[tier], tier
            mgr.check_invariants()
        finally:
            mgr.close()
