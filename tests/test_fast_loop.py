"""The fast loop (README, "Development"): ``-m "not slow"`` leaves out every ``vllm`` test and the
long ones marked ``slow``; tests/conftest.py adds ``slow`` to every ``vllm`` test."""

from __future__ import annotations

import pytest

from conftest import pytest_collection_modifyitems


class _Item:
    """The part of a collected pytest item the hook uses."""

    def __init__(self, *markers: str) -> None:
        self.markers = set(markers)

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.markers else None

    def add_marker(self, marker: pytest.MarkDecorator) -> None:
        self.markers.add(marker.name)


def test_every_vllm_test_is_slow_so_the_fast_loop_leaves_it_out() -> None:
    items = [_Item("vllm"), _Item(), _Item("slow"), _Item("vllm", "slow"), _Item("cuda")]
    pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert [sorted(i.markers) for i in items] == [["slow", "vllm"], [], ["slow"], ["slow", "vllm"], ["cuda"]]


def test_the_slow_marker_is_registered(pytestconfig: pytest.Config) -> None:
    """An unregistered marker would only warn; ``-m "not slow"`` would then select by a typo."""
    assert any(m.startswith("slow:") for m in pytestconfig.getini("markers"))
