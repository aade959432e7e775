"""Tier discovery through the ``kvtier.tiers`` entry-point group."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import pytest

from kvtier.tiers import registry
from kvtier.tiers.fs_tier import FsTier
from kvtier.tiers.redis_tier import RedisTier
from kvtier.tiers.registry import BUILTIN_TIERS, ENTRY_POINT_GROUP, available_tiers, open_tier


def test_builtins_are_registered_as_entry_points():
    names = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if not names:
        pytest.skip("kvtier is not installed (pip install -e .): no package metadata")
    assert set(BUILTIN_TIERS) <= names


def test_open_by_scheme_and_by_name(tmp_path: Path):
    t = open_tier(f"fs://{tmp_path}")
    assert isinstance(t, FsTier)
    assert isinstance(open_tier("fs", root=tmp_path), FsTier)
    for url in ("redis://127.0.0.1:1/0", "rediss://127.0.0.1:1", "unix:///tmp/none.sock", "redis+cluster://127.0.0.1:1"):
        r = open_tier(url, timeout_s=0.2)  # opening contacts nothing
        assert isinstance(r, RedisTier)
        r.close()
    assert open_tier("redis+cluster://127.0.0.1:1").cluster


def test_unknown_scheme_lists_the_known_ones():
    with pytest.raises(ValueError, match="available: .*fs.*redis"):
        open_tier("s3://bucket/x")


class _PluginTier(FsTier):
    name = "plugin"
    schemes = ("plugin",)

    @classmethod
    def from_url(cls, url: str, **options):
        return cls(options.pop("root"), **options)


def test_third_party_entry_point_is_found(monkeypatch, tmp_path: Path):
    ep = EntryPoint(name="plugin", value=f"{__name__}:_PluginTier", group=ENTRY_POINT_GROUP)
    not_a_tier = EntryPoint(name="bogus", value="os.path:join", group=ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep, not_a_tier] if group == ENTRY_POINT_GROUP else [])
    assert "plugin" in available_tiers() and "redis" in available_tiers()
    assert isinstance(open_tier("plugin://x", root=tmp_path), _PluginTier)
    with pytest.raises(ValueError, match="not a LowerTier"):
        open_tier("bogus")
