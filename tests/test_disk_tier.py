"""DiskTier: round trip, restart reuse, corruption as a miss, .tmp cleanup, byte bound, ownership, failing writes."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from conftest import payload_for, small_namespace
from kvtier.tiers import disk as disk_mod
from kvtier.tiers.disk import HEADER_BYTES, SUFFIX, DiskTier, DiskTierLocked

REPO = Path(__file__).resolve().parents[1]
CB = 2048
FILE = HEADER_BYTES + CB
NS = small_namespace().digest()
OTHER_NS = small_namespace(model="test/other-model").digest()

KeyFn = Callable[[int], bytes]


def file_of(root: Path, key: bytes) -> Path:
    h = key.hex()
    return root / h[:2] / (h + SUFFIX)


def kv_files(root: Path) -> list[Path]:
    return sorted(root.glob(f"??/*{SUFFIX}"))


def open_tier(root: Path, capacity: int = 16 * FILE, namespace: bytes = NS, **kw: object) -> DiskTier:
    return DiskTier(root, capacity, namespace, **kw)  # type: ignore[arg-type]


def read(tier: DiskTier, key: bytes) -> np.ndarray | None:
    out = np.zeros(CB, dtype=np.uint8)
    return out if tier.get_into(key, out) else None


@pytest.fixture
def tier(disk_dir: Path):
    t = open_tier(disk_dir)
    yield t
    t.close()


# -- round trip -----------------------------------------------------------------


def test_sync_round_trip(tier: DiskTier, disk_dir: Path, make_key: KeyFn) -> None:
    k = make_key(1)
    assert read(tier, k) is None
    assert tier.put(k, payload_for(k, CB)) is True
    assert tier.contains(k) and len(tier) == 1
    assert file_of(disk_dir, k).stat().st_size == FILE
    assert tier.used_bytes == FILE and tier.written_chunks == 1
    got = read(tier, k)
    assert got is not None and np.array_equal(got, payload_for(k, CB))


def test_async_round_trip_calls_on_done_once(tier: DiskTier, make_key: KeyFn) -> None:
    done: list[bytes] = []
    keys = [make_key(i) for i in range(5)]
    for k in keys:
        assert tier.put_async(k, payload_for(k, CB), lambda k=k: done.append(k)) is True
    assert tier.flush(timeout_s=30)
    assert sorted(done) == sorted(keys)
    assert tier.pending_writes == 0
    for k in keys:
        got = read(tier, k)
        assert got is not None and np.array_equal(got, payload_for(k, CB))
    # already on disk: refused, on_done still runs exactly once
    assert tier.put_async(keys[0], payload_for(keys[0], CB), lambda: done.append(b"again")) is False
    assert done.count(b"again") == 1


def test_close_finishes_queued_writes(disk_dir: Path, make_key: KeyFn) -> None:
    t = open_tier(disk_dir)
    keys = [make_key(i) for i in range(6)]
    for k in keys:
        t.put_async(k, payload_for(k, CB), lambda: None)
    t.close()
    assert len(kv_files(disk_dir)) == 6
    assert t.put_async(make_key(99), payload_for(make_key(99), CB), lambda: None) is False  # closed


# -- restart reuse -------------------------------------------------------------------


def test_restart_reuses_files_without_rewriting(disk_dir: Path, make_key: KeyFn) -> None:
    keys = [make_key(i) for i in range(4)]
    t1 = open_tier(disk_dir)
    for k in keys:
        assert t1.put(k, payload_for(k, CB))
    t1.close()
    before = {p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in kv_files(disk_dir)}
    assert len(before) == 4

    t2 = open_tier(disk_dir)
    try:
        assert len(t2) == 4 and t2.used_bytes == 4 * FILE
        for k in keys:
            assert t2.contains(k)
            got = read(t2, k)
            assert got is not None and np.array_equal(got, payload_for(k, CB))
        # storing the same chunks again is a no-op
        assert t2.put(keys[0], payload_for(keys[0], CB)) is True
        calls: list[int] = []
        assert t2.put_async(keys[1], payload_for(keys[1], CB), lambda: calls.append(1)) is False
        assert calls == [1]
        t2.flush(30)
        assert t2.written_chunks == 0
    finally:
        t2.close()
    after = {p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in kv_files(disk_dir)}
    assert after == before


def test_restart_eviction_order_follows_file_mtime(disk_dir: Path, make_key: KeyFn) -> None:
    a, b, c, d = (make_key(i) for i in range(4))
    t1 = open_tier(disk_dir)
    for k in (a, b, c):
        t1.put(k, payload_for(k, CB))
    t1.close()
    now = time.time()
    os.utime(file_of(disk_dir, a), (now, now))  # newest
    os.utime(file_of(disk_dir, b), (now - 300, now - 300))  # oldest
    os.utime(file_of(disk_dir, c), (now - 100, now - 100))
    t2 = open_tier(disk_dir, capacity=3 * FILE)
    try:
        assert t2.put(d, payload_for(d, CB))
        assert not t2.contains(b) and not file_of(disk_dir, b).exists()
        assert t2.contains(a) and t2.contains(c) and t2.contains(d)
    finally:
        t2.close()


def test_leftover_tmp_files_are_removed_at_open(disk_dir: Path, make_key: KeyFn) -> None:
    k = make_key(1)
    t1 = open_tier(disk_dir)
    t1.put(k, payload_for(k, CB))
    t1.close()
    sub = file_of(disk_dir, k).parent
    leftover = sub / f".{file_of(disk_dir, k).name}.12345.678.tmp"
    leftover.write_bytes(b"x" * 5000)
    other_sub = disk_dir / "ff"
    other_sub.mkdir(exist_ok=True)
    (other_sub / ".ff00.kv.1.2.tmp").write_bytes(b"partial")
    t2 = open_tier(disk_dir)
    try:
        assert not leftover.exists() and not list(other_sub.iterdir())
        assert len(t2) == 1 and t2.used_bytes == FILE  # the .tmp bytes are not counted
    finally:
        t2.close()


def test_file_shorter_than_a_header_is_dropped_at_open(disk_dir: Path, make_key: KeyFn) -> None:
    k = make_key(1)
    t1 = open_tier(disk_dir)
    t1.put(k, payload_for(k, CB))
    t1.close()
    os.truncate(file_of(disk_dir, k), 100)
    t2 = open_tier(disk_dir)
    try:
        assert not t2.contains(k) and not file_of(disk_dir, k).exists() and t2.used_bytes == 0
    finally:
        t2.close()


# -- corruption and loss are misses -----------------------------------------------------


def _truncate_payload(p: Path) -> None:
    os.truncate(p, FILE - 100)


def _truncate_into_header(p: Path) -> None:
    os.truncate(p, 1000)


def _truncate_short_header(p: Path) -> None:
    os.truncate(p, 40)


def _flip(offset: int) -> Callable[[Path], None]:
    def flip(p: Path) -> None:
        data = bytearray(p.read_bytes())
        data[offset] ^= 0x10
        p.write_bytes(bytes(data))

    return flip


def _append(p: Path) -> None:
    with open(p, "ab") as f:
        f.write(b"extra")


CORRUPTIONS = {
    "truncated-payload": _truncate_payload,
    "truncated-into-header": _truncate_into_header,
    "truncated-header": _truncate_short_header,
    "payload-first-byte": _flip(HEADER_BYTES),
    "payload-last-byte": _flip(FILE - 1),
    # header offsets: magic 0, version 8, codec 12, payload len 28, payload sum 36,
    # key 44, namespace 76, created 108, header sum 116 (struct "<8sHH16sQ8s32s32sd" + 8s)
    "header-magic": _flip(0),
    "header-version": _flip(8),
    "header-codec": _flip(13),
    "header-payload-len": _flip(28),
    "header-payload-sum": _flip(40),
    "header-key": _flip(50),
    "header-namespace": _flip(90),
    "header-created": _flip(110),
    "header-sum": _flip(disk_mod._HDR.size + 3),
    "trailing-bytes": _append,
}


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS), ids=list(CORRUPTIONS))
def test_corrupt_file_is_a_miss_and_removed(tier: DiskTier, disk_dir: Path, make_key: KeyFn, corrupt: str) -> None:
    k, other = make_key(1), make_key(2)
    tier.put(k, payload_for(k, CB))
    tier.put(other, payload_for(other, CB))
    CORRUPTIONS[corrupt](file_of(disk_dir, k))
    assert read(tier, k) is None
    assert not tier.contains(k) and not file_of(disk_dir, k).exists()
    assert tier.corrupt_reads == 1
    assert tier.used_bytes == FILE and len(tier) == 1
    got = read(tier, other)  # the neighbour is untouched
    assert got is not None and np.array_equal(got, payload_for(other, CB))


def test_wrong_namespace_is_a_miss_and_removed(disk_dir: Path, make_key: KeyFn) -> None:
    k = make_key(1)
    t1 = open_tier(disk_dir, namespace=NS)
    t1.put(k, payload_for(k, CB))
    t1.close()
    t2 = open_tier(disk_dir, namespace=OTHER_NS)
    try:
        assert read(t2, k) is None
        assert not t2.contains(k) and not file_of(disk_dir, k).exists()
        assert t2.corrupt_reads == 1 and t2.used_bytes == 0
    finally:
        t2.close()


def test_file_renamed_under_another_key_is_a_miss(tier: DiskTier, disk_dir: Path, make_key: KeyFn) -> None:
    a, b = make_key(1), make_key(2)
    tier.put(a, payload_for(a, CB))
    tier.close()
    dst = file_of(disk_dir, b)
    dst.parent.mkdir(exist_ok=True)
    os.replace(file_of(disk_dir, a), dst)
    t2 = open_tier(disk_dir)
    try:
        assert t2.contains(b)
        assert read(t2, b) is None and not dst.exists()
    finally:
        t2.close()


def test_removed_file_is_a_miss(tier: DiskTier, disk_dir: Path, make_key: KeyFn) -> None:
    k = make_key(1)
    tier.put(k, payload_for(k, CB))
    os.unlink(file_of(disk_dir, k))
    assert read(tier, k) is None
    assert not tier.contains(k) and tier.used_bytes == 0
    assert tier.put(k, payload_for(k, CB)) is True  # can be stored again
    assert read(tier, k) is not None


# -- byte bound and eviction ----------------------------------------------------------


def test_capacity_bound_and_lru_eviction(disk_dir: Path, make_key: KeyFn) -> None:
    t = open_tier(disk_dir, capacity=3 * FILE + FILE // 2)
    try:
        keys = [make_key(i) for i in range(6)]
        for k in keys[:3]:
            assert t.put(k, payload_for(k, CB))
        assert read(t, keys[0]) is not None  # touch: order 1, 2, 0
        for k in keys[3:5]:
            assert t.put(k, payload_for(k, CB))
            assert t.used_bytes <= t.capacity_bytes
            assert sum(p.stat().st_size for p in kv_files(disk_dir)) <= t.capacity_bytes
        assert {i for i, k in enumerate(keys) if t.contains(k)} == {0, 3, 4}
        assert not file_of(disk_dir, keys[1]).exists() and not file_of(disk_dir, keys[2]).exists()
        assert t.evicted_chunks == 2 and t.evicted_bytes == 2 * FILE
        assert len(kv_files(disk_dir)) == 3
    finally:
        t.close()


def test_eviction_skips_pinned(disk_dir: Path, make_key: KeyFn) -> None:
    pinned: set[bytes] = set()
    t = open_tier(disk_dir, capacity=3 * FILE, is_pinned=pinned.__contains__)
    try:
        keys = [make_key(i) for i in range(3)]
        for k in keys:
            t.put(k, payload_for(k, CB))
        pinned.add(keys[0])
        for i in range(3, 7):
            assert t.put(make_key(i), payload_for(make_key(i), CB))
            assert t.contains(keys[0])
        pinned.update(make_key(i) for i in range(7))
        assert t.put(make_key(50), payload_for(make_key(50), CB)) is False  # everything pinned
        assert t.dropped_writes == 1 and not file_of(disk_dir, make_key(50)).exists()
        assert t.used_bytes <= t.capacity_bytes and len(t) == 3
    finally:
        t.close()


def test_chunk_larger_than_capacity_is_not_written(disk_dir: Path, make_key: KeyFn) -> None:
    t = open_tier(disk_dir, capacity=FILE - 1)
    try:
        assert t.put(make_key(1), payload_for(make_key(1), CB)) is False
        assert len(t) == 0 and not kv_files(disk_dir)
    finally:
        t.close()


def test_clear_and_delete(tier: DiskTier, disk_dir: Path, make_key: KeyFn) -> None:
    for i in range(3):
        tier.put(make_key(i), payload_for(make_key(i), CB))
    assert tier.delete(make_key(0)) is True and tier.delete(make_key(0)) is False
    assert tier.clear() == 2
    assert len(tier) == 0 and tier.used_bytes == 0 and not kv_files(disk_dir)


def test_full_write_queue_drops_and_counts(tier: DiskTier, make_key: KeyFn) -> None:
    gate = threading.Event()
    started = threading.Event()
    real_write = tier._write

    def slow_write(key: bytes, payload: np.ndarray, parent: bytes | None = None) -> bool:
        started.set()
        gate.wait(30)
        return real_write(key, payload)

    tier._write = slow_write  # type: ignore[method-assign]
    tier._queue.maxsize = 1
    done: list[int] = []
    try:
        assert tier.put_async(make_key(1), payload_for(make_key(1), CB), lambda: done.append(1))
        assert started.wait(30)  # the writer holds chunk 1
        assert tier.put_async(make_key(2), payload_for(make_key(2), CB), lambda: done.append(2))
        assert tier.put_async(make_key(3), payload_for(make_key(3), CB), lambda: done.append(3)) is False
        assert done == [3] and tier.dropped_writes == 1
    finally:
        gate.set()
    assert tier.flush(30)
    assert sorted(done) == [1, 2, 3]
    assert tier.contains(make_key(1)) and tier.contains(make_key(2)) and not tier.contains(make_key(3))


# -- one owner per directory ----------------------------------------------------------

_HOLDER = textwrap.dedent(
    """
    import sys
    from kvtier.tiers.disk import DiskTier
    t = DiskTier(sys.argv[1], 1 << 20, b"\\x00" * 32)
    print("ready", flush=True)
    sys.stdin.readline()
    """
)


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def test_second_owner_gets_disk_tier_locked_naming_the_pid(disk_dir: Path, make_key: KeyFn) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(disk_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=_child_env(),
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        with pytest.raises(DiskTierLocked) as err:
            open_tier(disk_dir)
        assert f"pid {child.pid}" in str(err.value)
        assert str(disk_dir) in str(err.value)
    finally:
        assert child.stdin is not None
        child.stdin.close()  # the child exits without closing its tier: the kernel drops the lock
        child.wait(timeout=60)
    t = open_tier(disk_dir)  # the dead owner's lock is gone
    t.close()


def test_second_owner_in_the_same_process_is_refused(tier: DiskTier, disk_dir: Path) -> None:
    with pytest.raises(DiskTierLocked, match=f"pid {os.getpid()}"):
        open_tier(disk_dir)
    tier.close()
    open_tier(disk_dir).close()  # released by close()


# -- failing writes stop writing; reads go on -------------------------------------------


def _raise(err: int) -> Callable[..., object]:
    def fail(*args: object, **kw: object) -> object:
        raise OSError(err, os.strerror(err))

    return fail


def test_enospc_makes_the_tier_read_only(
    tier: DiskTier, disk_dir: Path, make_key: KeyFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = make_key(1)
    assert tier.put(old, payload_for(old, CB))
    with monkeypatch.context() as m:
        m.setattr(disk_mod.os, "write", _raise(errno.ENOSPC))
        assert tier.put(make_key(2), payload_for(make_key(2), CB)) is False
    assert tier.writable is False and tier.failed_writes == 1
    assert tier.used_bytes == FILE and len(tier) == 1
    assert not list(disk_dir.rglob("*.tmp")) and not tier.contains(make_key(2))
    # reads still work
    got = read(tier, old)
    assert got is not None and np.array_equal(got, payload_for(old, CB))
    # and no more writes are attempted, even after the disk has room again
    assert tier.put(make_key(3), payload_for(make_key(3), CB)) is False
    calls: list[int] = []
    assert tier.put_async(make_key(4), payload_for(make_key(4), CB), lambda: calls.append(1)) is False
    assert calls == [1] and len(kv_files(disk_dir)) == 1


def test_enospc_in_write_behind(tier: DiskTier, make_key: KeyFn, monkeypatch: pytest.MonkeyPatch) -> None:
    done: list[int] = []
    monkeypatch.setattr(disk_mod.os, "open", _raise(errno.ENOSPC))
    assert tier.put_async(make_key(1), payload_for(make_key(1), CB), lambda: done.append(1))
    assert tier.flush(30)
    monkeypatch.undo()
    assert done == [1] and tier.writable is False and not tier.contains(make_key(1))


def test_other_write_errors_do_not_stop_writes(
    tier: DiskTier, make_key: KeyFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as m:
        m.setattr(disk_mod.os, "open", _raise(errno.EIO))
        assert tier.put(make_key(1), payload_for(make_key(1), CB)) is False
    assert tier.writable is True and tier.failed_writes == 1 and tier.used_bytes == 0
    assert tier.put(make_key(1), payload_for(make_key(1), CB)) is True


def test_read_errors_are_misses(tier: DiskTier, make_key: KeyFn, monkeypatch: pytest.MonkeyPatch) -> None:
    k = make_key(1)
    tier.put(k, payload_for(k, CB))

    def broken_open(*a: object, **kw: object) -> object:
        raise OSError(errno.EIO, "I/O error")

    with monkeypatch.context() as m:
        m.setattr("builtins.open", broken_open)
        assert read(tier, k) is None
    assert read(tier, k) is not None  # a transient read error does not delete the chunk
