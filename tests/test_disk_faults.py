"""Disk tier under faults: SIGKILL at random moments, corruption, ENOSPC/EROFS/EIO, ownership, direct I/O.

Trial counts (each a separate test item unless noted):
- SIGKILL of a writing child at a random moment (0.02..0.8 s after it opened the tier):
  ``DISK_FAULT_TRIALS`` (default 20) trials; variants by trial number: direct I/O, fsync,
  a small capacity (evicting while killed), small slow write calls (kills inside a payload).
- clean stop of a writing child: 2 (buffered, direct).
- single-bit flips anywhere in header or payload: 200 per I/O mode (loop inside one test).
- truncation to a random length: 50 per I/O mode (loop inside one test).
- ENOSPC/EROFS/EDQUOT/EIO on each write step, EIO on read: one item per (errno, step).
- ownership across processes, then SIGKILL of the owner: 1.
- 100,000-file index load: 1 (prints the load time).
"""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from conftest import payload_for, small_namespace
from fault_helpers.direct_io import aligned, o_direct_works
from fault_helpers.faultfs import FaultyFileOps
from fault_helpers.payloads import CRASH_NS, key_for, payload_for_key, size_for

from kvtier.serde.record import FIXED, decode_header
from kvtier.tiers.base import ChunkWrite
from kvtier.tiers.disk import (
    ALIGN,
    HEADER_BYTES,
    MAX_READ_ERRORS,
    SUFFIX,
    DiskTier,
    DiskTierLocked,
    encode_payload_header,
    record_relpath,
)

REPO = Path(__file__).resolve().parents[1]
WRITER = Path(__file__).resolve().parent / "fault_helpers" / "crash_writer.py"
TRIALS = int(os.environ.get("DISK_FAULT_TRIALS", "20"))
NS = small_namespace().digest()
CB = 2048
FILE = HEADER_BYTES + CB
LOGGER = "kvtier.tiers.disk"


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _file_of(root: Path, key: bytes) -> Path:
    return root / record_relpath(key)


def _kv_files(root: Path) -> list[Path]:
    return sorted(root.glob(f"??/*{SUFFIX}"))


def _tmp_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.tmp"))


def _read(tier: DiskTier, key: bytes, n: int = CB) -> np.ndarray | None:
    out = np.zeros(n, dtype=np.uint8)
    return out if tier.get_into(key, out) else None


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = str(REPO)
    return env


@pytest.fixture
def direct_dir(tmp_path: Path) -> Iterator[Path]:
    """An empty directory on a file system that accepts O_DIRECT (tmp, else /var/tmp, else /work)."""
    if o_direct_works(tmp_path):
        d = tmp_path / "direct"
        d.mkdir()
        yield d
        return
    for base in (Path("/var/tmp"), Path("/work")):
        if base.is_dir() and o_direct_works(base):
            d = Path(tempfile.mkdtemp(prefix="kvtier-direct-", dir=base))
            try:
                yield d
            finally:
                shutil.rmtree(d, ignore_errors=True)
            return
    pytest.skip("no directory here accepts O_DIRECT (tried pytest tmp, /var/tmp, /work)")


def _direct_supported(tmp_path: Path) -> bool:
    return o_direct_works(tmp_path)


# -- SIGKILL at random moments --------------------------------------------------------------


def _spawn_writer(d: Path, log: Path, seed: int, capacity: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WRITER), str(d), str(log), str(seed), str(capacity), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_child_env(),
        text=True,
    )


def _completed_keys(log: Path) -> set[bytes]:
    if not log.exists():
        return set()
    out = set()
    for line in log.read_text().splitlines():
        if len(line) == 64:
            out.add(bytes.fromhex(line))
    return out


def _check_reopened(tier: DiskTier, d: Path, completed: set[bytes]) -> int:
    """Every chunk the tier reports reads back exactly; every completed chunk is there."""
    assert not _tmp_files(d), "leftover .tmp files after open"
    files = _kv_files(d)
    assert len(tier) == len(files)
    assert tier.used_bytes == sum(p.stat().st_size for p in files) <= tier.capacity_bytes
    for p in files:
        key = bytes.fromhex(p.name[:64])
        assert tier.contains(key)
        got = _read(tier, key, size_for(key))
        assert got is not None, f"chunk {p.name} is indexed but does not read back"
        assert np.array_equal(got, payload_for_key(key)), f"chunk {p.name} read back wrong bytes"
    missing = [k.hex()[:16] for k in completed if not tier.contains(k)]
    assert not missing, f"chunks reported complete before the kill are gone: {missing[:5]}"
    assert tier.corrupt_reads == 0 and tier.read_errors == 0
    return len(files)


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(TRIALS))
def test_sigkill_at_a_random_moment_keeps_every_complete_chunk(trial: int, tmp_path: Path) -> None:
    rng = random.Random(7919 * trial + 1)
    evicting = trial % 4 == 3  # a small capacity: the writer evicts while it is killed
    direct = trial % 4 == 2 and _direct_supported(tmp_path)
    fsync = trial % 5 == 1
    piecewise = trial % 2 == 0  # small, slow write calls: kills land inside a file's payload
    capacity = (4 << 20) if evicting else (1 << 30)
    d, log = tmp_path / "disk", tmp_path / "completed.log"
    flags = [f for f, on in (("--fsync", fsync), ("--direct", direct)) if on]
    flags += ["--piece", "16384", "--piece-delay", "0.0005"] if piecewise else []
    child = _spawn_writer(d, log, trial, capacity, *flags)
    try:
        assert child.stdout is not None
        ready = child.stdout.readline().split()
        assert ready[:1] == ["ready"], child.stderr.read() if child.stderr else ""
        delay = rng.uniform(0.02, 0.8)
        time.sleep(delay)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    leftovers = len(_tmp_files(d))
    completed = _completed_keys(log)
    tier = DiskTier(d, capacity, CRASH_NS, direct_io=direct)  # the lock died with the child
    try:
        n = _check_reopened(tier, d, set() if evicting else completed)
    finally:
        tier.close()
    print(
        f"trial {trial}: killed after {delay:.2f} s "
        f"(direct={direct} fsync={fsync} evicting={evicting} piecewise={piecewise}); "
        f"{len(completed)} chunks reported complete, {n} on disk, {leftovers} .tmp leftovers removed"
    )


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_clean_stop_keeps_every_chunk(direct: bool, tmp_path: Path) -> None:
    if direct and not _direct_supported(tmp_path):
        pytest.skip("tmp file system refuses O_DIRECT")
    d, log = tmp_path / "disk", tmp_path / "completed.log"
    child = _spawn_writer(d, log, 4242, 1 << 30, "--count", "60", "--clean", *(["--direct"] if direct else []))
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert out.split()[-1] == "closed"
    completed = _completed_keys(log)
    assert len(completed) == 60
    tier = DiskTier(d, 1 << 30, CRASH_NS, direct_io=direct)
    try:
        assert _check_reopened(tier, d, completed) == 60
    finally:
        tier.close()


# -- one owner per directory, across processes ----------------------------------------------

_TRY_OPEN = textwrap.dedent(
    """
    import sys
    from kvtier.tiers.disk import DiskTier, DiskTierLocked
    try:
        t = DiskTier(sys.argv[1], 1 << 30, bytes.fromhex(sys.argv[2]))
    except DiskTierLocked as exc:
        print("locked", exc)
        sys.exit(3)
    print("owner", len(t))
    t.close()
    """
)


def _try_open(d: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _TRY_OPEN, str(d), CRASH_NS.hex()],
        capture_output=True,
        text=True,
        env=_child_env(),
        timeout=120,
    )


@pytest.mark.slow
def test_second_process_is_refused_then_takes_over_after_sigkill(tmp_path: Path) -> None:
    d, log = tmp_path / "disk", tmp_path / "completed.log"
    owner = _spawn_writer(d, log, 99, 1 << 30)
    try:
        assert owner.stdout is not None and owner.stdout.readline().startswith("ready")
        # a planted leftover: a refused process must not touch the owner's directory
        sentinel = d / "00" / ".sentinel.kv.1.2.tmp"
        sentinel.parent.mkdir(exist_ok=True)
        sentinel.write_bytes(b"in flight")
        refused = _try_open(d)
        assert refused.returncode == 3, refused.stderr
        assert f"pid {owner.pid}" in refused.stdout
        assert sentinel.exists()
        assert (d / ".lock").read_text().strip() == str(owner.pid)
        with pytest.raises(DiskTierLocked, match=f"pid {owner.pid}"):
            DiskTier(d, 1 << 30, CRASH_NS)
        time.sleep(0.2)  # let it write a little more
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=60)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    taker = _try_open(d)  # the kernel dropped the dead owner's flock
    assert taker.returncode == 0, taker.stdout + taker.stderr
    assert taker.stdout.split()[:1] == ["owner"]
    assert int(taker.stdout.split()[1]) == len(_kv_files(d))
    assert not sentinel.exists()  # the new owner cleaned the leftover
    tier = DiskTier(d, 1 << 30, CRASH_NS)
    try:
        _check_reopened(tier, d, _completed_keys(log))
    finally:
        tier.close()


# -- corruption is a miss with a log line, never KV -------------------------------------------


def _flip_offsets(rng: random.Random, file_size: int, n: int) -> list[int]:
    """``n`` offsets spread over header fields, header padding and payload."""
    used = FIXED.size + 32 + 8  # fixed fields, key (no parent), header checksum
    out = []
    for i in range(n):
        region = i % 3
        if region == 0:
            out.append(rng.randrange(0, used))
        elif region == 1:
            out.append(rng.randrange(used, HEADER_BYTES))
        else:
            out.append(rng.randrange(HEADER_BYTES, file_size))
    return out


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_random_bit_flips_are_misses_with_a_log_line(
    direct: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if direct and not _direct_supported(tmp_path):
        pytest.skip("tmp file system refuses O_DIRECT")
    d = tmp_path / "disk"
    k = _key(1)
    n = 5000  # not a multiple of ALIGN: direct mode pads
    t = DiskTier(d, 1 << 24, NS, direct_io=direct)
    assert t.put(k, payload_for(k, n))
    t.close()
    path = _file_of(d, k)
    pristine = path.read_bytes()
    rng = random.Random(5)
    offsets = _flip_offsets(rng, HEADER_BYTES + n, 200)  # direct-I/O padding excluded
    used = FIXED.size + 32 + 8
    caplog.set_level(logging.WARNING, logger=LOGGER)
    for off in offsets:
        data = bytearray(pristine)
        data[off] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        caplog.clear()
        t = DiskTier(d, 1 << 24, NS, direct_io=direct)
        try:
            if not t.contains(k):  # the header check at open caught it
                assert off < used and not path.exists(), f"bit flip at offset {off} dropped at open"
                assert any("at open" in r.getMessage() for r in caplog.records), f"no log line (offset {off})"
                continue
            assert _read(t, k, n) is None, f"bit flip at offset {off} was served"
            assert t.corrupt_reads == 1 and not t.contains(k) and not path.exists()
            assert any("is a miss" in r.getMessage() for r in caplog.records), f"no log line (offset {off})"
        finally:
            t.close()
        path.parent.mkdir(exist_ok=True)
    path.write_bytes(pristine)  # the untouched file still serves: the test can tell good from bad
    t = DiskTier(d, 1 << 24, NS, direct_io=direct)
    try:
        got = _read(t, k, n)
        assert got is not None and np.array_equal(got, payload_for(k, n))
    finally:
        t.close()


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_truncation_to_any_length_is_a_miss(direct: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if direct and not _direct_supported(tmp_path):
        pytest.skip("tmp file system refuses O_DIRECT")
    d = tmp_path / "disk"
    k = _key(2)
    n = 3 * ALIGN + 17
    t = DiskTier(d, 1 << 24, NS, direct_io=direct)
    assert t.put(k, payload_for(k, n))
    t.close()
    path = _file_of(d, k)
    pristine = path.read_bytes()
    rng = random.Random(11)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    for _ in range(50):
        length = rng.randrange(0, len(pristine))
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(pristine[:length])
        caplog.clear()
        t = DiskTier(d, 1 << 24, NS, direct_io=direct)
        try:
            if length <= HEADER_BYTES or not t.contains(k):
                assert not t.contains(k) and not path.exists()  # dropped at open (size check)
                assert length <= HEADER_BYTES or any("at open" in r.getMessage() for r in caplog.records)
                continue
            assert _read(t, k, n) is None, f"file truncated to {length} bytes was served"
            assert not path.exists() and t.corrupt_reads == 1
            assert any("is a miss" in r.getMessage() for r in caplog.records)
        finally:
            t.close()


def test_zero_filled_file_is_a_miss(disk_dir: Path) -> None:
    """What delayed allocation can leave after a power loss without fsync: the right size, all zeros."""
    k = _key(3)
    t = DiskTier(disk_dir, 1 << 24, NS)
    assert t.put(k, payload_for(k, CB))
    _file_of(disk_dir, k).write_bytes(bytes(FILE))
    assert _read(t, k) is None and t.corrupt_reads == 1
    t.close()


def test_wrong_buffer_size_is_a_miss_that_keeps_the_file(disk_dir: Path) -> None:
    k = _key(4)
    t = DiskTier(disk_dir, 1 << 24, NS)
    try:
        assert t.put(k, payload_for(k, CB))
        assert _read(t, k, CB + 1) is None
        assert t.contains(k) and _file_of(disk_dir, k).exists() and t.corrupt_reads == 0
        assert _read(t, k) is not None
        with pytest.raises(ValueError):
            t.get_into(k, np.zeros(CB, dtype=np.uint8)[::2])
    finally:
        t.close()


# -- ENOSPC / EROFS / EIO through the FileOps seam ---------------------------------------------


def _stop_lines(caplog: pytest.LogCaptureFixture) -> int:
    return sum("stops accepting writes" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "err,op",
    [
        (errno.ENOSPC, "write"),
        (errno.ENOSPC, "open_write"),
        (errno.ENOSPC, "mkdir"),
        (errno.EDQUOT, "write"),
        (errno.EROFS, "open_write"),
        (errno.EROFS, "replace"),
        (errno.EACCES, "open_write"),
    ],
)
def test_disk_full_or_read_only_stops_writes_logs_once_and_serves_reads(
    err: int, op: str, disk_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fs = FaultyFileOps()
    t = DiskTier(disk_dir, 1 << 24, NS, fs=fs)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    try:
        old = _key(1)
        assert t.put(old, payload_for(old, CB))
        fs.fail(op, err)
        new = [_key(i) for i in range(0x10, 0x20)]  # keys in new subdirs, so mkdir is reached
        # a batch first: the whole batch fails, one log line in all
        assert t.put_many([ChunkWrite(k, None, payload_for(k, CB)) for k in new[:8]]) == [False] * 8
        assert t.put(new[8], payload_for(new[8], CB)) is False
        assert t.writable is False
        assert _stop_lines(caplog) == 1
        assert t.failed_writes >= 1 and len(t) == 1 and t.used_bytes == FILE
        assert not _tmp_files(disk_dir) and not any(t.contains(k) for k in new)
        got = _read(t, old)
        assert got is not None and np.array_equal(got, payload_for(old, CB))
        fs.heal()
        assert t.put(new[9], payload_for(new[9], CB)) is False  # stays read-only, no retry storm
        assert _stop_lines(caplog) == 1
    finally:
        t.close()


def test_enospc_in_the_middle_of_a_file_leaves_nothing_behind(disk_dir: Path) -> None:
    fs = FaultyFileOps()
    t = DiskTier(disk_dir, 1 << 24, NS, fs=fs)
    try:
        a, b = _key(1), _key(2)
        assert t.put(a, payload_for(a, CB))
        fs.write_budget = HEADER_BYTES + 1000  # the disk fills up inside b's payload
        assert t.put(b, payload_for(b, CB)) is False
        assert not t.writable and not t.contains(b)
        assert not _file_of(disk_dir, b).exists() and not _tmp_files(disk_dir)
        assert t.used_bytes == FILE and t.failed_writes == 1
        assert _read(t, a) is not None
    finally:
        t.close()
    t = DiskTier(disk_dir, 1 << 24, NS)  # a restart finds only the complete chunk
    try:
        assert len(t) == 1 and t.contains(a) and t.writable
    finally:
        t.close()


@pytest.mark.parametrize("op", ["write", "open_write", "fsync", "replace"])
def test_eio_on_write_fails_that_write_only(op: str, disk_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    fs = FaultyFileOps()
    t = DiskTier(disk_dir, 1 << 24, NS, fs=fs, fsync=True)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    try:
        k = _key(1)
        fs.fail(op, errno.EIO, times=1)
        assert t.put(k, payload_for(k, CB)) is False
        assert fs.calls[op] >= 1
        assert t.writable and t.failed_writes == 1 and t.used_bytes == 0 and not t.contains(k)
        assert not _tmp_files(disk_dir) and not _kv_files(disk_dir)
        assert any("failed" in r.getMessage() for r in caplog.records)
        assert t.put(k, payload_for(k, CB)) is True
        got = _read(t, k)
        assert got is not None and np.array_equal(got, payload_for(k, CB))
    finally:
        t.close()


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("op", ["read", "open_read"])
def test_eio_on_read_is_a_miss_never_kv(op: str, direct: bool, tmp_path: Path) -> None:
    if direct and not _direct_supported(tmp_path):
        pytest.skip("tmp file system refuses O_DIRECT")
    fs = FaultyFileOps()
    d = tmp_path / "disk"
    t = DiskTier(d, 1 << 24, NS, fs=fs, direct_io=direct)
    try:
        k = _key(1)
        assert t.put(k, payload_for(k, CB))
        fs.fail(op, errno.EIO, times=1)
        assert _read(t, k) is None
        assert t.read_errors == 1 and t.contains(k)  # a transient error keeps the chunk
        got = _read(t, k)
        assert got is not None and np.array_equal(got, payload_for(k, CB))
        fs.fail(op, errno.EIO)  # a chunk that never reads is forgotten after a few tries
        for _ in range(MAX_READ_ERRORS):
            assert _read(t, k) is None
        assert not t.contains(k) and t.used_bytes == 0
    finally:
        t.close()


def test_read_only_directory_at_open_serves_reads(disk_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    k = _key(1)
    t = DiskTier(disk_dir, 1 << 24, NS)
    assert t.put(k, payload_for(k, CB))
    t.close()
    fs = FaultyFileOps()
    for op in ("open_lock", "open_write", "mkdir", "unlink", "replace"):
        fs.fail(op, errno.EROFS)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    t = DiskTier(disk_dir, 1 << 24, NS, fs=fs)
    try:
        assert t.writable is False and _stop_lines(caplog) == 1
        got = _read(t, k)
        assert got is not None and np.array_equal(got, payload_for(k, CB))
        assert t.put(_key(2), payload_for(_key(2), CB)) is False
        assert _stop_lines(caplog) == 1
    finally:
        t.close()


def test_real_read_only_directory(disk_dir: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip(
            "running as root: chmod cannot stop root from writing; the read-only case is "
            "covered through the FileOps seam (test_read_only_directory_at_open_serves_reads)"
        )
    k = _key(1)
    t = DiskTier(disk_dir, 1 << 24, NS)
    assert t.put(k, payload_for(k, CB))
    t.close()
    dirs = [disk_dir, *[p for p in disk_dir.iterdir() if p.is_dir()]]
    for p in dirs:
        p.chmod(0o555)
    try:
        t = DiskTier(disk_dir, 1 << 24, NS)
        try:
            assert _read(t, k) is not None
            assert t.put(_key(2), payload_for(_key(2), CB)) is False
            assert t.writable is False
            assert _read(t, k) is not None
        finally:
            t.close()
    finally:
        for p in dirs:
            p.chmod(0o755)


def test_storage_manager_is_unaffected_by_a_full_disk(make_config) -> None:  # type: ignore[no-untyped-def]
    from kvtier.storage.manager import StorageManager

    ns = small_namespace()
    mgr = StorageManager(make_config(cpu_chunks=4, disk_chunks=64), ns)
    try:
        fs = FaultyFileOps()
        assert mgr.disk is not None
        mgr.disk.fs = fs
        fs.fail("write", errno.ENOSPC)
        tokens = list(range(ns.chunk_size * 6 + 1))
        keys = mgr.keys(tokens)
        for k in keys:
            buf = mgr.open_write(k, None)
            assert buf is not None
            buf[:] = payload_for(k, ns.chunk_bytes)
            mgr.commit(k, None)  # must not raise although the disk is full
            assert mgr.flush(30)  # the write-behind released its CPU reference
        stats = mgr.stats()
        assert stats["disk_writable"] == 0 and stats["disk_chunks"] == 0
        res = mgr.lookup(tokens)
        assert res.num_tokens >= 0  # lookups still answer: the CPU tier serves what it holds
        for k in keys[-4:]:
            h = mgr.open_read(k)
            assert h is not None and np.array_equal(h.buffer, payload_for(k, ns.chunk_bytes))
            h.close()
    finally:
        mgr.close()


# -- byte bound at open ----------------------------------------------------------------------------


def test_over_full_directory_is_trimmed_at_open(disk_dir: Path) -> None:
    t = DiskTier(disk_dir, 1 << 24, NS)
    keys = [_key(i) for i in range(10)]
    for i, k in enumerate(keys):
        assert t.put(k, payload_for(k, CB))
    t.close()
    now = time.time()
    for i, k in enumerate(keys):
        os.utime(_file_of(disk_dir, k), (now - 100 + i, now - 100 + i))
    t = DiskTier(disk_dir, 4 * FILE, NS)  # a smaller capacity than last run
    try:
        assert len(t) == 4 and t.used_bytes == 4 * FILE and len(_kv_files(disk_dir)) == 4
        assert all(t.contains(k) for k in keys[6:])  # the newest survive
    finally:
        t.close()


def test_concurrent_puts_of_one_key_count_its_bytes_once(disk_dir: Path) -> None:
    t = DiskTier(disk_dir, 1 << 26, NS)
    try:
        keys = [_key(i) for i in range(200)]
        barrier = threading.Barrier(2)

        def run() -> None:
            barrier.wait()
            for k in keys:
                t.put(k, payload_for(k, CB))

        threads = [threading.Thread(target=run) for _ in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        files = _kv_files(disk_dir)
        assert len(files) == len(t) == 200
        assert t.used_bytes == sum(p.stat().st_size for p in files) == 200 * FILE
    finally:
        t.close()


# -- direct I/O ------------------------------------------------------------------------------------

SIZES = [1, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN, (3 << 20) + 123]


@pytest.mark.parametrize("src_offset", [0, 1], ids=["aligned-src", "unaligned-src"])
@pytest.mark.parametrize("dst_offset", [0, 3], ids=["aligned-dst", "unaligned-dst"])
def test_direct_io_round_trip(direct_dir: Path, src_offset: int, dst_offset: int) -> None:
    t = DiskTier(direct_dir, 1 << 26, NS, direct_io=True)
    try:
        assert t.direct_io, "direct_dir accepts O_DIRECT, so the tier must use it"
        for i, n in enumerate(SIZES):
            k = _key(100 + i)
            src = aligned(n, src_offset)
            src[:] = payload_for(k, n)
            assert t.put(k, src)
            path = _file_of(direct_dir, k)
            assert path.stat().st_size == HEADER_BYTES + -(-n // ALIGN) * ALIGN
            hdr = decode_header(path.read_bytes()[:HEADER_BYTES])
            assert hdr.payload_len == n and hdr.stored_len == -(-n // ALIGN) * ALIGN
            out = aligned(n, dst_offset)
            assert t.get_into(k, out)
            assert np.array_equal(out, payload_for(k, n)), f"size {n}"
        assert t.used_bytes == sum(p.stat().st_size for p in _kv_files(direct_dir))
    finally:
        t.close()


def test_direct_and_buffered_files_read_in_either_mode(direct_dir: Path) -> None:
    n = 2 * ALIGN + 77
    t = DiskTier(direct_dir, 1 << 26, NS, direct_io=False)
    kb = _key(1)
    assert t.put(kb, payload_for(kb, n))
    t.close()
    t = DiskTier(direct_dir, 1 << 26, NS, direct_io=True)
    kd = _key(2)
    try:
        assert t.direct_io
        assert t.put(kd, payload_for(kd, n))
        for k in (kb, kd):
            got = _read(t, k, n)
            assert got is not None and np.array_equal(got, payload_for(k, n))
    finally:
        t.close()
    t = DiskTier(direct_dir, 1 << 26, NS, direct_io=False)
    try:
        for k in (kb, kd):
            got = _read(t, k, n)
            assert got is not None and np.array_equal(got, payload_for(k, n))
    finally:
        t.close()


def test_direct_io_falls_back_when_the_file_system_refuses(disk_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    fs = FaultyFileOps()
    fs.direct_einval = True
    caplog.set_level(logging.WARNING, logger=LOGGER)
    t = DiskTier(disk_dir, 1 << 24, NS, direct_io=True, fs=fs)
    try:
        assert t.direct_io is False
        assert sum("O_DIRECT" in r.getMessage() for r in caplog.records) == 1
        k = _key(1)
        assert t.put(k, payload_for(k, CB))
        assert _file_of(disk_dir, k).stat().st_size == FILE  # buffered: no padding
        got = _read(t, k)
        assert got is not None and np.array_equal(got, payload_for(k, CB))
    finally:
        t.close()


def test_direct_io_refused_later_falls_back_on_write_and_read(
    direct_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fs = FaultyFileOps()
    t = DiskTier(direct_dir, 1 << 24, NS, direct_io=True, fs=fs)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    try:
        assert t.direct_io
        a, b = _key(1), _key(2)
        assert t.put(a, payload_for(a, CB))
        fs.direct_einval = True
        got = _read(t, a)  # read falls back to buffered
        assert got is not None and np.array_equal(got, payload_for(a, CB))
        assert t.direct_io is False
        assert t.put(b, payload_for(b, CB))
        assert _file_of(direct_dir, b).stat().st_size == FILE
        assert sum("O_DIRECT" in r.getMessage() for r in caplog.records) == 1
        assert t.used_bytes == sum(p.stat().st_size for p in _kv_files(direct_dir))
    finally:
        t.close()


def test_direct_io_write_refused_mid_run_falls_back(direct_dir: Path) -> None:
    fs = FaultyFileOps()
    t = DiskTier(direct_dir, 1 << 24, NS, direct_io=True, fs=fs)
    try:
        fs.direct_einval = True
        k = _key(1)
        assert t.put(k, payload_for(k, CB))  # reserved the padded size, wrote unpadded
        assert not t.direct_io and t.failed_writes == 0
        assert t.used_bytes == FILE == _file_of(direct_dir, k).stat().st_size
        assert not _tmp_files(direct_dir)
    finally:
        t.close()


# -- index load at scale ------------------------------------------------------------------------------


@pytest.mark.slow  # over 5 s on 2 cores: out of the fast loop
def test_index_load_of_100k_chunk_files(tmp_path: Path) -> None:
    d = tmp_path / "big"
    d.mkdir()
    n_files, n_bytes = 100_000, 16
    made: set[str] = set()
    sample: list[bytes] = []
    t0 = time.perf_counter()
    for i in range(n_files):
        key = key_for(1, i)
        h = key.hex()
        if h[:2] not in made:
            (d / h[:2]).mkdir()
            made.add(h[:2])
        payload = payload_for(key, n_bytes)
        fd = os.open(d / h[:2] / (h + SUFFIX), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, encode_payload_header(key, NS, payload) + payload.tobytes())
        finally:
            os.close(fd)
        if i % 2000 == 0:
            sample.append(key)
    build_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        t = DiskTier(d, 1 << 40, NS)
        open_s = time.perf_counter() - t0
        try:
            assert len(t) == n_files
            assert t.used_bytes == n_files * (HEADER_BYTES + n_bytes)
            for key in sample:
                got = _read(t, key, n_bytes)
                assert got is not None and np.array_equal(got, payload_for(key, n_bytes))
        finally:
            t.close()
        print(
            f"\nindex load of {n_files:,} chunk files in {len(made)} subdirs: "
            f"{t.index_load_s:.3f} s (whole open {open_s:.3f} s; building the files took {build_s:.1f} s)"
        )
    finally:
        shutil.rmtree(d, ignore_errors=True)
