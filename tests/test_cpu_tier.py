"""CpuTier: reserve/commit/acquire/release/abort, visibility, LRU eviction, pins, byte bound."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from conftest import payload_for
from kvtier.tiers.cpu import CpuTier

CB = 2048  # chunk bytes

KeyFn = Callable[[int], bytes]


def put(tier: CpuTier, key: bytes) -> bool:
    buf = tier.reserve(key)
    if buf is None:
        return False
    buf[:] = payload_for(key, CB)
    tier.commit(key)
    return True


def read(tier: CpuTier, key: bytes) -> np.ndarray | None:
    buf = tier.acquire(key)
    if buf is None:
        return None
    try:
        return buf.copy()
    finally:
        tier.release(key)


def test_round_trip(make_key: KeyFn) -> None:
    tier = CpuTier(CB, 4 * CB)
    k = make_key(1)
    assert not tier.contains(k) and tier.acquire(k) is None
    assert put(tier, k)
    assert tier.contains(k) and len(tier) == 1 and tier.used_bytes == CB
    got = read(tier, k)
    assert got is not None and np.array_equal(got, payload_for(k, CB))
    assert tier.referenced_chunks() == 0


def test_writing_entry_is_invisible_until_commit(make_key: KeyFn) -> None:
    tier = CpuTier(CB, 4 * CB)
    k = make_key(1)
    buf = tier.reserve(k)
    assert buf is not None and buf.shape == (CB,) and buf.dtype == np.uint8
    assert not tier.contains(k)
    assert tier.acquire(k) is None
    assert tier.reserve(k) is None  # a second writer is refused
    assert tier.delete(k) is False and tier.clear() == 0  # nobody removes a chunk being written
    assert tier.referenced_chunks() == 1  # the writer's reference
    buf[:] = 7
    tier.commit(k)
    assert tier.contains(k) and tier.referenced_chunks() == 0
    got = read(tier, k)
    assert got is not None and (got == 7).all()
    with pytest.raises(RuntimeError):
        tier.commit(k)  # committing twice is a bug


def test_abort_frees_the_slot(make_key: KeyFn) -> None:
    tier = CpuTier(CB, 1 * CB)
    k = make_key(1)
    assert tier.reserve(k) is not None
    tier.abort(k)
    assert not tier.contains(k) and len(tier) == 0 and tier.pool.num_free == 1
    tier.abort(k)  # no-op for unknown keys
    assert put(tier, make_key(2))
    tier.abort(make_key(2))  # no-op for committed keys
    assert tier.contains(make_key(2))


def test_reserve_existing_key_returns_none(make_key: KeyFn) -> None:
    tier = CpuTier(CB, 4 * CB)
    assert put(tier, make_key(1))
    assert tier.reserve(make_key(1)) is None
    assert len(tier) == 1


def test_release_without_acquire_raises(make_key: KeyFn) -> None:
    tier = CpuTier(CB, 4 * CB)
    put(tier, make_key(1))
    with pytest.raises(RuntimeError):
        tier.release(make_key(1))


def test_lru_eviction_order(make_key: KeyFn) -> None:
    tier = CpuTier(CB, 3 * CB)
    a, b, c, d, e = (make_key(i) for i in range(5))
    for k in (a, b, c):
        assert put(tier, k)
    read(tier, a)  # a is now most recent: order b, c, a
    assert put(tier, d)
    assert not tier.contains(b) and tier.contains(a) and tier.contains(c)
    tier.touch(c)  # order a, d, c
    assert put(tier, e)
    assert not tier.contains(a)
    assert {k for k in (a, b, c, d, e) if tier.contains(k)} == {c, d, e}
    assert tier.evicted_chunks == 2 and tier.evicted_bytes == 2 * CB


def test_eviction_skips_acquired_chunks(make_key: KeyFn) -> None:
    tier = CpuTier(CB, 2 * CB)
    a, b, c = make_key(0), make_key(1), make_key(2)
    put(tier, a)
    put(tier, b)
    held = tier.acquire(a)  # acquire touches a: order b, a
    assert held is not None
    tier.touch(b)  # order a, b: a is the LRU victim, but it is referenced
    assert put(tier, c)
    assert tier.contains(a) and not tier.contains(b)
    assert np.array_equal(held, payload_for(a, CB))  # the reader's bytes are intact
    tier.release(a)


def test_eviction_skips_pinned_chunks(make_key: KeyFn) -> None:
    pinned: set[bytes] = set()
    tier = CpuTier(CB, 3 * CB, is_pinned=pinned.__contains__)
    keys = [make_key(i) for i in range(3)]
    for k in keys:
        put(tier, k)
    pinned.update(keys[:2])  # the two oldest are leased
    for i in range(3, 10):
        assert put(tier, make_key(i))
        assert tier.contains(keys[0]) and tier.contains(keys[1])
    assert tier.evicted_chunks == 7


def test_everything_pinned_reserve_returns_none(make_key: KeyFn) -> None:
    pinned: set[bytes] = set()
    tier = CpuTier(CB, 2 * CB, is_pinned=pinned.__contains__)
    a, b = make_key(0), make_key(1)
    put(tier, a)
    put(tier, b)
    pinned.add(a)
    held = tier.acquire(b)
    assert tier.reserve(make_key(2)) is None  # a pinned, b referenced
    assert tier.contains(a) and tier.contains(b) and tier.evicted_chunks == 0
    tier.release(b)
    assert held is not None
    assert put(tier, make_key(2))  # now b can go
    assert not tier.contains(b)
    pinned.add(make_key(2))
    assert tier.reserve(make_key(3)) is None  # all pinned
    assert len(tier) == 2


def test_writing_entries_are_never_evicted(make_key: KeyFn) -> None:
    tier = CpuTier(CB, 2 * CB)
    a = make_key(0)
    buf = tier.reserve(a)
    assert buf is not None
    put(tier, make_key(1))
    assert put(tier, make_key(2))  # evicts 1, not the chunk being written
    assert tier.reserve(make_key(3)) is not None  # evicts 2
    assert len(tier) == 2 and tier.pool.num_free == 0
    assert tier.reserve(make_key(4)) is None  # both slots are being written
    tier.commit(a)
    assert tier.contains(a)


def test_bytes_never_exceed_capacity(make_key: KeyFn) -> None:
    import random

    rng = random.Random(3)
    pinned: set[bytes] = set()
    tier = CpuTier(CB, 5 * CB + CB // 2, is_pinned=pinned.__contains__)  # odd capacity -> 5 slots
    assert tier.capacity_bytes == 5 * CB
    held: list[bytes] = []
    for step in range(400):
        k = make_key(rng.randrange(30))
        op = rng.random()
        if op < 0.5:
            put(tier, k)
        elif op < 0.7 and tier.acquire(k) is not None:
            held.append(k)
        elif op < 0.85 and held:
            tier.release(held.pop(rng.randrange(len(held))))
        elif op < 0.95:
            pinned.symmetric_difference_update({k})
        assert tier.used_bytes <= tier.capacity_bytes
        assert len(tier) + tier.pool.num_free == tier.pool.num_slots
        for h in set(held):
            assert tier.contains(h)
    for h in held:
        tier.release(h)
    assert tier.referenced_chunks() == 0


def test_clear_removes_unreferenced_only(make_key: KeyFn) -> None:
    tier = CpuTier(CB, 4 * CB)
    a, b, c, w = (make_key(i) for i in range(4))
    for k in (a, b, c):
        put(tier, k)
    tier.acquire(b)
    assert tier.reserve(w) is not None
    assert tier.clear() == 2
    assert not tier.contains(a) and tier.contains(b) and not tier.contains(c)
    assert len(tier) == 2  # b and the writing w
    tier.release(b)
    tier.commit(w)
    assert tier.clear() == 2 and len(tier) == 0 and tier.pool.num_free == 4


def test_delete(make_key: KeyFn) -> None:
    tier = CpuTier(CB, 4 * CB)
    a = make_key(0)
    assert tier.delete(a) is False
    put(tier, a)
    tier.acquire(a)
    assert tier.delete(a) is False
    tier.release(a)
    assert tier.delete(a) is True
    assert not tier.contains(a) and tier.pool.num_free == 4


def test_capacity_below_one_chunk_raises() -> None:
    with pytest.raises(ValueError, match="below one chunk"):
        CpuTier(CB, CB - 1)


# -- why a reservation is refused (issue 8, failing input 5) ---------------------------------


def test_try_reserve_says_why(make_key: KeyFn) -> None:
    from kvtier.storage.types import WriteSkip

    tier = CpuTier(CB, 2 * CB, is_pinned=lambda k: True)  # nothing may be evicted
    a, b, c = make_key(1), make_key(2), make_key(3)
    buf = tier.try_reserve(a)
    assert isinstance(buf, np.ndarray)
    assert tier.try_reserve(a) is WriteSkip.IN_FLIGHT  # another writer's reservation
    buf[:] = payload_for(a, CB)
    tier.commit(a)
    assert tier.try_reserve(a) is WriteSkip.PRESENT
    assert put(tier, b)
    assert tier.try_reserve(c) is WriteSkip.NO_ROOM
    assert tier.reserve(c) is None
    tier.check_invariants()


# -- prefix closure (issue 8, failing input 4, CPU part) ---------------------------------------


def _chain(make_key: KeyFn, base: int, n: int) -> list[bytes]:
    return [make_key(base + i) for i in range(n)]


def _residents(tier: CpuTier) -> dict[bytes, bytes | None]:
    return {k: tier.policy.parent_of(k) for k in list(tier._entries) if tier.contains(k)}


def _assert_no_parent_dropped(before: dict[bytes, bytes | None], tier: CpuTier) -> None:
    """No chunk resident now had its parent resident before and dropped since."""
    after = _residents(tier)
    dropped = before.keys() - after.keys()
    for key, parent in after.items():
        assert parent not in dropped, "a resident chunk's parent was dropped (orphaned tail)"


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "s3fifo"])
@pytest.mark.parametrize("capacity", [1, 2, 3, 5])
def test_cpu_tier_stays_prefix_closed_at_tiny_capacities(make_key: KeyFn, policy: str, capacity: int) -> None:
    """Chains written in order, tail first and shuffled, through 1..5 slots: the tier never
    drops a chunk while a chunk naming it as parent stays (eviction is leaf-first)."""
    import random

    from kvtier.tiers.policies import make_policy

    rng = random.Random(capacity)
    tier = CpuTier(CB, capacity * CB, make_policy(policy))
    chains = []
    for c in range(30):
        chain = _chain(make_key, 1000 * (c % 7 + 1), rng.randrange(1, 6))  # chains share heads
        chains.append(chain)
        order = list(range(len(chain)))
        mode = c % 3
        if mode == 1:
            order.reverse()
        elif mode == 2:
            rng.shuffle(order)
        for i in order:
            before = _residents(tier)
            buf = tier.reserve(chain[i], chain[i - 1] if i else None)  # evicts, if the tier is full
            if buf is None:
                continue
            buf[:] = payload_for(chain[i], CB)
            tier.commit(chain[i], chain[i - 1] if i else None)
            _assert_no_parent_dropped(before, tier)
            tier.check_invariants()
        for k in reversed(chain):  # a lookup hit touches tail first
            tier.touch(k)
    assert tier.evicted_chunks > 0


def test_delete_and_clear_never_orphan_a_chunk(make_key: KeyFn) -> None:
    tier = CpuTier(CB, 8 * CB)
    head, mid, tail = _chain(make_key, 50, 3)
    for i, k in enumerate((head, mid, tail)):
        buf = tier.reserve(k)
        buf[:] = payload_for(k, CB)
        tier.commit(k, (head, mid)[i - 1] if i else None)
    assert not tier.delete(mid)  # the parent of a resident chunk
    assert tier.acquire(tail) is not None  # a reader holds the tail
    assert tier.clear() == 0  # tail in use: its ancestors stay too
    assert all(tier.contains(k) for k in (head, mid, tail))
    tier.release(tail)
    tier.check_invariants()
    assert tier.delete(tail) and tier.delete(mid) and tier.delete(head)
    tier.check_invariants()


def test_check_invariants_catches_a_broken_entry(make_key: KeyFn) -> None:
    tier = CpuTier(CB, 2 * CB)
    assert put(tier, make_key(1))
    tier.check_invariants()
    tier._refs[tier._entries[make_key(1)]] = -1  # simulate a bug
    with pytest.raises(AssertionError, match="negative"):
        tier.check_invariants()
