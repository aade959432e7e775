"""ChunkPool: fixed slots, free list, disjoint writable views."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.memory.pool import ChunkPool, PoolExhausted


def test_alloc_every_slot_then_exhausted() -> None:
    pool = ChunkPool(slot_bytes=64, num_slots=4)
    assert pool.capacity_bytes == 256 and pool.num_free == 4
    slots = [pool.alloc() for _ in range(4)]
    assert sorted(slots) == [0, 1, 2, 3]
    assert pool.num_free == 0
    with pytest.raises(PoolExhausted):
        pool.alloc()


def test_free_makes_a_slot_reusable() -> None:
    pool = ChunkPool(64, 2)
    a, b = pool.alloc(), pool.alloc()
    pool.free(a)
    assert pool.num_free == 1
    assert pool.alloc() == a
    pool.free(a)
    pool.free(b)
    assert pool.num_free == 2


def test_double_free_and_bad_slot_raise() -> None:
    pool = ChunkPool(64, 2)
    s = pool.alloc()
    pool.free(s)
    with pytest.raises(ValueError, match="twice"):
        pool.free(s)
    never = 1 - s
    with pytest.raises(ValueError):
        pool.free(never)  # never allocated
    for bad in (-1, 2, 100):
        with pytest.raises(ValueError, match="range"):
            pool.free(bad)
    assert pool.num_free == 2  # failed frees changed nothing


def test_views_are_disjoint_and_writable() -> None:
    pool = ChunkPool(128, 4)
    slots = [pool.alloc() for _ in range(4)]
    views = [pool.view(s) for s in slots]
    for v in views:
        assert v.dtype == np.uint8 and v.shape == (128,) and v.flags.writeable
    for i, v in enumerate(views):
        v[:] = i + 10
    for i, s in enumerate(slots):
        assert (pool.view(s) == i + 10).all()  # the view is the slot, not a copy
    addrs = sorted(v.__array_interface__["data"][0] for v in views)
    assert all(b - a >= 128 for a, b in zip(addrs, addrs[1:]))


@pytest.mark.parametrize(("slot_bytes", "num_slots"), [(0, 1), (1, 0), (-8, 2)])
def test_bad_sizes_raise(slot_bytes: int, num_slots: int) -> None:
    with pytest.raises(ValueError):
        ChunkPool(slot_bytes, num_slots)
