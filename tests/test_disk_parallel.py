"""Parallel batch I/O of the disk tier: several chunk files in flight, every guarantee kept.

Checked on real files: round trips byte for byte (buffered and O_DIRECT, aligned
and odd sizes), a corrupt chunk in a parallel batch is a miss for that chunk only,
a killed writer (batches of 8, one prompt chain each) or a truncated record leaves
a consistent tier after restart, a failed parent is never published under its
child, and the number of I/Os in flight is bounded by ``io_threads``.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

from kvtier.serde.record import ALIGN, HEADER_BYTES, SUFFIX
from kvtier.tiers.base import ChunkWrite
from kvtier.tiers.disk import DiskTier, FileOps
from kvtier.tiers.disk.parallel import IOPool

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fault_helpers.direct_io import aligned as aligned_buffer  # noqa: E402
from fault_helpers.direct_io import o_direct_works  # noqa: E402
from fault_helpers.payloads import CRASH_NS, payload_for_key, size_for  # noqa: E402

NS = bytes(range(32))
REPO = Path(__file__).resolve().parents[1]
WRITER = Path(__file__).resolve().parent / "fault_helpers" / "crash_writer.py"


def _payloads(sizes: Sequence[int], seed: int, aligned: bool) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        p = aligned_buffer(n) if aligned else np.empty(n, np.uint8)
        p[:] = rng.integers(0, 256, n, dtype=np.uint8)
        out.append(p)
    return out


def _chain(payloads: Sequence[np.ndarray], seed: int) -> list[ChunkWrite]:
    keys = [bytes([seed, i]) * 16 for i in range(len(payloads))]
    return [ChunkWrite(k, keys[i - 1] if i else None, p) for i, (k, p) in enumerate(zip(keys, payloads))]


SIZES = [3 * ALIGN, 5 * ALIGN + 17, 1, 2 * 1024 * 1024 + 4096, 700_001, ALIGN, 9 * ALIGN, 123_457, 64 * ALIGN,
         9 * 1024 * 1024 + 13, 4 * 1024 * 1024]  # the last two: several read steps, several write steps


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_parallel_batch_round_trips_byte_for_byte(tmp_path: Path, direct: bool, aligned: bool) -> None:
    if direct and not o_direct_works(tmp_path):
        pytest.skip("file system refuses O_DIRECT")
    tier = DiskTier(tmp_path / "d", 1 << 30, NS, direct_io=direct, io_threads=4)
    try:
        assert tier.direct_io == direct
        ws = _chain(_payloads(SIZES, 1, aligned), 1)
        assert tier.put_many(ws) == [True] * len(ws)
        outs = [aligned_buffer(len(w.payload)) if aligned else np.zeros(len(w.payload), np.uint8) for w in ws]
        assert tier.get_many_into([(w.key, o) for w, o in zip(ws, outs)]) == [True] * len(ws)
        for w, o in zip(ws, outs):
            assert np.array_equal(o, w.payload)
        tier.check_invariants()
        assert not list((tmp_path / "d").rglob("*.tmp"))
    finally:
        tier.close()
    again = DiskTier(tmp_path / "d", 1 << 30, NS, direct_io=direct)  # restart: the same chunks, same bytes
    try:
        assert len(again) == len(ws)
        for w in ws:
            o = np.zeros(len(w.payload), np.uint8)
            assert again.get_into(w.key, o) and np.array_equal(o, w.payload)
    finally:
        again.close()


def test_a_corrupt_chunk_in_a_parallel_batch_is_a_miss_for_that_chunk_only(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "d", 1 << 30, NS, io_threads=4)
    try:
        payloads = _payloads([300_000] * 8, 2, aligned=False)
        ws = [ChunkWrite(bytes([9, i]) * 16, None, p) for i, p in enumerate(payloads)]  # independent chunks
        assert all(tier.put_many(ws))
        bad = ws[5].key
        path = tier.file_of(bad)
        with open(path, "r+b") as f:  # flip one payload byte in the middle: only the body checksum can tell
            f.seek(HEADER_BYTES + 150_000)
            b = f.read(1)
            f.seek(HEADER_BYTES + 150_000)
            f.write(bytes([b[0] ^ 0xFF]))
        outs = [np.zeros(len(p), np.uint8) for p in payloads]
        got = tier.get_many_into([(w.key, o) for w, o in zip(ws, outs)])
        assert got == [i != 5 for i in range(8)]
        for i, (w, o) in enumerate(zip(ws, outs)):
            if i != 5:
                assert np.array_equal(o, w.payload)
        assert tier.corrupt_reads == 1 and not path.exists() and not tier.contains(bad)
        assert tier.stats()["get_corrupt"] == 1 and tier.stats()["get_hits"] == 7
        tier.check_invariants()
    finally:
        tier.close()


class _FailOpen(FileOps):
    """Fails the open of one key's ``.tmp`` file with EIO."""

    def __init__(self, key: bytes):
        self.key_hex = key.hex()

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        if self.key_hex in os.path.basename(path) and path.endswith(".tmp"):
            raise OSError(errno.EIO, "injected EIO")
        return super().open(path, flags, mode)


def test_a_failed_parent_is_never_published_under_its_children(tmp_path: Path) -> None:
    ws = _chain(_payloads([200_000] * 6, 3, aligned=False), 3)
    tier = DiskTier(tmp_path / "d", 1 << 30, NS, io_threads=4, fs=_FailOpen(ws[2].key))
    try:
        assert tier.put_many(ws) == [True, True, False, False, False, False]
        assert len(tier) == 2 and tier.failed_writes == 1
        files = sorted(p.name for p in (tmp_path / "d").rglob(f"*{SUFFIX}"))
        assert files == sorted(tier.file_of(w.key).name for w in ws[:2])
        assert not list((tmp_path / "d").rglob("*.tmp"))
        tier.check_invariants()
    finally:
        tier.close()


def test_a_truncated_record_mid_chain_leaves_a_consistent_tier_after_restart(tmp_path: Path) -> None:
    d = tmp_path / "d"
    ws = _chain(_payloads([100_000] * 6, 4, aligned=False), 4)
    tier = DiskTier(d, 1 << 30, NS, io_threads=4)
    assert all(tier.put_many(ws))
    tier.close()
    os.truncate(tier.file_of(ws[3].key), HEADER_BYTES + 5000)  # a record torn by a crash
    (d / "ab").mkdir(exist_ok=True)
    (d / "ab" / f".{'ab' * 32}{SUFFIX}.1.2.tmp").write_bytes(b"x" * 9000)  # a killed writer's leftover
    tier = DiskTier(d, 1 << 30, NS, io_threads=4)
    try:
        assert [tier.contains(w.key) for w in ws] == [True, True, True, False, False, False]
        outs = [np.zeros(100_000, np.uint8) for _ in ws[:3]]
        assert tier.get_many_into([(w.key, o) for w, o in zip(ws, outs)]) == [True] * 3
        assert all(np.array_equal(o, w.payload) for w, o in zip(ws, outs))
        assert not list(d.rglob("*.tmp")) and len(list(d.rglob(f"*{SUFFIX}"))) == 3
        tier.check_invariants()
    finally:
        tier.close()


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(3))
def test_writer_killed_mid_batch_leaves_a_consistent_tier(trial: int, tmp_path: Path) -> None:
    d, log = tmp_path / "d", tmp_path / "done.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = str(REPO)
    child = subprocess.Popen(
        [sys.executable, str(WRITER), str(d), str(log), str(100 + trial), str(1 << 30),
         "--batch", "8", "--chain", "--piece", "16384", "--piece-delay", "0.0005"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().split()[:1] == ["ready"]
        time.sleep(random.Random(trial).uniform(0.2, 0.8))
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    done = {bytes.fromhex(x) for x in log.read_text().split()} if log.exists() else set()
    tier = DiskTier(d, 1 << 30, CRASH_NS, io_threads=4)
    try:
        assert not list(d.rglob("*.tmp"))
        assert all(tier.contains(k) for k in done), "a chunk reported written is gone"
        keys = [k for k, _ in tier.scan_keys()]
        outs = [np.zeros(size_for(k), np.uint8) for k in keys]
        assert all(tier.get_many_into(list(zip(keys, outs))))
        assert all(np.array_equal(o, payload_for_key(k)) for k, o in zip(keys, outs))
        assert tier.corrupt_reads == 0
        tier.check_invariants()
    finally:
        tier.close()


class _Concurrency(FileOps):
    """Counts ``pwritev``/``preadv`` calls in flight at once (each made slow)."""

    def __init__(self) -> None:
        self.now = self.peak = 0
        self.lock = threading.Lock()

    def _enter(self) -> None:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        time.sleep(0.02)

    def _leave(self) -> None:
        with self.lock:
            self.now -= 1

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        self._enter()
        try:
            return super().pwritev(fd, buffers, offset)
        finally:
            self._leave()

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        self._enter()
        try:
            return super().preadv(fd, buffers, offset)
        finally:
            self._leave()


@pytest.mark.parametrize("threads", [1, 3])
def test_io_in_flight_is_bounded_by_io_threads(tmp_path: Path, threads: int) -> None:
    fs = _Concurrency()
    tier = DiskTier(tmp_path / "d", 1 << 30, NS, io_threads=threads, fs=fs)
    try:
        ws = _chain(_payloads([50_000] * 12, 5, aligned=False), 5)
        assert all(tier.put_many(ws))
        assert fs.peak == threads  # never more; and with 12 slow writes, the pool is used
        fs.peak = 0
        outs = [np.zeros(50_000, np.uint8) for _ in ws]
        assert all(tier.get_many_into([(w.key, o) for w, o in zip(ws, outs)]))
        assert fs.peak == threads
    finally:
        tier.close()


def test_io_pool_keeps_order_and_rejects_bad_sizes() -> None:
    pool = IOPool(3)
    try:
        assert list(pool.ordered(lambda x: x * 2, list(range(20)))) == [x * 2 for x in range(20)]
    finally:
        pool.close()
    assert list(pool.ordered(lambda x: x + 1, [1, 2])) == [2, 3]  # closed: runs inline
    with pytest.raises(ValueError):
        IOPool(0)
    with pytest.raises(ValueError):
        DiskTier("/nonexistent-never-created", 1, NS, io_threads=0)
