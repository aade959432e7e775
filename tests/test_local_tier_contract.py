"""The remote tier contract kit (kvtier.testing) run on kvtier's CPU and disk tiers.

Both tiers have their own engine-facing API; kvtier.testing.local_adapters puts
them behind the RemoteTier interface. The store-failure tests of the kit skip
here (no harness to take DRAM away; the disk tier's failure modes are covered by
tests/test_disk_faults.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.testing import TierContract, TierHarness
from kvtier.testing.local_adapters import CpuSlots, DiskSlots, LocalTierAdapter
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import DiskTier

VALUE_BYTES = 256 * 1024
SLOT_BYTES = VALUE_BYTES + 4096  # room for the envelope header and the frame's length


def _harness(make_adapter) -> TierHarness:
    probe = make_adapter()
    return TierHarness(
        make=lambda **kw: make_adapter(**kw),
        read_raw=probe.read_stored,
        write_raw=lambda key, data: probe.write_stored(key, data),
        value_bytes=VALUE_BYTES,
    )


class TestCpuTierContract(TierContract):
    @pytest.fixture
    def harness(self) -> TierHarness:
        slots = CpuSlots(CpuTier(SLOT_BYTES, 64 * SLOT_BYTES))
        return _harness(lambda **kw: LocalTierAdapter(slots, **kw))


class TestDiskTierContract(TierContract):
    @pytest.fixture
    def harness(self, tmp_path: Path):
        disk = DiskTier(tmp_path / "disk", 64 * (SLOT_BYTES + 4096), b"n" * 32)
        slots = DiskSlots(disk, SLOT_BYTES)
        yield _harness(lambda **kw: LocalTierAdapter(slots, **kw))
        disk.close()
