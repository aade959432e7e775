"""The tier-change reporting wrapper (kvtier.storage.reporting_tier) on its own.

Failing inputs: a tier that cannot report its own changes losing every store/remove/clear
made through it; a self-reporting tier reported twice; a failing inner tier reported as
having stored or removed chunks (a failing tier is a miss); a store that failed to answer
taken for one that answered "absent"; the wrapper breaking the lower-tier contract.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest

from kvtier.serde.base import Buffer
from kvtier.storage.reporting_tier import ReportingTier
from kvtier.testing import NS_A, MemoryStore, MemoryTier, TierContract, TierHarness
from kvtier.tiers.base import ChangeHook, ChunkWrite

VALUE_BYTES = 256 * 1024
Change = tuple[str, tuple[bytes, ...], tuple["bytes | None", ...]]


def recorder() -> tuple[list[Change], ChangeHook]:
    seen: list[Change] = []

    def hook(op: str, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        seen.append((op, tuple(keys), tuple(parents)))

    return seen, hook


class AnsweringTier(MemoryTier):
    """A memory tier whose store says which answers are its own (as Redis and fs do)."""

    def contains_many_known(self, keys: Sequence[bytes]) -> tuple[list[bool], list[bool]]:
        answered = not self.fail
        return self.contains_many(keys), [answered] * len(keys)


class SelfReportingTier(AnsweringTier):
    """A tier that reports its own stores (like the disk tier), to the hook it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.hook: ChangeHook | None = None

    def set_change_hook(self, hook: ChangeHook | None) -> bool:
        self.hook = hook
        return True

    def put_many(self, items: Sequence[ChunkWrite]) -> list[bool]:
        ok = super().put_many(items)
        if self.hook is not None:
            done = [w for w, good in zip(items, ok) if good]
            self.hook("s", [w.key for w in done], [w.parent for w in done])
        return ok


class BrokenTier(MemoryTier):
    """Every call raises (a plug-in bug or an unexpected library error), after checking its arguments."""

    def _boom(self) -> None:
        raise RuntimeError("store exploded")

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        self._boom()
        return []

    def put_many(self, items: Sequence[ChunkWrite]) -> list[bool]:
        for w in items:
            if not isinstance(w.key, bytes):
                raise TypeError("chunk keys are bytes")
        self._boom()
        return []

    def get_many_into(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        self._boom()
        return []

    def delete_many(self, keys: Sequence[bytes]) -> int:
        self._boom()
        return 0

    def clear(self) -> int:
        self._boom()
        return 0

    def touch_many(self, keys: Sequence[bytes]) -> None:
        self._boom()

    def set_change_hook(self, hook: ChangeHook | None) -> bool:
        self._boom()
        return False


def key(i: int) -> bytes:
    return bytes([i]) * 32


def writes(n: int, start: int = 0) -> list[ChunkWrite]:
    return [ChunkWrite(key(start + i), key(start + i - 1) if i else None, np.full(64, i, np.uint8))
            for i in range(n)]


class TestReportingTierContract(TierContract):
    """The wrapper keeps its inner tier's contract, also while it reports (and tracks)."""

    @pytest.fixture
    def harness(self) -> TierHarness:
        store = MemoryStore()

        def wrap(inner: MemoryTier) -> ReportingTier:
            tier = ReportingTier(inner)
            tier.set_change_hook(lambda op, keys, parents: None)
            return tier

        return TierHarness(
            make=lambda namespace=NS_A, **kw: wrap(AnsweringTier(store, namespace, **kw)),
            read_raw=lambda tier, k: tier.inner.raw(k),
            write_raw=lambda tier, k, data: tier.inner.set_raw(k, data),
            make_bounded=lambda capacity, **kw: wrap(AnsweringTier(MemoryStore(capacity), NS_A, **kw)),
            value_bytes=VALUE_BYTES,
        )


def test_takes_the_inner_tiers_labels() -> None:
    inner = MemoryTier(kind="peer")
    tier = ReportingTier(inner)
    assert (tier.name, tier.kind, tier.local, tier.location) == ("memory", "peer", False, inner.location)
    assert tier.touch_needed and tier.writable and tier.stats() == inner.stats()


def test_reports_what_is_stored_removed_and_cleared_through_it() -> None:
    tier = ReportingTier(MemoryTier())
    seen, hook = recorder()
    ws = writes(3)
    assert tier.put_many(ws) == [True] * 3
    assert seen == []  # nobody listens: nothing reported, nothing tracked
    assert tier.tracked == 0 and not tier.reporting
    assert tier.set_change_hook(hook) and tier.reporting
    assert tier.put_many(ws) == [True] * 3
    assert seen == [("s", (key(0), key(1), key(2)), (None, key(0), key(1)))]
    assert tier.delete_many([key(2)]) == 1
    assert tier.delete_many([]) == 0
    tier.clear()
    assert seen[1:] == [("r", (key(2),), ()), ("c", (), ())]
    assert tier.tracked == 0  # the clear forgot what was tracked
    tier.set_change_hook(None)
    tier.put_many(ws)
    assert len(seen) == 3


def test_a_refused_write_is_not_reported() -> None:
    inner = MemoryTier()
    tier = ReportingTier(inner)
    seen, hook = recorder()
    tier.set_change_hook(hook)
    inner.fail = True
    assert tier.put_many(writes(2)) == [False, False]
    assert seen == [] and tier.tracked == 0


def test_a_self_reporting_tier_is_passed_through_once() -> None:
    inner = SelfReportingTier()
    tier = ReportingTier(inner)
    seen, hook = recorder()
    tier.set_change_hook(hook)
    tier.put_many(writes(2))
    assert seen == [("s", (key(0), key(1)), (None, key(0)))]  # the tier's own report, not a second one
    assert tier.tracked == 2  # its own reports are tracked too (a non-local tier)
    tier.delete_many([key(1)])  # this tier does not report deletes: nothing from the wrapper either
    assert len(seen) == 1
    tier.set_change_hook(None)
    assert inner.hook is None and tier.tracked == 0


def test_an_answered_absence_of_a_stored_key_is_reported_removed_once() -> None:
    inner = AnsweringTier()
    tier = ReportingTier(inner)
    seen, hook = recorder()
    tier.set_change_hook(hook)
    tier.put_many(writes(3))
    inner.delete_many([key(1), key(2)])  # the store drops two by itself (eviction, expiry, restart)
    assert tier.contains_many([key(0), key(1), key(2), key(9)]) == [True, False, False, False]
    assert seen[1:] == [("r", (key(1), key(2)), ())]  # key(9) was never reported stored: nothing
    assert tier.stale_forgotten == 2
    assert tier.contains_many_known([key(1)]) == ([False], [True])
    assert len(seen) == 2  # once


def test_a_store_that_fails_to_answer_is_not_taken_for_absent() -> None:
    inner = AnsweringTier()
    tier = ReportingTier(inner)
    seen, hook = recorder()
    tier.set_change_hook(hook)
    tier.put_many(writes(2))
    inner.fail = True
    assert tier.contains_many([key(0), key(1)]) == [False, False]
    assert seen[1:] == [] and tier.stale_forgotten == 0 and tier.tracked == 2


def test_a_local_tier_is_not_tracked() -> None:
    inner = AnsweringTier(kind="disk")
    inner.local = True
    tier = ReportingTier(inner)
    seen, hook = recorder()
    tier.set_change_hook(hook)
    tier.put_many(writes(2))
    inner.delete_many([key(1)])
    assert tier.contains_many([key(1)]) == [False]
    assert tier.tracked == 0 and [op for op, _, _ in seen] == ["s"]


def test_a_failing_inner_tier_is_a_miss_and_reports_nothing(caplog: pytest.LogCaptureFixture) -> None:
    tier = ReportingTier(BrokenTier())
    seen, hook = recorder()
    assert tier.set_change_hook(hook)  # the inner tier's refusal (it raised) means the wrapper reports
    ws = writes(2)
    out = np.empty(64, np.uint8)
    assert tier.put_many(ws) == [False, False]
    assert tier.contains_many([key(0)]) == [False]
    assert tier.contains_many_known([key(0)]) == ([False], [False])
    assert tier.get_many_into([(key(0), out)]) == [False]
    assert tier.delete_many([key(0)]) == 0
    assert tier.clear() == 0
    tier.touch_many([key(0)])
    assert seen == [] and tier.tracked == 0 and tier.stale_forgotten == 0
    assert "store exploded" in caplog.text
    with pytest.raises(TypeError):  # a programming error is raised, not taken for a miss
        tier.put_many([ChunkWrite("k", None, b"x")])  # type: ignore[arg-type]


def test_a_hook_that_raises_never_reaches_the_caller() -> None:
    tier = ReportingTier(MemoryTier())

    def broken(op: str, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        raise RuntimeError("listener bug")

    tier.set_change_hook(broken)
    assert tier.put_many(writes(1)) == [True]
    assert tier.delete_many([key(0)]) == 1


def test_a_manager_over_a_failing_remote_tier_reports_no_remote_change() -> None:
    """Write-behind, a lookup, a delete and a clear through the manager: the CPU tier reports, the
    failing tier is a miss everywhere and reports nothing stored or removed."""
    from conftest import CHUNK, small_namespace
    from kvtier.config import KVTierConfig
    from kvtier.storage.instance_ops import InstanceOps
    from kvtier.storage.manager import StorageManager
    from kvtier.storage.tier_events import TierChange

    ns = small_namespace()
    broken = BrokenTier(kind="remote")
    mgr = StorageManager(KVTierConfig(chunk_size=CHUNK, cpu_capacity=4 * ns.chunk_bytes), ns, lower=[broken])
    seen: list[TierChange] = []
    mgr.subscribe(seen.append)
    try:
        toks = list(range(2 * CHUNK + 1))
        keys = mgr.keys(toks)
        for i, k in enumerate(keys):
            buf = mgr.open_write(k, keys[i - 1] if i else None)
            assert buf is not None
            buf[:] = 7
            mgr.commit(k, keys[i - 1] if i else None)
        assert mgr.flush(10)
        InstanceOps(mgr).clear("cpu")
        assert mgr.lookup(toks).num_tokens == 0
        InstanceOps(mgr).delete(keys, None)
        InstanceOps(mgr).clear(None)
        assert [c.op for c in seen if c.tier == "cpu"][:2] == ["s", "s"]
        assert [c for c in seen if c.tier == "remote"] == []
    finally:
        mgr.close()
