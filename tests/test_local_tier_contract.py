"""The lower-tier contract kit (kvtier.testing) run on the disk tier and the in-memory reference tier.

The store-failure tests of the kit skip here (no harness to take the disk away;
the disk tier's failure modes are covered by tests/test_disk_faults.py).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kvtier.testing import NS_A, MemoryStore, MemoryTier, TierContract, TierHarness
from kvtier.tiers.disk import HEADER_BYTES, DiskTier

VALUE_BYTES = 256 * 1024


class TestMemoryTierContract(TierContract):
    @pytest.fixture
    def harness(self) -> TierHarness:
        store = MemoryStore()
        return TierHarness(
            make=lambda namespace=NS_A, **kw: MemoryTier(store, namespace, **kw),
            read_raw=lambda tier, key: tier.raw(key),
            write_raw=lambda tier, key, data: tier.set_raw(key, data),
            make_bounded=lambda capacity, **kw: MemoryTier(MemoryStore(capacity), NS_A, **kw),
            value_bytes=VALUE_BYTES,
        )


class TestDiskTierContract(TierContract):
    """One directory per namespace (a disk tier owns its directory); codecs are not a disk option."""

    @pytest.fixture
    def harness(self, tmp_path: Path) -> TierHarness:
        counter = itertools.count()

        def make(namespace: bytes = NS_A) -> DiskTier:
            return DiskTier(tmp_path / namespace.hex()[:8], 64 * (HEADER_BYTES + VALUE_BYTES), namespace)

        def make_bounded(capacity: int) -> DiskTier:
            return DiskTier(tmp_path / f"bounded-{next(counter)}", capacity * (HEADER_BYTES + VALUE_BYTES), NS_A)

        def write_raw(tier, key: bytes, data: bytes) -> None:
            tier.file_of(key).write_bytes(data)

        def read_raw(tier, key: bytes) -> bytes | None:
            f = tier.file_of(key)
            return f.read_bytes() if f.exists() else None

        return TierHarness(
            make=make,
            read_raw=read_raw,
            write_raw=write_raw,
            make_bounded=make_bounded,
            value_bytes=VALUE_BYTES,
            codecs=False,
        )
