"""Test kit for remote tier implementations (requires pytest).

Third-party tiers prove they meet :class:`kvtier.tiers.base.RemoteTier` by
subclassing :class:`TierContract` in their own test suite and providing a
``harness`` fixture that returns a :class:`TierHarness`::

    from kvtier.testing import TierContract, TierHarness

    class TestMyTier(TierContract):
        @pytest.fixture
        def harness(self, tmp_path):
            return TierHarness(make=lambda **kw: MyTier(..., **kw), read_raw=..., write_raw=...)
"""

from kvtier.testing.contract import TierContract, TierHarness, bf16_payload

__all__ = ["TierContract", "TierHarness", "bf16_payload"]
