"""DiskTier: round trip, restart reuse, corruption as a miss, .tmp cleanup, byte bound, ownership, failing writes."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from conftest import payload_for, small_namespace
from kvtier.serde.record import FIXED, encode_payload_header
from kvtier.tiers.base import ChunkWrite
from kvtier.tiers.disk import HEADER_BYTES, SUFFIX, DiskTier, DiskTierLocked, record_relpath
from kvtier.tiers.disk import fileops as fileops_mod

REPO = Path(__file__).resolve().parents[1]
CB = 2048
FILE = HEADER_BYTES + CB
NS = small_namespace().digest()
OTHER_NS = small_namespace(model="test/other-model").digest()

KeyFn = Callable[[int], bytes]


def file_of(root: Path, key: bytes) -> Path:
    return root / record_relpath(key)


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


def test_put_many_and_get_many_round_trip(tier: DiskTier, make_key: KeyFn) -> None:
    keys = [make_key(i) for i in range(5)]
    assert tier.put_many([ChunkWrite(k, None, payload_for(k, CB)) for k in keys]) == [True] * 5
    outs = [np.zeros(CB, np.uint8) for _ in keys]
    assert tier.get_many_into(list(zip(keys, outs))) == [True] * 5
    assert all(np.array_equal(o, payload_for(k, CB)) for k, o in zip(keys, outs))
    assert tier.contains_many(keys + [make_key(9)]) == [True] * 5 + [False]
    # storing a chunk again replaces it (bytes counted once)
    assert tier.put_many([ChunkWrite(keys[0], None, payload_for(keys[0], CB))]) == [True]
    assert len(tier) == 5 and tier.used_bytes == 5 * FILE
    s = tier.stats()
    assert s["put_ok"] == 6 and s["get_hits"] == 5 and s["chunks"] == 5
    tier.check_invariants()


def test_bad_arguments_raise_before_any_write(tier: DiskTier, make_key: KeyFn) -> None:
    k = make_key(1)
    with pytest.raises(ValueError):
        tier.put_many([ChunkWrite(k, None, payload_for(k, CB)), ChunkWrite(make_key(2), None, b"")])
    with pytest.raises(ValueError, match="own parent"):
        tier.put(k, payload_for(k, CB), parent=k)
    with pytest.raises(TypeError):
        tier.contains_many(["not bytes"])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        tier.get_into(k, np.zeros(CB, np.uint8)[::2])
    assert len(tier) == 0


def test_closed_tier_is_a_miss_and_refuses_writes(disk_dir: Path, make_key: KeyFn) -> None:
    t = open_tier(disk_dir)
    k = make_key(1)
    assert t.put(k, payload_for(k, CB))
    t.close()
    t.close()  # idempotent
    assert t.contains(k) is False and read(t, k) is None
    assert t.put(make_key(2), payload_for(make_key(2), CB)) is False and t.writable is False
    assert t.delete_many([k]) == 0 and t.clear() == 0
    assert len(kv_files(disk_dir)) == 1


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
    (other_sub / f".ff00{SUFFIX}.1.2.tmp").write_bytes(b"partial")
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
    # header offsets (kvtier.serde.record): magic 0, version 8, header_len 10, flags 12,
    # key_len 14, parent_len 15, namespace 16, codec 48, codec_version 64, payload_len 66,
    # body_len 74, stored_len 82, body_sum 90, created 98, key 106, header sum 138
    "header-magic": _flip(0),
    "header-version": _flip(8),
    "header-flags": _flip(12),
    "header-key-len": _flip(14),
    "header-parent-len": _flip(15),
    "header-namespace": _flip(20),
    "header-codec": _flip(49),
    "header-payload-len": _flip(68),
    "header-stored-len": _flip(84),
    "header-payload-sum": _flip(92),
    "header-created": _flip(100),
    "header-key": _flip(110),
    "header-sum": _flip(FIXED.size + 32 + 3),
    "header-padding": _flip(HEADER_BYTES - 1),
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


def test_wrong_namespace_is_dropped_at_open(disk_dir: Path, make_key: KeyFn) -> None:
    k = make_key(1)
    t1 = open_tier(disk_dir, namespace=NS)
    t1.put(k, payload_for(k, CB))
    t1.close()
    t2 = open_tier(disk_dir, namespace=OTHER_NS)
    try:
        assert read(t2, k) is None
        assert not t2.contains(k) and not file_of(disk_dir, k).exists() and t2.used_bytes == 0
    finally:
        t2.close()


def test_wrong_namespace_written_while_open_is_a_miss_and_removed(
    tier: DiskTier, disk_dir: Path, make_key: KeyFn
) -> None:
    k = make_key(1)
    tier.put(k, payload_for(k, CB))
    payload = payload_for(k, CB)
    file_of(disk_dir, k).write_bytes(encode_payload_header(k, OTHER_NS, payload) + payload.tobytes())
    assert read(tier, k) is None and not file_of(disk_dir, k).exists() and tier.corrupt_reads == 1


def test_file_renamed_under_another_key_is_a_miss(tier: DiskTier, disk_dir: Path, make_key: KeyFn) -> None:
    a, b = make_key(1), make_key(2)
    tier.put(a, payload_for(a, CB))
    tier.close()
    dst = file_of(disk_dir, b)
    dst.parent.mkdir(exist_ok=True)
    os.replace(file_of(disk_dir, a), dst)
    t2 = open_tier(disk_dir)
    try:
        assert not t2.contains(b) and not dst.exists()  # dropped at open: its name is not its key's
    finally:
        t2.close()


def test_file_renamed_under_another_key_while_open_is_a_miss(
    tier: DiskTier, disk_dir: Path, make_key: KeyFn
) -> None:
    a, b = make_key(1), make_key(2)
    tier.put(a, payload_for(a, CB))
    tier.put(b, payload_for(b, CB))
    os.replace(file_of(disk_dir, a), file_of(disk_dir, b))
    assert read(tier, b) is None and not file_of(disk_dir, b).exists() and tier.corrupt_reads == 1


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
        m.setattr(fileops_mod.os, "write", _raise(errno.ENOSPC))
        m.setattr(fileops_mod.os, "pwritev", _raise(errno.ENOSPC))
        assert tier.put(make_key(2), payload_for(make_key(2), CB)) is False
    assert tier.writable is False and tier.failed_writes == 1
    assert tier.used_bytes == FILE and len(tier) == 1
    assert not list(disk_dir.rglob("*.tmp")) and not tier.contains(make_key(2))
    # reads still work
    got = read(tier, old)
    assert got is not None and np.array_equal(got, payload_for(old, CB))
    # and no more writes are attempted, even after the disk has room again
    assert tier.put(make_key(3), payload_for(make_key(3), CB)) is False
    assert tier.put_many([ChunkWrite(make_key(4), None, payload_for(make_key(4), CB))]) == [False]
    assert len(kv_files(disk_dir)) == 1 and tier.stats()["put_failed"] >= 2


def test_enospc_in_a_batch_fails_the_rest_of_it(
    tier: DiskTier, make_key: KeyFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [make_key(i) for i in range(3)]
    monkeypatch.setattr(fileops_mod.os, "open", _raise(errno.ENOSPC))
    got = tier.put_many([ChunkWrite(k, None, payload_for(k, CB)) for k in keys])
    monkeypatch.undo()
    assert got == [False] * 3 and tier.writable is False and tier.failed_writes == 1
    assert tier.contains_many(keys) == [False] * 3


def test_other_write_errors_do_not_stop_writes(
    tier: DiskTier, make_key: KeyFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as m:
        m.setattr(fileops_mod.os, "open", _raise(errno.EIO))
        assert tier.put(make_key(1), payload_for(make_key(1), CB)) is False
    assert tier.writable is True and tier.failed_writes == 1 and tier.used_bytes == 0
    assert tier.put(make_key(1), payload_for(make_key(1), CB)) is True


def test_read_errors_are_misses(tier: DiskTier, make_key: KeyFn, monkeypatch: pytest.MonkeyPatch) -> None:
    k = make_key(1)
    tier.put(k, payload_for(k, CB))

    def broken_open(*a: object, **kw: object) -> object:
        raise OSError(errno.EIO, "I/O error")

    with monkeypatch.context() as m:
        m.setattr(fileops_mod.os, "open", broken_open)  # the read path opens with os.open
        assert read(tier, k) is None
    assert read(tier, k) is not None  # a transient read error does not delete the chunk


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS), ids=list(CORRUPTIONS))
def test_without_read_verification_only_payload_rot_gets_through(
    disk_dir: Path, make_key: KeyFn, corrupt: str
) -> None:
    """disk_verify_reads = false skips the payload hash only: every other check still makes a miss."""
    t = open_tier(disk_dir, verify_reads=False)
    try:
        k = make_key(1)
        t.put(k, payload_for(k, CB))
        CORRUPTIONS[corrupt](file_of(disk_dir, k))
        got = read(t, k)
        if corrupt.startswith("payload-"):  # LMCache's trade-off: rotted payload bytes are served
            assert got is not None and not np.array_equal(got, payload_for(k, CB))
        else:
            assert got is None and t.corrupt_reads == 1
        assert t.stats()["verify_reads"] is False
    finally:
        t.close()
    on = open_tier(disk_dir)  # reopened with verification (the default): the stored checksum catches it
    try:
        if corrupt.startswith("payload-"):
            assert read(on, k) is None and on.corrupt_reads == 1
    finally:
        on.close()


def test_the_setting_reaches_the_tier(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from kvtier.config import KVTierConfig
    from kvtier.index.keys import KeyNamespace, LayoutSignature
    from kvtier.storage.lower_tiers import open_disk_tier

    layout = LayoutSignature(engine="t", attn_backend="numpy", kv_layout="LBHNC", block_size=16, num_layers=2,
                             num_kv_heads=1, head_dim=8, dtype="bfloat16")
    ns = KeyNamespace("t/verify", layout, 32)
    for flag in (True, False):
        cfg = KVTierConfig(chunk_size=32, disk_path=tmp_path / str(flag), disk_verify_reads=flag)
        with caplog.at_level("WARNING", logger="kvtier.storage.lower_tiers"):
            t = open_disk_tier(cfg, ns, lambda k: False)
        try:
            assert t.stats()["verify_reads"] is flag
            assert ("not checksum-verified" in caplog.text) is (not flag)
        finally:
            t.close()
