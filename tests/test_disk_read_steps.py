"""The disk tier verifies every read in steps: a fault in any step, not only the first, is a miss.

Buffered reads take ``READ_STEP_BYTES`` per ``preadv`` (by default the whole chunk: these tests
shrink it to 256 KiB so records span several steps) and hash each step as it lands
(O_DIRECT: ``DIRECT_READ_STEP_BYTES``); these records span several steps, and one
payload byte flipped in the first, a middle or the last step, or a record cut short
inside a later step, must make that chunk a miss, counted as corrupt and deleted,
while the other chunks of the batch are served byte for byte. Short reads (fewer
bytes than asked, before the end of the file) are resumed, not misses.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

from kvtier.serde.record import HEADER_BYTES
from kvtier.tiers.base import ChunkWrite
from kvtier.tiers.disk import DiskTier, FileOps, record_io

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fault_helpers.direct_io import o_direct_works  # noqa: E402

NS = bytes(range(1, 33))


@pytest.fixture(autouse=True)
def _small_read_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(record_io, "READ_STEP_BYTES", 256 * 1024)


def _step(direct: bool) -> int:
    return record_io.DIRECT_READ_STEP_BYTES if direct else record_io.READ_STEP_BYTES


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.slow
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("where", ["first", "middle", "last", "truncated"])
def test_a_fault_in_any_read_step_is_a_miss_and_removed(tmp_path: Path, direct: bool, where: str) -> None:
    if direct and not o_direct_works(tmp_path):
        pytest.skip("file system refuses O_DIRECT")
    step = _step(direct)
    n = 3 * step + 12_345  # four steps, the last one partial
    tier = DiskTier(tmp_path / "d", 1 << 30, NS, direct_io=direct, io_threads=4)
    try:
        rng = np.random.default_rng(5)
        payloads = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(3)]
        ws = [ChunkWrite(bytes([7, i]) * 16, None, p) for i, p in enumerate(payloads)]
        assert tier.put_many(ws) == [True] * 3
        bad = tier.file_of(ws[1].key)
        if where == "truncated":  # cut inside the third step (the size check happens before any step)
            os.truncate(bad, HEADER_BYTES + 2 * step + 100)
        else:
            _flip(bad, HEADER_BYTES + {"first": 10, "middle": 2 * step + 7, "last": n - 1}[where])
        outs = [np.zeros(n, np.uint8) for _ in payloads]
        assert tier.get_many_into([(w.key, o) for w, o in zip(ws, outs)]) == [True, False, True]
        assert np.array_equal(outs[0], payloads[0]) and np.array_equal(outs[2], payloads[2])
        assert tier.corrupt_reads == 1 and not bad.exists() and not tier.contains(ws[1].key)
        assert tier.stats()["get_corrupt"] == 1
        tier.check_invariants()
    finally:
        tier.close()


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_records_of_many_steps_round_trip_into_unaligned_buffers(tmp_path: Path, direct: bool) -> None:
    if direct and not o_direct_works(tmp_path):
        pytest.skip("file system refuses O_DIRECT")
    step = _step(direct)
    sizes = [step - 1, step, step + 1, 2 * step + 4096, 3 * step + 17]
    tier = DiskTier(tmp_path / "d", 1 << 30, NS, direct_io=direct, io_threads=4)
    try:
        rng = np.random.default_rng(6)
        payloads = [rng.integers(0, 256, m, dtype=np.uint8) for m in sizes]
        ws = [ChunkWrite(bytes([8, i]) * 16, None, p) for i, p in enumerate(payloads)]
        assert tier.put_many(ws) == [True] * len(ws)
        raw = [np.zeros(m + 1, np.uint8) for m in sizes]  # views starting at an odd address
        outs = [r[1:] for r in raw]
        assert tier.get_many_into([(w.key, o) for w, o in zip(ws, outs)]) == [True] * len(ws)
        for o, p in zip(outs, payloads):
            assert np.array_equal(o, p)
        assert tier.corrupt_reads == 0
    finally:
        tier.close()


class _ShortReads(FileOps):
    """Every ``preadv`` returns at most ``limit`` bytes (as a signal or a slow device may cause)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.calls = 0

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        self.calls += 1
        left, cut = self.limit, []
        for b in buffers:
            if left <= 0:
                break
            cut.append(b[:left])
            left -= len(cut[-1])
        return os.preadv(fd, cut, offset)


def test_short_buffered_reads_are_resumed_not_misses(tmp_path: Path) -> None:
    step = record_io.READ_STEP_BYTES
    fs = _ShortReads(step // 3 + 1)
    tier = DiskTier(tmp_path / "d", 1 << 30, NS, fs=fs, io_threads=2)
    try:
        rng = np.random.default_rng(7)
        payloads = [rng.integers(0, 256, m, dtype=np.uint8) for m in (3 * step + 5, 100, step)]
        ws = [ChunkWrite(bytes([6, i]) * 16, None, p) for i, p in enumerate(payloads)]
        assert tier.put_many(ws) == [True] * 3
        outs = [np.zeros(len(p), np.uint8) for p in payloads]
        assert tier.get_many_into([(w.key, o) for w, o in zip(ws, outs)]) == [True] * 3
        for o, p in zip(outs, payloads):
            assert np.array_equal(o, p)
        assert fs.calls > 3 * 4 and tier.corrupt_reads == 0 and len(tier) == 3
    finally:
        tier.close()


def test_by_default_a_chunk_is_one_preadv_of_header_and_payload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()  # the module's own step, not this file's small one
    fs = _ShortReads(1 << 62)  # counts calls, never cuts one short
    tier = DiskTier(tmp_path / "d", 1 << 30, NS, fs=fs, io_threads=1)
    try:
        rng = np.random.default_rng(8)
        payloads = [rng.integers(0, 256, m, dtype=np.uint8) for m in (5_898_240, 1_000_001)]
        ws = [ChunkWrite(bytes([9, i]) * 16, None, p) for i, p in enumerate(payloads)]
        assert tier.put_many(ws) == [True, True]
        outs = [np.zeros(len(p), np.uint8) for p in payloads]
        fs.calls = 0
        assert tier.get_many_into([(w.key, o) for w, o in zip(ws, outs)]) == [True, True]
        assert fs.calls == 2 and all(np.array_equal(o, p) for o, p in zip(outs, payloads))
        bad = tier.file_of(ws[0].key)
        _flip(bad, HEADER_BYTES + len(payloads[0]) - 1)  # the checksum still covers the last byte
        assert tier.get_many_into([(ws[0].key, outs[0])]) == [False]
        assert tier.corrupt_reads == 1 and not bad.exists()
    finally:
        tier.close()
