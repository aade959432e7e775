"""Shared-filesystem tier specifics: URLs, atomic publication, TTL, an unmounted share."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.testing import bf16_payload
from kvtier.tiers.fs_tier import SUFFIX, FsTier

KEY = bytes(range(32))


def _files(root: Path, pattern: str) -> list[Path]:
    return sorted(root.glob(f"*/{pattern}"))


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
    sub = tmp_path / KEY.hex()[:2]
    sub.mkdir()
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
