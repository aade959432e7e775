"""Shared segments are sealed against resizing, and attaching refuses one that can shrink."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from kvtier.memory.shared_segment import SharedSegment, shared_chunk_pool
from kvtier.memory.numa_topology import Placement

SIZE = 4 * 4096


def _seals(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS)


@pytest.mark.parametrize("sparse", [False, True])
def test_created_segment_cannot_change_size(sparse: bool) -> None:
    seg = SharedSegment.create(SIZE, sparse=sparse)
    try:
        assert seg.fd is not None
        want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        assert _seals(seg.fd) & want == want
        for n in (0, SIZE // 2, SIZE * 2):
            with pytest.raises(PermissionError):
                os.ftruncate(seg.fd, n)
        with pytest.raises(PermissionError):
            fcntl.fcntl(seg.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # F_SEAL_SEAL: no more seals
        assert os.fstat(seg.fd).st_size == SIZE
        seg.array[:] = 7
        seg.release(0, SIZE)  # hole punching keeps the size: still allowed
        assert int(seg.array.sum()) == 0
    finally:
        seg.close()


def test_cpu_tier_pool_segment_is_sealed() -> None:
    pool, seg = shared_chunk_pool(4096, SIZE)
    try:
        assert seg.fd is not None and _seals(seg.fd) & fcntl.F_SEAL_SHRINK
    finally:
        seg.close()


def test_numa_placed_segment_is_sealed() -> None:
    try:
        seg = SharedSegment.create(SIZE, numa=Placement("preferred", (0,), "test"))
    except OSError:
        pytest.skip("no NUMA placement here")
    try:
        assert seg.fd is not None and _seals(seg.fd) & fcntl.F_SEAL_SHRINK
    finally:
        seg.close()


def test_attach_maps_a_sealed_segment_by_fd_and_by_path() -> None:
    seg = SharedSegment.create(SIZE)
    try:
        assert seg.fd is not None
        seg.array[:4] = [1, 2, 3, 4]
        other = SharedSegment.attach_fd(os.dup(seg.fd), SIZE)
        by_path = SharedSegment.attach_path(f"/proc/self/fd/{seg.fd}", SIZE)
        assert list(other.array[:4]) == [1, 2, 3, 4] == list(by_path.array[:4])
        other.close()
        by_path.close()
    finally:
        seg.close()


def test_attach_refuses_an_unsealed_memfd_and_closes_it() -> None:
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, SIZE)
    keep = os.dup(fd)
    try:
        with pytest.raises(ValueError, match="F_SEAL_SHRINK"):
            SharedSegment.attach_fd(fd, SIZE)
        with pytest.raises(OSError):
            os.fstat(fd)  # closed
    finally:
        os.close(keep)


def test_attach_refuses_a_file_that_cannot_carry_seals(tmp_path: Path) -> None:
    p = tmp_path / "seg"
    p.write_bytes(b"\0" * SIZE)
    with pytest.raises(ValueError, match="seal"):
        SharedSegment.attach_fd(os.open(p, os.O_RDWR), SIZE)


def test_attach_refuses_a_segment_smaller_than_announced() -> None:
    seg = SharedSegment.create(SIZE)
    try:
        assert seg.fd is not None
        with pytest.raises(ValueError, match="smaller"):
            SharedSegment.attach_fd(os.dup(seg.fd), SIZE + 1)
    finally:
        seg.close()
