"""The lower-tier contract: one pytest test class every :class:`~kvtier.tiers.base.LowerTier` runs.

Disk, shared filesystem, Redis, Redis Cluster, the in-memory reference tier and
third-party plug-ins all run the same tests (see :mod:`kvtier.tiers.base` for the
semantics): round trips (single, batched in argument order, overwrite, every
built-in codec), honest misses (absent keys, wrong-size destinations, corrupt,
truncated, foreign-key, foreign-namespace and garbage values, unknown codecs:
each a miss, counted, never an exception), deletes, namespace-scoped ``clear``,
prefix closure under eviction (with a bounded store), argument errors raised at
once, use from several threads at once, misses after close, and, when the
harness can break the backing store, misses while it is down and service again
after it returns.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from kvtier.serde.base import Buffer, Codec, CodecError, ValueSpec, byte_view
from kvtier.tiers.base import ChunkWrite, LowerTier, TierCounters

_CHANNELS = 64


def bf16_payload(nbytes: int, seed: int) -> np.ndarray:
    """``nbytes`` of finite bf16 values (uint8 array), like a KV chunk, deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(nbytes // 2, dtype=np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


#: Namespace digests the contract uses (32 bytes each).
NS_A = b"A" * 32
NS_B = b"B" * 32


@dataclass
class TierHarness:
    """How the contract drives one tier implementation.

    Attributes:
        make: returns a new tier instance on the shared backing store; accepts the
            keyword option ``namespace`` (32-byte digest; default :data:`NS_A`) and,
            if ``codecs``, ``codec``, ``codec_options``, ``spec`` and ``decoders``.
        read_raw: ``(tier, key)`` -> the stored bytes of chunk ``key`` in ``tier``'s
            namespace (None if absent), bypassing the tier.
        write_raw: ``(tier, key, data)``: overwrite the stored bytes of a chunk the
            tier holds, bypassing the tier.
        make_bounded: ``(capacity_chunks, **options)`` -> a tier on an empty store that
            keeps at most ``capacity_chunks`` chunks of ``value_bytes`` (None: the
            prefix-closure test is skipped; e.g. Redis bounds memory server-side).
        break_store: make the backing store unavailable (None: failure test skipped).
        restore_store: bring it back (same contents or empty).
        value_bytes: payload size used by the tests (a multiple of 128).
        recovery_s: how long the tier may take to serve again after ``restore_store``
            (covers circuit-breaker back-off).
        codecs: the tier takes codec options (False: the codec tests are skipped).
        header_offset: a byte offset inside the stored header (the corruption test flips it).
    """

    make: Callable[..., LowerTier]
    read_raw: Callable[[LowerTier, bytes], bytes | None]
    write_raw: Callable[[LowerTier, bytes, bytes], None]
    make_bounded: Callable[..., LowerTier] | None = None
    break_store: Callable[[], None] | None = None
    restore_store: Callable[[], None] | None = None
    value_bytes: int = 256 * 1024
    recovery_s: float = 10.0
    codecs: bool = True
    header_offset: int = 30


class _TestCodec(Codec):
    """A codec only some readers know: XOR with 0x5A (tests unknown-codec misses)."""

    name = "x-contract-test"
    version = 1
    lossless = True

    def encode(self, payload: memoryview, spec: ValueSpec) -> list[Buffer]:
        return [(np.frombuffer(payload, np.uint8) ^ 0x5A).tobytes()]

    def decode_into(self, body: memoryview, out: memoryview) -> None:
        if len(body) != len(out):
            raise CodecError("size")
        np.frombuffer(out, np.uint8)[:] = np.frombuffer(body, np.uint8) ^ 0x5A


def _keys(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def _writes(keys: list[bytes], values: list, parents: list[bytes | None] | None = None) -> list[ChunkWrite]:
    parents = parents or [None] * len(keys)
    return [ChunkWrite(k, p, v) for k, p, v in zip(keys, parents, values)]


class TierContract:
    """Subclass this (name it ``Test...``) and provide a ``harness`` fixture."""

    @pytest.fixture
    def tier(self, harness: TierHarness):
        t = harness.make()
        try:
            yield t
        finally:
            t.clear()
            t.close()

    def _payloads(self, harness: TierHarness, n: int, seed: int = 0) -> list[np.ndarray]:
        return [bf16_payload(harness.value_bytes, seed * 1000 + i) for i in range(n)]

    @staticmethod
    def _needs_codecs(harness: TierHarness) -> None:
        if not harness.codecs:
            pytest.skip("this tier takes no codec options")

    # -- round trips ---------------------------------------------------------------
    def test_round_trip_single(self, tier: LowerTier, harness: TierHarness) -> None:
        (key,) = _keys(1)
        (value,) = self._payloads(harness, 1)
        assert tier.put(key, value)
        assert tier.contains(key)
        out = np.zeros_like(value)
        assert tier.get_into(key, out)
        assert np.array_equal(out, value)

    def test_batches_keep_argument_order(self, tier: LowerTier, harness: TierHarness) -> None:
        keys = _keys(6)
        values = self._payloads(harness, 6, seed=1)
        stored = [0, 2, 3, 5]
        assert tier.put_many(_writes([keys[i] for i in stored], [values[i] for i in stored])) == [True] * 4
        expect = [i in stored for i in range(6)]
        assert tier.contains_many(keys) == expect
        outs = [np.zeros_like(v) for v in values]
        assert tier.get_many_into(list(zip(keys, outs))) == expect
        for i in stored:
            assert np.array_equal(outs[i], values[i])
        rev = list(reversed(range(6)))
        assert tier.contains_many([keys[i] for i in rev]) == [expect[i] for i in rev]

    def test_a_chain_round_trips_with_parents(self, tier: LowerTier, harness: TierHarness) -> None:
        keys = _keys(4)
        values = self._payloads(harness, 4, seed=17)
        assert tier.put_many(_writes(keys, values, [None, *keys[:-1]])) == [True] * 4
        tier.touch_many(keys)  # recency / TTL refresh: never raises
        outs = [np.zeros_like(v) for v in values]
        assert tier.get_many_into(list(zip(keys, outs))) == [True] * 4
        assert all(np.array_equal(o, v) for o, v in zip(outs, values))

    def test_empty_batches(self, tier: LowerTier) -> None:
        assert tier.contains_many([]) == []
        assert tier.put_many([]) == []
        assert tier.get_many_into([]) == []
        assert tier.delete_many([]) == 0
        tier.touch_many([])

    def test_overwrite_returns_latest(self, tier: LowerTier, harness: TierHarness) -> None:
        (key,) = _keys(1)
        a, b = self._payloads(harness, 2, seed=2)
        assert tier.put(key, a) and tier.put(key, b)
        out = np.zeros_like(a)
        assert tier.get_into(key, out)
        assert np.array_equal(out, b)

    def test_accepts_bytes_and_memoryview(self, tier: LowerTier, harness: TierHarness) -> None:
        k1, k2 = _keys(2)
        (value,) = self._payloads(harness, 1, seed=3)
        assert tier.put_many([ChunkWrite(k1, None, value.tobytes()), ChunkWrite(k2, None, byte_view(value))]) == [
            True,
            True,
        ]
        out = bytearray(value.nbytes)
        assert tier.get_into(k2, memoryview(out))
        assert bytes(out) == value.tobytes()

    @pytest.mark.parametrize("codec", ["raw", "shuffle-zstd"])
    def test_lossless_codec_round_trip(self, harness: TierHarness, codec: str) -> None:
        self._needs_codecs(harness)
        writer = harness.make(codec=codec)
        reader = harness.make()  # readers decode whatever codec the header names
        try:
            keys = _keys(3)
            values = self._payloads(harness, 3, seed=4)
            assert writer.put_many(_writes(keys, values)) == [True] * 3
            outs = [np.zeros_like(v) for v in values]
            assert reader.get_many_into(list(zip(keys, outs))) == [True] * 3
            for o, v in zip(outs, values):
                assert np.array_equal(o, v)
        finally:
            writer.clear()
            writer.close()
            reader.close()

    @pytest.mark.parametrize("mode", ["token", "channel"])
    def test_int8_codec_round_trip_is_close(self, harness: TierHarness, mode: str) -> None:
        self._needs_codecs(harness)
        tokens = harness.value_bytes // (2 * _CHANNELS)
        spec = ValueSpec("bfloat16", (tokens, _CHANNELS))
        writer = harness.make(codec="int8", codec_options={"mode": mode}, spec=spec)
        try:
            (key,) = _keys(1)
            (value,) = self._payloads(harness, 1, seed=5)
            assert writer.put(key, value)
            raw = harness.read_raw(writer, key)
            assert raw is not None and len(raw) < 0.6 * value.nbytes + 8192  # int8 halves bf16
            out = np.zeros_like(value)
            assert writer.get_into(key, out)
            x = (value.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            y = (out.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            # |error| <= half a quantization step (+ bf16 rounding) of the group's max.
            assert np.abs(x - y).max() <= np.abs(x).max() / 127
            assert not np.array_equal(out, value)  # lossy indeed
        finally:
            writer.clear()
            writer.close()

    # -- misses --------------------------------------------------------------------
    def test_absent_keys_are_misses(self, tier: LowerTier, harness: TierHarness) -> None:
        keys = _keys(3)
        assert tier.contains_many(keys) == [False] * 3
        out = np.full(harness.value_bytes, 7, np.uint8)
        assert tier.get_into(keys[0], out) is False
        assert (out == 7).all()  # an absent key leaves the destination alone
        s = tier.stats()
        assert s["get_misses"] >= 1 and s["get_hits"] == 0

    def test_wrong_size_destination_is_miss(self, tier: LowerTier, harness: TierHarness) -> None:
        (key,) = _keys(1)
        (value,) = self._payloads(harness, 1, seed=6)
        assert tier.put(key, value)
        assert tier.get_into(key, np.zeros(value.nbytes - 2, np.uint8)) is False
        assert tier.get_into(key, np.zeros(value.nbytes + 2, np.uint8)) is False

    def _assert_bad_value_is_miss(self, tier: LowerTier, key: bytes, size: int) -> None:
        before = tier.stats()["get_corrupt"]
        out = np.zeros(size, np.uint8)
        assert tier.get_into(key, out) is False
        assert tier.stats()["get_corrupt"] == before + 1
        assert tier.get_into(key, out) is False  # and stays a miss

    def test_corrupt_payload_is_miss(self, tier: LowerTier, harness: TierHarness) -> None:
        (key,) = _keys(1)
        (value,) = self._payloads(harness, 1, seed=7)
        assert tier.put(key, value)
        raw = bytearray(harness.read_raw(tier, key) or b"")
        raw[len(raw) // 2] ^= 0x01  # one flipped bit inside the payload
        harness.write_raw(tier, key, bytes(raw))
        self._assert_bad_value_is_miss(tier, key, value.nbytes)

    def test_corrupt_header_is_miss(self, tier: LowerTier, harness: TierHarness) -> None:
        (key,) = _keys(1)
        (value,) = self._payloads(harness, 1, seed=8)
        assert tier.put(key, value)
        raw = bytearray(harness.read_raw(tier, key) or b"")
        raw[harness.header_offset] ^= 0xFF
        harness.write_raw(tier, key, bytes(raw))
        self._assert_bad_value_is_miss(tier, key, value.nbytes)

    def test_truncated_value_is_miss(self, tier: LowerTier, harness: TierHarness) -> None:
        (key,) = _keys(1)
        (value,) = self._payloads(harness, 1, seed=9)
        assert tier.put(key, value)
        harness.write_raw(tier, key, (harness.read_raw(tier, key) or b"")[:-100])
        self._assert_bad_value_is_miss(tier, key, value.nbytes)

    def test_foreign_key_value_is_miss(self, tier: LowerTier, harness: TierHarness) -> None:
        a, b = _keys(2)
        va, vb = self._payloads(harness, 2, seed=10)
        assert tier.put(a, va) and tier.put(b, vb)
        harness.write_raw(tier, b, harness.read_raw(tier, a) or b"")  # a's value under b's name
        self._assert_bad_value_is_miss(tier, b, va.nbytes)
        out = np.zeros_like(va)
        assert tier.get_into(a, out) and np.array_equal(out, va)

    def test_foreign_namespace_value_is_miss(self, harness: TierHarness) -> None:
        """Another model's value for the same chunk key, copied under this namespace's name: a miss."""
        mine, theirs = harness.make(namespace=NS_A), harness.make(namespace=NS_B)
        try:
            (key,) = _keys(1)
            va, vb = self._payloads(harness, 2, seed=18)
            assert mine.put(key, va) and theirs.put(key, vb)
            harness.write_raw(mine, key, harness.read_raw(theirs, key) or b"")
            self._assert_bad_value_is_miss(mine, key, va.nbytes)
            out = np.zeros_like(vb)
            assert theirs.get_into(key, out) and np.array_equal(out, vb)
        finally:
            for t in (mine, theirs):
                t.clear()
                t.close()

    def test_garbage_value_is_miss(self, tier: LowerTier, harness: TierHarness) -> None:
        (key,) = _keys(1)
        (value,) = self._payloads(harness, 1, seed=19)
        assert tier.put(key, value)
        harness.write_raw(tier, key, b"definitely not a kvtier value" * 3)
        self._assert_bad_value_is_miss(tier, key, harness.value_bytes)

    def test_unknown_codec_is_miss(self, harness: TierHarness) -> None:
        self._needs_codecs(harness)
        codec = _TestCodec()
        writer = harness.make(codec=codec, decoders={codec.name: codec})
        plain = harness.make()
        try:
            (key,) = _keys(1)
            (value,) = self._payloads(harness, 1, seed=11)
            assert writer.put(key, value)
            out = np.zeros_like(value)
            assert writer.get_into(key, out) and np.array_equal(out, value)
            assert plain.get_into(key, out) is False
            assert plain.stats()["get_corrupt"] == 1
        finally:
            writer.clear()
            writer.close()
            plain.close()

    # -- removal ---------------------------------------------------------------------
    def test_delete_and_clear(self, tier: LowerTier, harness: TierHarness) -> None:
        keys = _keys(4)
        values = self._payloads(harness, 4, seed=12)
        assert all(tier.put_many(_writes(keys, values)))
        assert tier.delete_many(keys[:2] + _keys(1)) == 2
        assert tier.contains_many(keys) == [False, False, True, True]
        assert tier.clear() == 2
        assert tier.contains_many(keys) == [False] * 4

    def test_clear_removes_only_its_namespace(self, harness: TierHarness) -> None:
        """Two models share the store; each stores N chunks; clearing one removes exactly N."""
        a, b = harness.make(namespace=NS_A), harness.make(namespace=NS_B)
        try:
            n = 5
            ka, kb, shared = _keys(n), _keys(n - 1), _keys(1)
            ka[-1:] = shared  # the same chunk key in both namespaces is two chunks
            kb += shared
            va, vb = self._payloads(harness, n, seed=20), self._payloads(harness, n, seed=21)
            assert all(a.put_many(_writes(ka, va))) and all(b.put_many(_writes(kb, vb)))
            assert a.clear() == n
            assert a.contains_many(ka) == [False] * n
            outs = [np.zeros_like(v) for v in vb]
            assert b.get_many_into(list(zip(kb, outs))) == [True] * n
            assert all(np.array_equal(o, v) for o, v in zip(outs, vb))
            assert a.clear() == 0
        finally:
            for t in (a, b):
                t.clear()
                t.close()

    # -- prefix closure ------------------------------------------------------------------
    @pytest.mark.parametrize("capacity", [1, 2, 3, 5])
    def test_eviction_keeps_the_store_prefix_closed(self, harness: TierHarness, capacity: int) -> None:
        """Chains stored in order, tail first and shuffled through a tiny store: a chunk is
        never kept after its parent was dropped (eviction is leaf-first)."""
        if harness.make_bounded is None:
            pytest.skip("harness cannot bound this store")
        import random

        rng = random.Random(capacity)
        tier = harness.make_bounded(capacity)
        try:
            heads = _keys(4)
            parent_of: dict[bytes, bytes | None] = {}
            value = self._payloads(harness, 1, seed=22)[0]
            written = 0
            for c in range(16):
                chain = [heads[c % 4], *_keys(rng.randrange(0, 4))]
                order = list(range(len(chain)))
                if c % 3 == 1:
                    order.reverse()
                elif c % 3 == 2:
                    rng.shuffle(order)
                for i in order:
                    parent_of[chain[i]] = chain[i - 1] if i else None
                    known = list(parent_of)
                    before = {k for k, ok in zip(known, tier.contains_many(known)) if ok}
                    written += bool(tier.put_many([ChunkWrite(chain[i], parent_of[chain[i]], value)])[0])
                    after = {k for k, ok in zip(known, tier.contains_many(known)) if ok}
                    assert len(after) <= capacity
                    for k in after:
                        assert parent_of[k] not in before - after, "a chunk was kept after its parent was dropped"
                tier.touch_many([k for k in chain if k in parent_of])
            assert written > capacity  # eviction happened
        finally:
            tier.clear()
            tier.close()

    # -- API errors, concurrency, lifecycle ------------------------------------------------
    def test_programming_errors_raise_at_once(self, tier: LowerTier, harness: TierHarness) -> None:
        (key,) = _keys(1)
        with pytest.raises(TypeError):
            tier.contains_many(["not bytes"])  # type: ignore[list-item]
        with pytest.raises(ValueError):
            tier.get_into(key, bytes(harness.value_bytes))  # read-only destination
        with pytest.raises(ValueError):
            tier.put(b"", bytes(16))  # empty key

    def test_concurrent_threads(self, tier: LowerTier, harness: TierHarness) -> None:
        shared = _keys(4)
        shared_values = self._payloads(harness, 4, seed=13)
        errors: list[BaseException] = []

        def worker(seed: int) -> None:
            try:
                own = _keys(3)
                vals = self._payloads(harness, 3, seed=100 + seed)
                for round_ in range(4):
                    assert all(tier.put_many(_writes(own, vals)))
                    tier.put_many(_writes(shared, shared_values))
                    outs = [np.zeros_like(v) for v in vals]
                    assert tier.get_many_into(list(zip(own, outs))) == [True] * 3
                    for o, v in zip(outs, vals):
                        assert np.array_equal(o, v)
                    sh = [np.zeros_like(v) for v in shared_values]
                    got = tier.get_many_into(list(zip(shared, sh)))
                    for ok, o, v in zip(got, sh, shared_values):
                        assert not ok or np.array_equal(o, v)  # a hit is always whole and right
                    tier.touch_many(own)
                    if round_ == 2:
                        tier.delete_many(own[:1])
                        assert tier.contains_many(own[:1]) == [False]
                        assert tier.put(own[0], vals[0])
            except BaseException as exc:  # surfaced in the main thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert tier.stats()["get_corrupt"] == 0

    def test_closed_tier_misses(self, harness: TierHarness) -> None:
        tier = harness.make()
        (key,) = _keys(1)
        (value,) = self._payloads(harness, 1, seed=14)
        assert tier.put(key, value)
        tier.close()
        tier.close()  # idempotent
        assert tier.contains_many([key]) == [False]
        assert tier.get_into(key, np.zeros_like(value)) is False
        assert tier.put(key, value) is False
        tier.touch_many([key])
        other = harness.make()
        try:
            assert other.delete_many([key]) == 1
        finally:
            other.close()

    def test_stats_has_counters(self, tier: LowerTier) -> None:
        s = tier.stats()
        for name in TierCounters.__dataclass_fields__:
            assert isinstance(s[name], int), name
        assert tier.kind in ("disk", "remote", "peer")

    # -- failure of the backing store -------------------------------------------------------
    def test_store_unavailable_gives_misses_then_recovers(self, harness: TierHarness) -> None:
        if harness.break_store is None or harness.restore_store is None:
            pytest.skip("harness cannot make this backing store unavailable")
        tier = harness.make()
        try:
            keys = _keys(3)
            values = self._payloads(harness, 3, seed=15)
            assert all(tier.put_many(_writes(keys, values)))
            harness.break_store()
            try:
                outs = [np.zeros_like(v) for v in values]
                for _ in range(5):  # enough calls to open a circuit breaker, if any
                    assert tier.contains_many(keys) == [False] * 3
                    assert tier.get_many_into(list(zip(keys, outs))) == [False] * 3
                    assert tier.put_many(_writes(keys, values)) == [False] * 3
                    assert tier.delete_many(keys) == 0
                    tier.touch_many(keys)
                s = tier.stats()
                assert s["put_failed"] >= 15
            finally:
                harness.restore_store()
            # Back: writes and reads succeed again, without reopening the tier.
            deadline = time.monotonic() + harness.recovery_s
            while not tier.put(keys[0], values[0]):
                assert time.monotonic() < deadline, "tier did not recover after the store came back"
                time.sleep(0.05)
            out = np.zeros_like(values[0])
            assert tier.get_into(keys[0], out) and np.array_equal(out, values[0])
        finally:
            tier.clear()
            tier.close()

    def test_misses_do_not_raise_on_unreachable_store(self, harness: TierHarness) -> None:
        if harness.break_store is None or harness.restore_store is None:
            pytest.skip("harness cannot make this backing store unavailable")
        harness.break_store()
        try:
            tier = harness.make()  # opening a tier on a down store must not raise either
            (key,) = _keys(1)
            (value,) = self._payloads(harness, 1, seed=16)
            assert tier.put(key, value) is False
            assert tier.contains(key) is False
            assert tier.get_into(key, np.zeros_like(value)) is False
            assert tier.clear() == 0
            tier.close()
        finally:
            harness.restore_store()
