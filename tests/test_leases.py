"""LeaseTable: grant/release/replace, TTL expiry with an injected clock, pin counts."""

from __future__ import annotations

import pytest

from kvtier.storage.leases import LeaseTable

K1, K2, K3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_grant_and_release() -> None:
    t = LeaseTable(ttl_s=10)
    t.grant("r1", [K1, K2])
    assert t.holds("r1") and len(t) == 1
    assert t.is_pinned(K1) and t.is_pinned(K2) and not t.is_pinned(K3)
    assert t.release("r1") is True
    assert not t.holds("r1") and len(t) == 0
    assert not t.is_pinned(K1) and not t.is_pinned(K2)
    assert t.pinned_keys == 0
    assert t.release("r1") is False  # a lease ends exactly once
    assert t.release("never") is False


def test_replace_moves_pins() -> None:
    t = LeaseTable(ttl_s=10)
    t.grant("r1", [K1, K2])
    t.grant("r1", [K2, K3])
    assert len(t) == 1
    assert not t.is_pinned(K1) and t.is_pinned(K2) and t.is_pinned(K3)
    t.release("r1")
    assert t.pinned_keys == 0


def test_grant_with_no_keys_ends_the_old_lease() -> None:
    t = LeaseTable(ttl_s=10)
    t.grant("r1", [K1])
    t.grant("r1", [])
    assert not t.holds("r1") and not t.is_pinned(K1) and len(t) == 0


def test_pins_count_per_key() -> None:
    t = LeaseTable(ttl_s=10)
    t.grant("a", [K1, K2])
    t.grant("b", [K1])
    t.grant("c", [K1, K3])
    assert t.pinned_keys == 3
    t.release("a")
    assert t.is_pinned(K1) and not t.is_pinned(K2)
    t.release("c")
    assert t.is_pinned(K1) and not t.is_pinned(K3)
    t.release("b")
    assert not t.is_pinned(K1)
    assert t.pinned_keys == 0 and len(t) == 0


def test_duplicate_keys_in_one_lease() -> None:
    t = LeaseTable(ttl_s=10)
    t.grant("a", [K1, K1])
    t.grant("b", [K1])
    t.release("a")
    assert t.is_pinned(K1)
    t.release("b")
    assert t.pinned_keys == 0


def test_ttl_expiry_with_injected_clock() -> None:
    clock = FakeClock()
    t = LeaseTable(ttl_s=5, clock=clock)
    t.grant("old", [K1, K2])
    clock.now += 3
    t.grant("young", [K2, K3])
    clock.now += 1.9  # old: 4.9 s
    assert t.reap() == 0
    assert t.is_pinned(K1)
    clock.now += 0.1  # old: 5 s -> expired; young: 2 s
    assert t.reap() == 1
    assert not t.holds("old") and t.holds("young")
    assert not t.is_pinned(K1) and t.is_pinned(K2) and t.is_pinned(K3)
    assert t.expired == 1
    assert t.release("old") is False  # already ended by the TTL; no double decrement
    assert t.is_pinned(K2)
    clock.now += 100
    assert t.reap() == 1
    assert t.expired == 2 and t.pinned_keys == 0 and len(t) == 0


def test_replace_renews_the_ttl() -> None:
    clock = FakeClock()
    t = LeaseTable(ttl_s=5, clock=clock)
    t.grant("r", [K1])
    clock.now += 4
    t.grant("r", [K1])  # the scheduler asked again
    clock.now += 4
    assert t.reap() == 0 and t.is_pinned(K1)
    clock.now += 1
    assert t.reap() == 1 and t.pinned_keys == 0


@pytest.mark.parametrize("ttl", [0, -1.0])
def test_bad_ttl(ttl: float) -> None:
    with pytest.raises(ValueError):
        LeaseTable(ttl_s=ttl)


def test_random_grants_leave_no_pins() -> None:
    import random

    rng = random.Random(7)
    clock = FakeClock()
    t = LeaseTable(ttl_s=3, clock=clock)
    keys = [bytes([i]) * 32 for i in range(6)]
    owners = [f"r{i}" for i in range(5)]
    for _ in range(500):
        op = rng.random()
        owner = rng.choice(owners)
        if op < 0.5:
            t.grant(owner, rng.sample(keys, rng.randint(0, 4)))
        elif op < 0.8:
            t.release(owner)
        elif op < 0.9:
            clock.now += rng.random() * 2
            t.reap()
        else:
            # model check: pins equal the leases listing each key
            live = {o: t._leases[o].keys for o in owners if t.holds(o)}
            for k in keys:
                assert t.is_pinned(k) == any(k in ks for ks in live.values())
    for o in owners:
        t.release(o)
    assert len(t) == 0 and t.pinned_keys == 0


def test_check_invariants_after_random_sequences_and_on_corruption() -> None:
    import random

    now = [0.0]
    t = LeaseTable(ttl_s=10.0, clock=lambda: now[0])
    rng = random.Random(7)
    keys = [bytes([i]) * 32 for i in range(6)]
    for _ in range(500):
        op = rng.random()
        owner = f"r{rng.randrange(4)}"
        if op < 0.5:
            t.grant(owner, rng.sample(keys, rng.randrange(0, 4)))
        elif op < 0.8:
            t.release(owner)
        else:
            now[0] += rng.choice([1.0, 6.0])
            t.reap()
        t.check_invariants()
    t.grant("x", keys[:2])
    t._pins[keys[0]] += 1  # simulate a bug: a pin without a lease
    with pytest.raises(AssertionError, match="pin counts"):
        t.check_invariants()
