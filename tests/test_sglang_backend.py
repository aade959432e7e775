"""Contract suite of kvtier's SGLang HiCache storage backend, driven by a fake host pool
built like SGLang's ``MHATokenToKVPoolHost`` (``layer_first`` and ``page_first`` layouts).

SGLang is not installed here: the check against SGLang's own abstract base class runs
only where ``sglang`` imports.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.integrations.sglang import KVTierHiCacheStorage, PageKeys, namespace_for_pool

PAGE = 16
LAYERS, HEADS, DIM = 2, 2, 8


@dataclass
class FakeStorageConfig:
    """Field names of SGLang's ``HiCacheStorageConfig``."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = False
    model_name: str | None = "test/tiny"
    extra_config: dict | None = field(default_factory=dict)


class FakeHostPool:
    """An MHA host pool: ``kv_buffer`` is ``[2, L, size, H, D]`` (layer_first) or
    ``[size, 2, L, H, D]`` (page_first); pages are ``page_size`` consecutive token slots."""

    def __init__(self, layout: str = "layer_first", size: int = 8 * PAGE, dtype: torch.dtype = torch.bfloat16):
        self.layout, self.size, self.page_size, self.dtype = layout, size, PAGE, dtype
        self.layer_num, self.head_num, self.head_dim = LAYERS, HEADS, DIM
        shape = (2, LAYERS, size, HEADS, DIM) if layout == "layer_first" else (size, 2, LAYERS, HEADS, DIM)
        self.kv_buffer = torch.zeros(shape, dtype=dtype)

    def get_size_per_token(self) -> int:
        return 2 * LAYERS * HEADS * DIM * self.kv_buffer.element_size()

    def _slice(self, index: int) -> torch.Tensor:
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index : index + PAGE]
        return self.kv_buffer[index : index + PAGE]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._slice(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2 * LAYERS * PAGE * HEADS * DIM, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self._slice(index).copy_(data_page.reshape(self._slice(index).shape))

    def fill_page(self, index: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        self._slice(index).copy_(torch.randn(self._slice(index).shape, generator=g).to(self.dtype))
        return self.get_data_page(index).clone()


def indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).to(torch.int64)


def make_backend(tmp_path: Path, layout: str = "layer_first", disk: bool = False, **cfg: Any) -> tuple[KVTierHiCacheStorage, FakeHostPool]:
    settings: dict[str, Any] = {"cpu_capacity": "4MiB"}
    if disk:
        settings["disk_path"] = str(tmp_path / "disk")
    extra = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
             "class_name": "KVTierHiCacheStorage", "kvtier": settings}
    backend = KVTierHiCacheStorage(FakeStorageConfig(extra_config=extra, **cfg), {})
    pool = FakeHostPool(layout)
    backend.register_mem_pool_host(pool)
    return backend, pool


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_zero_copy_round_trip_and_prefix_count(tmp_path: Path, layout: str) -> None:
    b, pool = make_backend(tmp_path, layout)
    try:
        want = [pool.fill_page(p * PAGE, seed=p) for p in range(3)]
        keys = ["h0", "h1", "h2"]
        assert b.batch_set_v1(keys, indices([0, 1, 2])) == [True, True, True]
        assert b.batch_exists(keys + ["nope"]) == 3
        assert b.batch_exists(["nope"] + keys) == 0  # consecutive from the first
        assert b.exists("h1") and not b.exists("nope")
        pool.kv_buffer.zero_()
        assert b.batch_get_v1(["h2", "h0", "nope"], indices([5, 6, 7])) == [True, True, False]
        assert torch.equal(pool.get_data_page(5 * PAGE), want[2])
        assert torch.equal(pool.get_data_page(6 * PAGE), want[0])
        assert not pool.get_data_page(7 * PAGE).any()  # a miss leaves the slot alone
    finally:
        b.close()


def test_tensor_get_set(tmp_path: Path) -> None:
    b, pool = make_backend(tmp_path)
    try:
        page = pool.fill_page(0, seed=7)
        assert b.set("k", page) and b.batch_set(["a", "b"], [page * 2, page * 3])
        assert torch.equal(b.get("k"), page)
        target = pool.get_dummy_flat_data_page()
        assert b.get("a", target) is target and torch.equal(target, page * 2)
        got = b.batch_get(["b", "missing"], [pool.get_dummy_flat_data_page(), pool.get_dummy_flat_data_page()])
        assert torch.equal(got[0], page * 3) and got[1] is None
        assert b.get("k", torch.zeros(3, dtype=torch.bfloat16)) is None  # wrong size: no partial copy
        assert not b.set("bad", torch.zeros(5, dtype=torch.bfloat16))  # wrong size refused
        assert b.batch_exists(["bad"]) == 0
    finally:
        b.close()


def test_bad_indices_and_unregistered(tmp_path: Path) -> None:
    b, _pool = make_backend(tmp_path)
    try:
        assert b.batch_set_v1(["x"], torch.arange(PAGE - 1)) == [False]
        assert b.batch_get_v1(["x", "y"], indices([0])) == [False, False]
        assert b.batch_exists(["x"]) == 0
    finally:
        b.close()
    fresh = KVTierHiCacheStorage(FakeStorageConfig(), {})
    assert fresh.batch_exists(["x"]) == 0 and fresh.get("x") is None and not fresh.set("x", torch.zeros(4))
    assert fresh.counters["errors"] >= 3


def test_clear_and_stats(tmp_path: Path) -> None:
    b, pool = make_backend(tmp_path)
    try:
        pool.fill_page(0, seed=1)
        assert b.batch_set_v1(["p"], indices([0])) == [True]
        s = b.stats()
        assert s["set_stored"] == 1 and s["cpu_chunks"] == 1
        b.clear()
        assert b.batch_exists(["p"]) == 0 and b.stats()["cpu_chunks"] == 0
        assert b.get_stats() is None
    finally:
        b.close()


def test_pages_survive_restart_through_disk(tmp_path: Path) -> None:
    b, pool = make_backend(tmp_path, disk=True)
    want = pool.fill_page(2 * PAGE, seed=3)
    assert b.batch_set_v1(["d0"], indices([2])) == [True]
    b.close()  # flushes write-behind to disk
    b2, pool2 = make_backend(tmp_path, disk=True)
    try:
        assert b2.batch_exists(["d0"]) == 1
        assert b2.batch_get_v1(["d0"], indices([0])) == [True]
        assert torch.equal(pool2.get_data_page(0), want)
    finally:
        b2.close()


def test_namespace_keeps_model_layout_and_rank_apart(tmp_path: Path) -> None:
    pool = FakeHostPool()
    base = namespace_for_pool(pool, FakeStorageConfig())
    assert base.layout.engine == "sglang" and base.chunk_bytes == pool.get_dummy_flat_data_page().numel() * 2
    others = [
        namespace_for_pool(pool, FakeStorageConfig(tp_size=2, tp_rank=1)),
        namespace_for_pool(pool, FakeStorageConfig(model_name="other")),
        namespace_for_pool(FakeHostPool("page_first"), FakeStorageConfig()),
        namespace_for_pool(FakeHostPool(dtype=torch.float16), FakeStorageConfig()),
    ]
    key = PageKeys(base).key("abc")
    assert all(PageKeys(ns).key("abc") != key for ns in others)
    # MLA pages are shared by every TP rank.
    mla = [namespace_for_pool(pool, FakeStorageConfig(is_mla_model=True, tp_size=2, tp_rank=r)) for r in (0, 1)]
    assert PageKeys(mla[0]).key("abc") == PageKeys(mla[1]).key("abc")


def test_rejects_bad_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown kvtier HiCache extra_config"):
        KVTierHiCacheStorage(FakeStorageConfig(extra_config={"kvtire": {}}), {})
    with pytest.raises(ValueError):
        KVTierHiCacheStorage(FakeStorageConfig(extra_config={"kvtier": {"cpu_capacity": "lots"}}), {})
    small = FakeHostPool()
    small.page_size = 8
    with pytest.raises(ValueError, match="page-size"):
        KVTierHiCacheStorage(FakeStorageConfig(), {}).register_mem_pool_host(small)


def test_dynamic_backend_config_names_the_class() -> None:
    """The JSON SGLang's dynamic loader reads: module_path + class_name resolve to this class."""
    extra = json.loads('{"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang", '
                       '"class_name": "KVTierHiCacheStorage", "kvtier": {"cpu_capacity": "4MiB"}}')
    cls = getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
    assert cls is KVTierHiCacheStorage
    b = cls(FakeStorageConfig(extra_config=extra), {})  # SGLang calls cls(storage_config, kwargs)
    b.register_mem_pool_host(FakeHostPool())
    b.close()


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed here (it needs a GPU "
                    "build); the check against SGLang's HiCacheStorage ABC runs where it imports")
def test_against_sglang_abstract_base() -> None:  # pragma: no cover - needs sglang
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    assert issubclass(KVTierHiCacheStorage, HiCacheStorage)
    assert not getattr(KVTierHiCacheStorage, "__abstractmethods__", set())

