"""Eviction policies: each policy's order, the chain rule, liveness, and cost counted (never timed)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.config import KVTierConfig
from kvtier.index.keys import ChunkHasher
from kvtier.tiers.policies import (
    POLICIES,
    ChainAwarePolicy,
    EvictionPolicy,
    LFUPolicy,
    S3FIFOPolicy,
    make_policy,
)

from conftest import small_namespace

ALL = sorted(POLICIES)


def k(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def order(p: EvictionPolicy) -> list[bytes]:
    return list(p.candidates())


def first(p: EvictionPolicy) -> bytes:
    return next(iter(p.candidates()))


def drain(p: EvictionPolicy) -> list[bytes]:
    """Evict everything, always taking the first candidate."""
    out = []
    while len(p):
        v = first(p)
        out.append(v)
        p.remove(v)
    return out


# -- registry and interface ------------------------------------------------------


def test_registry_and_config_accept_every_policy() -> None:
    assert set(POLICIES) == {"lru", "lfu", "fifo", "s3fifo", "a2q"}
    for name in POLICIES:
        assert make_policy(name).name == name
        cfg = KVTierConfig(cpu_eviction=name, disk_eviction=name)
        assert cfg.cpu_eviction == name


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy 'arc'.*lru"):
        make_policy("arc")


@pytest.mark.parametrize("name", ALL)
def test_unknown_keys_are_ignored_and_len_counts_resident(name: str) -> None:
    p = make_policy(name)
    p.touch(k(1))
    p.remove(k(1))
    for i in range(5):
        p.insert(k(i))
    p.insert(k(2))  # again: a use, not a second entry
    assert len(p) == 5
    p.remove(k(3))
    p.remove(k(3))
    assert len(p) == 4 and sorted(drain(p)) == sorted([k(0), k(1), k(2), k(4)])


@pytest.mark.parametrize("name", ALL)
def test_self_parent_is_refused(name: str) -> None:
    p = make_policy(name)
    with pytest.raises(ValueError):
        p.insert(k(1), parent=k(1))
    assert len(p) == 0


# -- each policy's order (keys without parents) -------------------------------


def test_lru_order() -> None:
    p = make_policy("lru")
    for i in range(4):
        p.insert(k(i))
    p.touch(k(0))
    p.touch(k(2))
    assert order(p) == [k(1), k(3), k(0), k(2)]


def test_fifo_ignores_uses() -> None:
    p = make_policy("fifo")
    for i in range(4):
        p.insert(k(i))
    p.touch(k(0))
    p.insert(k(1))
    assert order(p) == [k(0), k(1), k(2), k(3)]


def test_lfu_orders_by_count_then_recency() -> None:
    p = make_policy("lfu")
    for i in range(4):
        p.insert(k(i))
    for _ in range(3):
        p.touch(k(0))
    p.touch(k(2))
    p.touch(k(1))  # k1 and k2 both count 2; k2 changed first, so it goes first
    assert order(p) == [k(3), k(2), k(1), k(0)]
    p.remove(k(3))
    p.insert(k(3))  # count starts again at 1
    assert first(p) == k(3)


def test_s3fifo_one_hit_wonders_go_before_used_keys() -> None:
    p = make_policy("s3fifo")
    for i in range(10):
        p.insert(k(i))
    p.touch(k(0))
    # Small queue is 100% > 10%: its oldest key k0 was used, so it moves to main,
    # and k1 (never used since insert) is the victim.
    assert first(p) == k(1)
    p.remove(k(1))
    assert drain(p)[:8] == [k(i) for i in range(2, 10)]  # k0 survives the one-hit wonders


def test_s3fifo_ghost_readmits_into_main() -> None:
    p = S3FIFOPolicy()
    for i in range(10):
        p.insert(k(i))
    p.remove(first(p))  # k0 evicted from small -> ghost
    p.insert(k(0))
    assert k(0) in p._main and k(0) not in p._small
    p.insert(k(20))
    assert k(20) in p._small


def test_s3fifo_main_gives_one_more_pass_per_use_up_to_three() -> None:
    p = S3FIFOPolicy()
    p.insert(k(0))
    p.insert(k(1))
    for key in (k(0), k(1)):
        for _ in range(5):
            p.touch(key)  # capped at 3
    assert p._freq[k(0)] == 3
    drained = drain(p)  # both promoted to main; each needs 3 passes to reach 0
    assert drained == [k(0), k(1)]
    p.insert(k(2))
    p.insert(k(3))
    p.touch(k(3))
    p.touch(k(3))
    assert first(p) == k(2)


@pytest.mark.parametrize("name", ALL)
def test_skipped_candidates_are_followed_by_the_others(name: str) -> None:
    """The tier may skip pinned keys: the iterator must go on to every other key."""
    p = make_policy(name)
    for i in range(20):
        p.insert(k(i))
    seen = []
    for key in p.candidates():
        seen.append(key)
        if len(seen) > 100:
            break
    assert set(seen) == {k(i) for i in range(20)}


# -- the chain rule --------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_chain_is_evicted_tail_first_even_when_inserted_head_first(name: str) -> None:
    p = make_policy(name)
    chain = [k(i) for i in range(6)]
    for i, key in enumerate(chain):
        p.insert(key, chain[i - 1] if i else None)
    for key in chain:  # head-first uses: the order alone would pick the head
        p.touch(key)
    assert drain(p) == chain[::-1]


@pytest.mark.parametrize("name", ALL)
def test_interior_key_is_never_offered(name: str) -> None:
    p = make_policy(name)
    p.insert(k(0))
    p.insert(k(1), k(0))
    p.insert(k(2), k(0))
    for _ in range(3):
        p.touch(k(1))
        p.touch(k(2))
    assert k(0) not in order(p)
    p.remove(k(1))
    assert k(0) not in order(p)
    p.remove(k(2))
    assert first(p) == k(0)  # its last child is gone: next victim


@pytest.mark.parametrize("name", ALL)
def test_child_whose_parent_lives_elsewhere_is_a_leaf(name: str) -> None:
    """A parent that is not resident here (e.g. only on disk) does not block its child."""
    p = make_policy(name)
    p.insert(k(1), parent=k(0))
    assert order(p) == [k(1)]
    p.insert(k(0))  # the parent arrives later: it now has a resident child
    assert order(p) == [k(1)]


def _prompts(shape: list[list[int]]) -> list[np.ndarray]:
    # Each prompt is a path in a small trie: chunk labels -> 32-token chunks.
    return [np.repeat(np.asarray(labels, dtype=np.uint32) + 1, 32) for labels in shape]


prompt_shapes = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=7), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(ALL),
    shapes=prompt_shapes,
    requests=st.lists(st.integers(0, 11), min_size=1, max_size=60),
    capacity=st.integers(1, 14),
    seed=st.integers(0, 2**16),
)
def test_chain_property_under_pressure(
    name: str, shapes: list[list[int]], requests: list[int], capacity: int, seed: int
) -> None:
    """Random prompt trees, inserted with parents under a tight capacity, touches in random
    order and random extra pins: an evicted chunk never has a resident child, every resident
    chunk's parent is resident (no unreachable chunk is kept), and an eviction fails only when
    every resident leaf is pinned."""
    rng = random.Random(seed)
    hasher = ChunkHasher(small_namespace())
    prompts = [hasher.keys(t) for t in _prompts(shapes)]
    p = make_policy(name)
    parent: dict[bytes, bytes | None] = {}

    def children(key: bytes) -> int:
        return sum(1 for q in parent.values() if q == key)

    for r in requests:
        keys = prompts[r % len(prompts)]
        present = 0
        while present < len(keys) and keys[present] in parent:
            present += 1
        hits = list(keys[:present])
        rng.shuffle(hits)  # a caller that does not touch tail first
        for key in hits:
            p.touch(key)
        pinned = set(keys) | {key for key in parent if rng.random() < 0.2}
        for i in range(present, len(keys)):
            if len(parent) >= capacity:
                victim = next((c for c in p.candidates() if c not in pinned), None)
                if victim is None:
                    leaves = [key for key in parent if children(key) == 0]
                    assert all(key in pinned for key in leaves), "a free leaf was never offered"
                    break
                assert victim in parent
                assert children(victim) == 0, "evicted a chunk that still had a resident child"
                p.remove(victim)
                del parent[victim]
            parent[keys[i]] = keys[i - 1] if i else None
            p.insert(keys[i], parent[keys[i]])
        assert len(p) == len(parent)
        for key, q in parent.items():
            assert q is None or q in parent, "an unreachable chunk is kept"


# -- cost (counted, not timed) -----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_one_eviction_from_a_large_policy_is_not_a_scan(name: str) -> None:
    """200,000 keys as 4,000 chains of 50: one eviction passes over at most one chain's
    interior keys, and over a run of evictions each key is passed over at most once."""
    p = make_policy(name)
    assert isinstance(p, ChainAwarePolicy)
    n_chains, length = 4000, 50
    for c in range(n_chains):
        prev = None
        for j in range(length):
            key = (c * length + j).to_bytes(8, "little") * 4
            p.insert(key, prev)
            prev = key
    before = p.passed_over
    victim = first(p)
    p.remove(victim)
    assert p.passed_over - before < length
    for _ in range(5000):
        p.remove(first(p))
    assert p.passed_over <= n_chains * length
    assert len(p) == n_chains * length - 5001


def test_lfu_counts_survive_deferral() -> None:
    p = LFUPolicy()
    p.insert(k(0))
    p.insert(k(1), k(0))
    p.insert(k(9))
    for _ in range(4):
        p.touch(k(0))
    order(p)  # k0 is interior: passed over and deferred
    p.remove(k(1))
    assert order(p) == [k(9), k(0)]  # back with its count of 5, not as a new key




# -- a2q ---------------------------------------------------------------------------------------
def _a2q(mode: object | None = None) -> "object":
    from kvtier.tiers.policy_a2q import A2QPolicy

    p = A2QPolicy()
    if mode is not None:
        p.mini._choose = lambda: None  # type: ignore[method-assign]
        p.mini.mode = mode  # type: ignore[assignment]
    return p


def _evict_to(p: EvictionPolicy, cap: int, protect: set[bytes] = frozenset()) -> None:  # type: ignore[assignment]
    while len(p) > cap:
        v = next(x for x in p.candidates() if x not in protect)
        p.remove(v)


def test_a2q_in_lru_mode_evicts_exactly_like_lru() -> None:
    rng = random.Random(4)
    a, b = _a2q("lru"), make_policy("lru")
    for step in range(3000):
        i = rng.randrange(300)
        parent = k(i - 1) if i % 5 and (k(i - 1) in a) else None
        use = rng.random() < 0.4
        for p in (a, b):
            if use and k(i) in p:
                p.touch(k(i))
            elif k(i) not in p:
                p.insert(k(i), parent)
            _evict_to(p, 64)
        assert sorted(a._parent) == sorted(b._parent), step  # type: ignore[attr-defined]
    a.check_invariants()  # type: ignore[attr-defined]


def test_a2q_keeps_a_key_used_twice_through_a_scan_of_new_keys() -> None:
    p = _a2q(0.0)
    hot = [k(i) for i in range(5)]
    for x in hot:
        p.insert(x)
    for x in hot:
        p.touch(x)  # used again: the LRU of reused keys
    for i in range(100, 400):  # a scan of keys seen once
        p.insert(k(i))
        _evict_to(p, 20)
    assert all(x in p for x in hot)
    lru = make_policy("lru")
    for x in hot:
        lru.insert(x)
        lru.touch(x)
    for i in range(100, 400):
        lru.insert(k(i))
        _evict_to(lru, 20)
    assert not any(x in lru for x in hot)  # LRU loses them: the test can tell the two apart


def test_a2q_remembers_evicted_keys_and_admits_them_as_reused() -> None:
    from kvtier.tiers.policy_a2q import GhostTable, fingerprint

    g = GhostTable(256)
    fs = [fingerprint(k(i)) for i in range(64)]
    for f in fs:
        g.add(f)
    g.grow_to(1024)  # growing keeps them
    assert all(g.pop(f) for f in fs) and not g.pop(fs[0])
    for i in range(64, 64 + 5000):  # far more than it holds: the oldest are forgotten
        g.add(fingerprint(k(i)))
    assert sum(g.pop(fingerprint(k(i))) for i in range(64, 564)) < 50
    assert sum(g.pop(fingerprint(k(i))) for i in range(4900, 5064)) > 150

    p = _a2q(0.0)
    for i in range(10):
        p.insert(k(i))
    _evict_to(p, 0)
    p.insert(k(3))  # in the history: straight to the reused queue
    for i in range(100, 130):
        p.insert(k(i))
        _evict_to(p, 5)
    assert k(3) in p


def test_a2q_chooses_its_mode_by_miniature_simulation() -> None:
    from kvtier.tiers.policy_a2q import MiniSims

    loop = MiniSims(min_cache=64)  # keys reused at a distance beyond the cache, and a one-off stream
    rng = random.Random(1)
    for n in range(60_000):
        f = (rng.randrange(150) if n % 2 else 10_000 + n) * 2 + 1
        loop.observe(f, None, 100)
    assert loop.mode != "lru"
    recent = MiniSims(min_cache=64)  # pure recency: a sliding window smaller than the cache
    for n in range(60_000):
        recent.observe((n - rng.randrange(60)) * 2 + 1, None, 100)
    assert recent.mode == "lru"
