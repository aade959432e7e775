"""Prefix closure of the disk tier across restarts (issue 8, failing input 4).

A chunk can only be hit through its whole prefix (lookups walk keys from the
first chunk and stop at the first miss), so a tier that keeps a chunk whose
parent it dropped keeps bytes nobody can use. The disk record carries the
parent key; the index rebuilt at open knows every chunk's parent and evicts
leaf-first. ``check_invariants`` asserts the closure after every step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import CHUNK, payload_for, small_namespace
from kvtier.index.keys import ChunkHasher
from kvtier.serde.record import decode_header
from kvtier.tiers.base import ChunkWrite
from kvtier.tiers.disk import HEADER_BYTES, DiskTier
from kvtier.tiers.policies import make_policy

NS = small_namespace()
CB = NS.chunk_bytes
FILE = HEADER_BYTES + CB
HASHER = ChunkHasher(NS)


def prompt(seed: int, n_chunks: int, prefix: list[int] | None = None) -> list[int]:
    rng = np.random.default_rng(seed)
    head = list(prefix or [])
    return head + [int(t) for t in rng.integers(0, 50_000, n_chunks * CHUNK - len(head))]


def writes(tokens: list[int], skip: int = 0) -> list[ChunkWrite]:
    """The chunk writes of a prompt (its chain), the first ``skip`` chunks left out."""
    keys = HASHER.keys(tokens)
    parents = [None, *keys[:-1]]
    return [ChunkWrite(k, p, payload_for(k, CB)) for k, p in zip(keys, parents)][skip:]


def lookup_tokens(tier: DiskTier, tokens: list[int]) -> int:
    """Tokens a lookup walk finds: the longest run of resident chunks from the first."""
    n = 0
    for hit in tier.contains_many(HASHER.keys(tokens)):
        if not hit:
            break
        n += 1
    return n * CHUNK


def unreachable(tier: DiskTier) -> int:
    """Resident chunks whose parent is not resident (no lookup can reach them)."""
    entries = tier._index.entries
    return sum(1 for e in entries.values() if e.parent is not None and e.parent not in entries)


def age_in_write_order(tier: DiskTier, keys: list[bytes]) -> None:
    """Give the files strictly increasing mtimes in the order written (the file system's
    timestamp granularity can make chunks written together look simultaneous)."""
    now = time.time()
    for i, k in enumerate(keys):
        t = now - 1000 + i
        os.utime(tier.file_of(k), (t, t))


def reopen(path: Path, chunks: int, **kw: object) -> DiskTier:
    t = DiskTier(path, chunks * FILE, NS.digest(), **kw)  # type: ignore[arg-type]
    t.check_invariants()
    return t


def test_restart_with_room_for_one_chunk_keeps_the_head(disk_dir: Path) -> None:
    """Failing input 4a: a 2-chunk prompt reopened with capacity 1 chunk kept the tail (lookup: 0)."""
    tokens = prompt(1, 2)
    t = reopen(disk_dir, 4)
    assert t.put_many(writes(tokens)) == [True, True]
    age_in_write_order(t, HASHER.keys(tokens))  # the head is the older file
    t.close()
    t = reopen(disk_dir, 1)
    try:
        head, tail = HASHER.keys(tokens)
        assert t.contains_many([head, tail]) == [True, False]
        assert lookup_tokens(t, tokens) == 32
        assert unreachable(t) == 0
    finally:
        t.close()


def test_restart_then_one_more_write_keeps_the_shared_head(disk_dir: Path) -> None:
    """Failing input 4b: shared head S + five prompts S+2 chunks (11 chunks), capacity 12,
    restart, one more 2-chunk write: S was evicted, leaving 10 unreachable chunks."""
    shared = prompt(100, 1)
    prompts = [prompt(200 + i, 3, prefix=shared) for i in range(5)]
    t = reopen(disk_dir, 12)
    order: list[bytes] = []
    for i, p in enumerate(prompts):
        ws = writes(p, skip=1 if i else 0)
        assert all(t.put_many(ws))
        order += [w.key for w in ws]
    age_in_write_order(t, order)  # S is the oldest file
    assert len(t) == 11
    t.close()
    t = reopen(disk_dir, 12)
    try:
        assert len(t) == 11
        extra = prompt(300, 2)
        assert all(t.put_many(writes(extra)))
        t.check_invariants()
        s_key = HASHER.keys(shared)[0]
        assert t.contains(s_key), "the shared head was evicted"
        assert unreachable(t) == 0
        assert len(t) == 12 and t.used_bytes <= t.capacity_bytes
        assert sorted(lookup_tokens(t, p) for p in prompts) == [64, 96, 96, 96, 96]  # one tail went
    finally:
        t.close()


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "s3fifo"])
def test_restart_with_a_smaller_capacity_evicts_leaf_first(disk_dir: Path, policy: str) -> None:
    prompts = [prompt(400 + i, 4) for i in range(6)]  # 24 chunks, 6 chains
    t = reopen(disk_dir, 30)
    for p in prompts:
        assert all(t.put_many(writes(p)))
    t.close()
    for bound in (17, 9, 5, 2):
        t = reopen(disk_dir, bound, policy=make_policy(policy))
        try:
            assert len(t) <= bound and t.used_bytes <= bound * FILE
            assert unreachable(t) == 0
            found = sum(lookup_tokens(t, p) for p in prompts) // CHUNK
            assert found == len(t), "every resident chunk is reachable by its prompt's lookup"
        finally:
            t.close()


def test_chains_written_out_of_order(disk_dir: Path) -> None:
    tokens = prompt(7, 3)
    w = writes(tokens)
    t = reopen(disk_dir, 10)
    try:
        assert t.put_many([w[2]]) == [True]  # the tail first: allowed while the chain is being written
        t.check_invariants()
        assert lookup_tokens(t, tokens) == 0
        assert t.put_many([w[0], w[1]]) == [True, True]
        t.check_invariants()
        assert lookup_tokens(t, tokens) == 96 and unreachable(t) == 0
        # under pressure the head stays while it has descendants
        for i in range(20):
            assert all(t.put_many(writes(prompt(50 + i, 1))))
            t.check_invariants()
            assert unreachable(t) == 0
    finally:
        t.close()


def test_orphans_are_dropped_at_open(disk_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A tail whose head never reached the disk (out-of-order write, then a crash) cannot be hit."""
    tokens = prompt(8, 3)
    w = writes(tokens)
    t = reopen(disk_dir, 10)
    assert t.put_many([w[1], w[2]]) == [True, True]  # the head never came
    assert unreachable(t) == 1
    t.close()
    t = reopen(disk_dir, 10)
    try:
        assert len(t) == 0 and not list(disk_dir.glob("??/*.kvc"))
        assert any("orphans" in r.getMessage() for r in caplog.records)
    finally:
        t.close()


def test_removing_a_head_removes_its_descendants(disk_dir: Path) -> None:
    """delete and a corrupt record take the chain below with them (no orphan stays)."""
    a, b = prompt(9, 3), prompt(10, 3)
    t = reopen(disk_dir, 10)
    try:
        assert all(t.put_many(writes(a) + writes(b)))
        ka, kb = HASHER.keys(a), HASHER.keys(b)
        assert t.delete_many([ka[1]]) == 1
        assert t.contains_many(ka) == [True, False, False]
        t.check_invariants()
        p = t.file_of(kb[0])
        p.write_bytes(p.read_bytes()[:-1] + b"\x00")  # corrupt head of b
        assert t.get_into(kb[0], np.zeros(CB, np.uint8)) is False
        assert t.contains_many(kb) == [False, False, False]
        t.check_invariants()
        assert unreachable(t) == 0
    finally:
        t.close()


def test_record_carries_parent_and_files_are_private(disk_dir: Path) -> None:
    tokens = prompt(11, 2)
    head, tail = HASHER.keys(tokens)
    t = reopen(disk_dir, 4)
    try:
        assert all(t.put_many(writes(tokens)))
        hdr = decode_header(t.file_of(tail).read_bytes()[:HEADER_BYTES])
        assert hdr.parent == head and hdr.key == tail and hdr.namespace == NS.digest()
        assert decode_header(t.file_of(head).read_bytes()[:HEADER_BYTES]).parent is None
        assert t.file_of(tail).stat().st_mode & 0o777 == 0o600
        assert t.file_of(tail).parent.stat().st_mode & 0o777 == 0o700
        assert (disk_dir / ".lock").stat().st_mode & 0o777 == 0o600
    finally:
        t.close()


def test_old_format_files_are_dropped_at_open_with_one_log_line(
    disk_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = disk_dir / "ab"
    old.mkdir()
    for i in range(3):
        (old / f"ab{i:062x}.kv").write_bytes(b"KVTIER\x00\x01" + bytes(5000))
    t = reopen(disk_dir, 4)
    try:
        assert len(t) == 0 and not list(old.iterdir())
        lines = [r.getMessage() for r in caplog.records if "previous format" in r.getMessage()]
        assert len(lines) == 1 and "dropped 3 files of the previous format" in lines[0]
    finally:
        t.close()


def test_touch_keeps_the_hit_chain(disk_dir: Path) -> None:
    a, b = prompt(12, 2), prompt(13, 2)
    t = reopen(disk_dir, 4)
    try:
        assert all(t.put_many(writes(a) + writes(b)))
        t.touch_many(HASHER.keys(a))  # a was hit: b is the older chain now
        assert all(t.put_many(writes(prompt(14, 1))))
        assert lookup_tokens(t, a) == 64 and lookup_tokens(t, b) == 32
        t.check_invariants()
    finally:
        t.close()


def test_long_keys_are_stored_under_a_digest_name(disk_dir: Path) -> None:
    t = reopen(disk_dir, 4)
    key = os.urandom(200)
    try:
        assert t.put(key, payload_for(key[:32], CB))
        out = np.zeros(CB, np.uint8)
        assert t.get_into(key, out) and np.array_equal(out, payload_for(key[:32], CB))
    finally:
        t.close()
    t = reopen(disk_dir, 4)
    try:
        assert t.contains(key)
    finally:
        t.close()


def test_a_chunk_is_never_stored_at_the_price_of_its_parent(disk_dir: Path) -> None:
    """Sibling of 4a: with room for one chunk, storing the tail must not evict the head."""
    tokens = prompt(15, 3)
    w = writes(tokens)
    t = reopen(disk_dir, 1)
    try:
        assert t.put_many(w) == [True, False, False]
        assert lookup_tokens(t, tokens) == 32 and unreachable(t) == 0
        t.check_invariants()
    finally:
        t.close()
    t = reopen(disk_dir, 2)
    try:
        other = prompt(16, 1)
        assert t.put_many(writes(other)) == [True]  # a second chain's head fills the store
        assert t.put_many(w[1:]) == [True, False]  # the middle evicts the other chain, not its parent
        assert lookup_tokens(t, tokens) == 64 and lookup_tokens(t, other) == 0
        t.check_invariants()
    finally:
        t.close()


def test_rewriting_a_resident_chunk_in_a_full_store_evicts_nothing(disk_dir: Path) -> None:
    """Found by the state machine below: re-putting a chunk already on disk reserved its whole size
    on top of the old record, so in a full store it evicted another chain's chunk (here the early
    parent of a chunk written next, which then outlived it). A rewrite needs room only for growth."""
    t = reopen(disk_dir, 3)
    try:
        a = writes(prompt(1, 1))
        b = writes(prompt(2, 2))
        assert t.put_many(a + b) == [True, True, True]  # full: 3 of 3 chunks
        before = set(t._index.entries)
        assert t.put_many(a) == [True]  # the same chunk again
        assert set(t._index.entries) == before and t.evicted_chunks == 0
        t.check_invariants()
    finally:
        t.close()


def test_a_lineage_marker_parent_is_a_chain_head_at_write_eviction_and_reopen(disk_dir: Path) -> None:
    """A prompt's first chunk records its salt's lineage marker as parent (not a chunk key): the
    tier treats it as a head (it evicts for it, keeps it at reopen, reports the marker back)."""
    marker = NS.lineage("tenant")
    t = reopen(disk_dir, 3)
    try:
        first = writes(prompt(5, 3))
        first[0] = ChunkWrite(first[0].key, marker, first[0].payload)
        assert t.put_many(first) == [True, True, True]
        second = writes(prompt(6, 1))
        second[0] = ChunkWrite(second[0].key, marker, second[0].payload)
        assert t.put_many(second) == [True]  # full: evicts a leaf of the first chain (not "early")
        assert t.evicted_chunks == 1
        t.check_invariants()
        assert dict(t.scan_keys())[first[0].key] == marker
    finally:
        t.close()
    t = reopen(disk_dir, 3)
    try:
        assert t.contains_many([first[0].key, second[0].key]) == [True, True]  # heads, not orphans
        assert dict(t.scan_keys())[second[0].key] == marker
    finally:
        t.close()


# -- random operations: the invariants hold after every step --------------------------------------

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402


class DiskChains(RuleBasedStateMachine):
    """Chains written in any order, read, touched, deleted, corrupted, and the tier reopened
    with other capacities: ``check_invariants`` after every step, and no unreachable chunk
    right after a reopen."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-chains-"))
        self.tier = reopen(self.dir, 6)
        self.chains = [writes(prompt(1000 + i, 1 + i % 4)) for i in range(6)]

    @rule(c=st.integers(0, 5), order=st.permutations(range(4)), upto=st.integers(1, 4))
    def put_chain(self, c: int, order: list[int], upto: int) -> None:
        chain = self.chains[c]
        ws = [chain[i] for i in order if i < min(upto, len(chain))]
        seen = set(self.tier._index.entries)
        seen.update(w.key for w, ok in zip(ws, self.tier.put_many(ws)) if ok)
        after = self.tier._index.entries
        for key in after:  # no chunk is kept (or stored) at the price of its parent
            assert after[key].parent not in seen - after.keys(), "a chunk outlived its parent"

    @rule(c=st.integers(0, 5))
    def lookup_and_touch(self, c: int) -> None:
        keys = [w.key for w in self.chains[c]]
        hits = []
        for k, ok in zip(keys, self.tier.contains_many(keys)):
            if not ok:
                break
            hits.append(k)
        outs = [(k, np.zeros(CB, np.uint8)) for k in hits]
        assert all(self.tier.get_many_into(outs))
        self.tier.touch_many(hits)

    @rule(c=st.integers(0, 5), i=st.integers(0, 3))
    def delete(self, c: int, i: int) -> None:
        chain = self.chains[c]
        self.tier.delete_many([chain[min(i, len(chain) - 1)].key])

    @rule(c=st.integers(0, 5))
    def corrupt_head(self, c: int) -> None:
        p = self.tier.file_of(self.chains[c][0].key)
        if p.exists():
            p.write_bytes(p.read_bytes()[:-1] + b"\x01")
            self.tier.get_into(self.chains[c][0].key, np.zeros(CB, np.uint8))

    @rule(capacity=st.integers(1, 10))
    def reopen(self, capacity: int) -> None:
        self.tier.close()
        self.tier = reopen(self.dir, capacity)
        assert unreachable(self.tier) == 0 and len(self.tier) <= capacity

    @invariant()
    def invariants_hold(self) -> None:
        self.tier.check_invariants()
        assert self.tier.used_bytes <= self.tier.capacity_bytes

    def teardown(self) -> None:
        import shutil

        self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestDiskChains = DiskChains.TestCase
TestDiskChains.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
