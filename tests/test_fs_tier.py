"""Shared-filesystem tier specifics: URLs, atomic publication, TTL, an unmounted share."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.testing import bf16_payload
from kvtier.tiers.base import ChunkWrite
from kvtier.tiers.fs_tier import SUFFIX, FsTier

KEY = bytes(range(32))


def _files(root: Path, pattern: str) -> list[Path]:
    """Files under ``root/<namespace>/<2 hex>/`` matching ``pattern``."""
    return sorted(root.glob(f"*/*/{pattern}"))


def test_url_and_options(tmp_path: Path):
    t = FsTier.from_url(f"fs://{tmp_path}/kv?codec=shuffle-zstd&ttl_s=60&fsync=1")
    assert t.root == tmp_path / "kv" and t.root.is_dir()
    assert t.codec.name == "shuffle-zstd" and t.ttl_s == 60 and t.fsync
    with pytest.raises(ValueError, match="unknown fs tier URL option"):
        FsTier.from_url(f"fs://{tmp_path}/kv?colour=blue")
    with pytest.raises(ValueError):
        FsTier.from_url(f"fs://otherhost{tmp_path}")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        FsTier(tmp_path / "file")


def test_two_machines_share_chunks_and_no_temp_files_remain(tmp_path: Path):
    a, b = FsTier(tmp_path), FsTier(tmp_path)
    value = bf16_payload(1 << 16, 0)
    assert a.put(KEY, value)
    out = np.zeros_like(value)
    assert b.contains(KEY) and b.get_into(KEY, out) and np.array_equal(out, value)
    assert _files(tmp_path, "*.tmp") == [] and len(_files(tmp_path, "*" + SUFFIX)) == 1


def test_readers_never_see_a_partial_overwrite(tmp_path: Path):
    tier = FsTier(tmp_path)
    values = [bf16_payload(1 << 18, i) for i in range(2)]
    assert tier.put(KEY, values[0])
    stop = threading.Event()
    bad: list[int] = []

    def writer():
        i = 0
        while not stop.is_set():
            tier.put(KEY, values[i % 2])
            i += 1

    w = threading.Thread(target=writer)
    w.start()
    out = np.zeros_like(values[0])
    hits = 0
    for _ in range(200):
        if tier.get_into(KEY, out):
            hits += 1
            if not (np.array_equal(out, values[0]) or np.array_equal(out, values[1])):
                bad.append(1)
    stop.set()
    w.join()
    assert not bad and hits == 200
    assert tier.stats()["get_corrupt"] == 0


def test_expired_files_are_misses_and_removed(tmp_path: Path):
    tier = FsTier(tmp_path, ttl_s=60)
    value = bf16_payload(4096, 1)
    assert tier.put(KEY, value)
    (path,) = _files(tmp_path, "*" + SUFFIX)
    old = time.time() - 120
    os.utime(path, (old, old))
    assert tier.contains(KEY) is False and not path.exists()
    assert tier.put(KEY, value)
    os.utime(path, (old, old))
    assert tier.get_into(KEY, np.zeros_like(value)) is False and not path.exists()


def test_leftover_temp_files_are_invisible_and_cleared_when_old(tmp_path: Path):
    tier = FsTier(tmp_path)
    sub = tier.path_of(KEY).parent
    sub.mkdir(parents=True)
    stale = sub / f".{KEY.hex()}{SUFFIX}.otherhost.1.2.tmp"
    stale.write_bytes(b"half a chunk")
    fresh = sub / f".{KEY.hex()}{SUFFIX}.otherhost.1.3.tmp"
    fresh.write_bytes(b"being written right now")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    assert tier.contains(KEY) is False
    assert tier.clear() == 0
    assert not stale.exists() and fresh.exists()  # another machine may still be writing it


def test_unmounted_share_is_not_recreated(tmp_path: Path):
    root = tmp_path / "mnt"
    tier = FsTier(root, create=False)  # not mounted yet: opens, misses
    value = bf16_payload(4096, 2)
    assert tier.put(KEY, value) is False and not root.exists()
    assert tier.stats()["put_failed"] == 1 and tier.stats()["errors"] == 1
    root.mkdir()  # mounted now
    assert tier.put(KEY, value) and tier.contains(KEY)


# -- the chunk record, namespaces, privacy, leaf-first expiry --------------------------------------

NS_A, NS_B = b"A" * 32, b"B" * 32


def _chain(n: int, seed: int = 0) -> list[bytes]:
    return [bytes([seed, i]) * 16 for i in range(n)]


def test_records_carry_parent_and_codec(tmp_path: Path):
    from kvtier.serde.record import decode_header

    tier = FsTier(tmp_path, NS_A, codec="shuffle-zstd")
    head, tail = _chain(2)
    value = bf16_payload(1 << 14, 3)
    assert all(tier.put_many([ChunkWrite(head, None, value), ChunkWrite(tail, head, value)]))
    hdr = decode_header(tier.path_of(tail).read_bytes()[:4096])
    assert hdr.parent == head and hdr.namespace == NS_A and hdr.codec == "shuffle-zstd"
    out = np.zeros_like(value)
    assert FsTier(tmp_path, NS_A).get_into(tail, out) and np.array_equal(out, value)  # any reader decodes it


def test_clear_and_reads_are_scoped_to_the_namespace(tmp_path: Path):
    a, b = FsTier(tmp_path, NS_A), FsTier(tmp_path, NS_B)
    value = bf16_payload(4096, 4)
    keys = _chain(3)
    assert all(a.put_many([ChunkWrite(k, None, value) for k in keys]))
    assert b.put(keys[0], value)
    assert b.contains_many(keys) == [True, False, False]
    assert a.clear() == 3
    assert a.contains_many(keys) == [False] * 3 and b.contains(keys[0])  # the other model keeps its chunk
    # A record of namespace A copied under B's name is a miss for B (and removed).
    assert a.put(keys[1], value)
    b.path_of(keys[1]).parent.mkdir(parents=True, exist_ok=True)
    b.path_of(keys[1]).write_bytes(a.path_of(keys[1]).read_bytes())
    assert b.get_into(keys[1], np.zeros_like(value)) is False and b.stats()["get_corrupt"] == 1


def test_files_and_directories_are_private(tmp_path: Path):
    tier = FsTier(tmp_path / "share", NS_A)
    assert tier.put(KEY, bf16_payload(4096, 5))
    path = tier.path_of(KEY)
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert tier.dir.stat().st_mode & 0o777 == 0o700


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def _shift(path: Path, seconds: float) -> None:
    st = path.stat()
    os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds))


def test_ttl_never_expires_a_head_before_its_tails(tmp_path: Path):
    """Failing input 4 (remote TTL): a hot head expired before its tails left them unreachable."""
    tier = FsTier(tmp_path, NS_A, ttl_s=100)
    s, a1, a2 = _chain(3)
    value = bf16_payload(4096, 6)
    assert tier.put(s, value)
    _age(tier.path_of(s), 60)  # the shared head was written a while ago
    assert all(tier.put_many([ChunkWrite(a1, s, value), ChunkWrite(a2, a1, value)]))  # a new prompt on it
    tier.check_invariants()
    assert tier.path_of(a2).stat().st_mtime_ns <= tier.path_of(s).stat().st_mtime_ns
    for k in (s, a1, a2):  # 50 s pass: the head's TTL runs out
        _shift(tier.path_of(k), 50)
    # the whole chain goes with its head: no tail is left visible without it
    assert tier.contains_many([s, a1, a2]) == [False, False, False]


def test_touch_refreshes_the_chain_head_first(tmp_path: Path):
    tier = FsTier(tmp_path, NS_A, ttl_s=100)
    keys = _chain(4)
    value = bf16_payload(4096, 7)
    assert all(tier.put_many([ChunkWrite(k, p, value) for k, p in zip(keys, [None, *keys[:-1]])]))
    for k in keys:
        _age(tier.path_of(k), 90)
    tier.touch_many(keys[1:3])  # a hit that starts below the head refreshes the head too
    tier.check_invariants()
    mt = [tier.path_of(k).stat().st_mtime for k in keys]
    assert mt[0] > time.time() - 5 and mt[1] > time.time() - 5 and mt[2] > time.time() - 5
    assert mt[3] < time.time() - 80  # the untouched tail stays old: it expires first
    assert mt[3] <= mt[2] <= mt[1] <= mt[0]


def test_expired_head_stays_a_miss_for_a_late_tail(tmp_path: Path):
    """A tail written onto an expired head expires with it (no orphan becomes visible)."""
    tier = FsTier(tmp_path, NS_A, ttl_s=100)
    s, t = _chain(2)
    value = bf16_payload(4096, 8)
    assert tier.put(s, value)
    _age(tier.path_of(s), 200)
    assert tier.put(t, value, parent=s)
    assert tier.contains_many([s, t]) == [False, False]


def test_chain_written_out_of_order_keeps_the_invariant(tmp_path: Path):
    tier = FsTier(tmp_path, NS_A, ttl_s=100)
    keys = _chain(3)
    value = bf16_payload(4096, 9)
    parents = [None, *keys[:-1]]
    for i in (2, 0, 1):  # tail first (write-behind of two tiers can reorder)
        assert tier.put(keys[i], value, parent=parents[i])
    tier.check_invariants()
    assert tier.contains_many(keys) == [True, True, True]


def test_previous_layout_is_noted_once_and_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    old = tmp_path / KEY.hex()[:2]
    old.mkdir()
    (old / (KEY.hex() + ".kvv")).write_bytes(b"KVRV" + bytes(100))
    tier = FsTier(tmp_path, NS_A)
    assert sum("previous file layout" in r.getMessage() for r in caplog.records) == 1
    assert tier.contains(KEY) is False and tier.clear() == 0 and old.exists()
