"""Test kit for lower-tier implementations (requires pytest).

Every :class:`kvtier.tiers.base.LowerTier` (kvtier's disk, fs and Redis tiers,
and third-party plug-ins) proves it keeps the interface's semantics by
subclassing :class:`TierContract` in its test suite and providing a ``harness``
fixture that returns a :class:`TierHarness`::

    from kvtier.testing import TierContract, TierHarness

    class TestMyTier(TierContract):
        @pytest.fixture
        def harness(self, tmp_path):
            return TierHarness(
                make=lambda **kw: MyTier(..., **kw),
                read_raw=lambda tier, key: ...,
                write_raw=lambda tier, key, data: ...,
            )

:class:`MemoryTier` (:mod:`kvtier.testing.memory_tier`) is an in-memory
reference implementation for tests.
"""

from kvtier.testing.contract import NS_A, NS_B, TierContract, TierHarness, bf16_payload
from kvtier.testing.memory_tier import MemoryStore, MemoryTier

__all__ = ["NS_A", "NS_B", "MemoryStore", "MemoryTier", "TierContract", "TierHarness", "bf16_payload"]
