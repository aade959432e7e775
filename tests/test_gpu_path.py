"""The device-agnostic parts of the vLLM GPU path, on CPU tensors (kvtier.integrations.vllm.gpu).

KV tensors are built for every vLLM 0.32 ``KVCacheLayout`` by ``paged_kv`` (no vLLM
needed, so these tests run on the GPU check machine); ``test_layouts_equal_vllms_own``
checks, where vLLM is installed, that they are exactly the views vLLM allocates.
Tests marked ``cuda`` need a CUDA device and skip with a reason without one.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.integrations.vllm.gpu.gather import ChunkGather, gather, plan_chunks, scatter
from kvtier.integrations.vllm.gpu.layerwise import ChunkJob, LayerwiseLoader, LayerwiseSaver
from kvtier.integrations.vllm.gpu.layout import RegisteredKV, UnsupportedKVLayout, check_namespace, register_kv
from kvtier.integrations.vllm.gpu.streams import SyncStream
from kvtier.integrations.vllm.gpu.layout import KV_LAYOUTS
from kvtier.memory.pool import ChunkPool
from paged_kv import LAYOUTS, paged_kv

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
vllm_kv = paged_kv  # the layouts vLLM 0.32 allocates, built without vLLM (see test_layouts_equal_vllms_own)


def test_layouts_equal_vllms_own() -> None:
    """kvtier's layout table and the tests' paged views are exactly what vLLM 0.32 allocates
    (a vLLM-specific check: it skips where vLLM is not installed, e.g. on the GPU check machine)."""
    pytest.importorskip("vllm", reason="vLLM is not installed: the layout table is checked against it where it is")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, compute_layout_strides, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert {m.name: tuple(m.stride_order) for m in KVCacheLayout} == KV_LAYOUTS
    L, B, H, N, D = 3, 9, 2, 4, 8
    for lay in KVCacheLayout:
        spec = FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
        bstride = spec.page_size_bytes * L if lay.is_block_outermost else None
        ls, bs, *_ = compute_layout_strides(spec, B, L, lay, fixed_strides=(None, bstride, None, None, None))
        raw = torch.zeros(L * B * spec.page_size_bytes, dtype=torch.int8)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
        theirs = create_kv_cache_views(raw, spec, B, lay, KVCacheTensor(size=raw.numel(), layers=names, layer_stride=ls, block_stride=bs))
        ours = paged_kv(lay.name, L, B, H, N, D)
        for t, o in zip(theirs, ours.values()):
            assert (t.dtype, tuple(t.shape), t.stride(), t.storage_offset()) == (o.dtype, tuple(o.shape), o.stride(), o.storage_offset()), lay.name


def naive_block(kv: RegisteredKV, layer: int, block: int) -> bytes:
    """A block's bytes in logical [H, N, C] order, element by element from the layer view."""
    v = kv.layers[layer][block]
    return bytes(v[h, n, c].item() & 0xFF for h in range(v.shape[0]) for n in range(v.shape[1]) for c in range(v.shape[2]))


# -- layout detection ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_vllm_layout_registers_with_its_geometry(layout: str) -> None:
    kv = register_kv(vllm_kv(layout), layout, "FLASH_ATTN")
    assert (kv.layout.num_layers, kv.layout.num_blocks, kv.layout.heads, kv.layout.tokens) == (3, 9, 2, 4)
    assert kv.layout.content_bytes == 2 * 8 * 2 and kv.layout.page_bytes == 2 * 4 * 32
    assert kv.layout.tag == f"FLASH_ATTN/{layout}" and kv.stacked is not None
    for i in range(3):  # the stacked view is the same memory as each layer view
        assert torch.equal(kv.stacked[i], kv.layers[i])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_layout_declared_wrongly_is_rejected(layout: str) -> None:
    tensors = vllm_kv(layout)
    def view_order(name: str) -> tuple[int, ...]:  # physical order of a layer's [B, H, N, C] view
        return tuple(d - 1 for d in KV_LAYOUTS[name] if d != 0)

    wrong = [o for o in LAYOUTS if view_order(o) != view_order(layout)]
    assert wrong
    for other in wrong:
        with pytest.raises(UnsupportedKVLayout, match="physical order"):
            register_kv(tensors, other, "FLASH_ATTN")


def test_unknown_layouts_and_shapes_are_clear_errors() -> None:
    tensors = vllm_kv("LBHNC")
    with pytest.raises(UnsupportedKVLayout, match="unknown KV cache layout 'NHD'"):
        register_kv(tensors, "NHD", "FLASH_ATTN")
    with pytest.raises(UnsupportedKVLayout, match="expected 4D"):
        register_kv({k: v.flatten(0, 1) for k, v in tensors.items()}, "LBHNC", "FLASH_ATTN")
    with pytest.raises(UnsupportedKVLayout, match="content axis"):
        register_kv({k: v.transpose(2, 3) for k, v in tensors.items()}, "LBHNC", "FLASH_ATTN")
    mixed = dict(tensors)
    mixed["extra"] = torch.zeros(9, 2, 4, 16, dtype=torch.float16)
    with pytest.raises(UnsupportedKVLayout, match="differ"):
        register_kv(mixed, "LBHNC", "FLASH_ATTN")
    with pytest.raises(UnsupportedKVLayout, match="no KV cache layers"):
        register_kv({}, "LBHNC", "FLASH_ATTN")


def test_namespace_mismatch_is_rejected() -> None:
    kv = register_kv(vllm_kv("BLHNC"), "BLHNC", "FLASHINFER")
    check_namespace(kv, "cuda/FLASHINFER", "BLHNC", 256)
    with pytest.raises(UnsupportedKVLayout, match="layout"):
        check_namespace(kv, "cuda/FLASHINFER", "LBHNC", 256)
    with pytest.raises(UnsupportedKVLayout, match="backend"):
        check_namespace(kv, "cuda/FLASH_ATTN", "BLHNC", 256)
    with pytest.raises(UnsupportedKVLayout, match="256 B"):
        check_namespace(kv, "cuda/FLASHINFER", "BLHNC", 512)


def test_separate_allocations_have_no_stacked_view() -> None:
    tensors = {f"l{i}": torch.zeros(5, 2, 4, 16, dtype=torch.bfloat16) for i in range(2)}
    kv = register_kv(tensors, "LBHNC", "X")
    assert kv.stacked is None and kv.layer_index("l1") == 1
    with pytest.raises(KeyError):
        kv.layer_index("nope")


# -- gather planning ----------------------------------------------------------------------------
def naive_plan(block_ids: list[int], chunk: int, bs: int, n: int, first: int) -> list[tuple[int, tuple[int, ...], int]]:
    out = []
    bpc = chunk // bs
    for t in range(0, n - n % chunk, chunk):  # token by token: which chunk, which block, which slot position
        c = t // chunk
        pairs = [(pos, block_ids[c * bpc + pos]) for pos in range(bpc) if (c * bpc + pos) * bs >= first]
        if pairs:
            out.append((c, tuple(b for _, b in pairs), pairs[0][0]))
    return out


@settings(max_examples=200, deadline=None)
@given(bs=st.sampled_from([1, 2, 4, 16]), bpc=st.integers(1, 4), nblocks=st.integers(0, 12),
       extra=st.integers(0, 3), first_blocks=st.integers(0, 12), seed=st.integers(0, 10**6))
def test_plan_chunks_matches_a_naive_plan(bs: int, bpc: int, nblocks: int, extra: int, first_blocks: int, seed: int) -> None:
    ids = np.random.default_rng(seed).permutation(100)[:nblocks].tolist()
    n = max(0, nblocks * bs - extra)
    first = min(first_blocks, nblocks) * bs
    plan = plan_chunks(ids, bpc * bs, bs, n, first)
    assert [(g.chunk, g.block_ids, g.offset) for g in plan] == naive_plan(ids, bpc * bs, bs, n, first)


def test_plan_chunks_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="multiple of block_size"):
        plan_chunks([0, 1], 24, 16, 32)
    with pytest.raises(ValueError, match="first_token"):
        plan_chunks([0, 1], 32, 16, 32, first_token=8)
    with pytest.raises(ValueError, match="cannot hold"):
        plan_chunks([0], 32, 16, 32)
    with pytest.raises(ValueError, match="duplicate"):
        plan_chunks([3, 3], 32, 16, 32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("use_stacked", [True, False])
def test_gather_and_scatter_match_a_naive_loop(layout: str, use_stacked: bool) -> None:
    kv = register_kv(vllm_kv(layout), layout, "X")
    stacked = kv.stacked if use_stacked else None
    ids = torch.tensor([7, 0, 4])
    out = torch.zeros(3, 3, kv.layout.page_bytes, dtype=torch.uint8)
    gather(kv.layers, stacked, ids, out)
    for li in range(3):
        for j, b in enumerate(ids.tolist()):
            assert bytes(out[li, j].tolist()) == naive_block(kv, li, b)
    # scatter into a fresh engine of the same layout: exactly those blocks change, to those bytes
    dst = register_kv(vllm_kv(layout, seed=1), layout, "X")
    before = [t.clone() for t in dst.layers]
    scatter(out, dst.layers, dst.stacked if use_stacked else None, torch.tensor([2, 8, 5]))
    for li in range(3):
        for b in range(9):
            if b in (2, 8, 5):
                assert naive_block(dst, li, b) == bytes(out[li, [2, 8, 5].index(b)].tolist())
            else:
                assert torch.equal(dst.layers[li][b], before[li][b])


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), ids=st.lists(st.integers(0, 8), min_size=1, max_size=9, unique=True))
def test_gather_then_scatter_round_trips(layout: str, ids: list[int]) -> None:
    src = register_kv(vllm_kv(layout, seed=2), layout, "X")
    dst = register_kv(vllm_kv(layout, seed=3), layout, "X")
    idx = torch.tensor(ids)
    buf = torch.empty(3, len(ids), src.layout.page_bytes, dtype=torch.uint8)
    gather(src.layers, None, idx, buf)
    scatter(buf, dst.layers, dst.stacked, idx)
    for li in range(3):
        assert torch.equal(dst.layers[li][idx], src.layers[li][idx])


def test_chunk_gather_index_is_int64_on_the_device() -> None:
    idx = ChunkGather(0, (3, 1)).index("cpu")
    assert idx.dtype == torch.int64 and idx.tolist() == [3, 1]


# -- layer-wise ordering ------------------------------------------------------------------------
class FakeStream:
    """A copy stream that defers its work: an event's block_compute/synchronize runs the queue up to it."""

    def __init__(self) -> None:
        self.queue: list[Callable[[], None]] = []
        self.done = 0  # work items executed
        self.log: list[str] = []

    def run(self, work: Callable[[], None]) -> None:
        self.queue.append(work)
        self.log.append(f"run{len(self.queue)}")

    def wait_compute(self) -> None:
        self.log.append("wait_compute")

    def _drain(self, upto: int) -> None:
        while self.done < upto:
            self.queue[self.done]()
            self.done += 1

    def record(self) -> "FakeEvent":
        self.log.append(f"record{len(self.queue)}")
        return FakeEvent(self, len(self.queue))


class FakeEvent:
    def __init__(self, stream: FakeStream, upto: int):
        self.stream, self.upto = stream, upto

    def block_compute(self) -> None:
        self.stream.log.append(f"compute_waits{self.upto}")
        self.stream._drain(self.upto)

    def synchronize(self) -> None:
        self.stream.log.append(f"host_waits{self.upto}")
        self.stream._drain(self.upto)


def _slot(kv: RegisteredKV, bpc: int, fill: int) -> torch.Tensor:
    return torch.full((kv.layout.num_layers, bpc, kv.layout.page_bytes), fill, dtype=torch.uint8)


def test_layer_i_is_loaded_before_its_attention_while_later_layers_still_copy() -> None:
    kv = register_kv(vllm_kv("LBHNC"), "LBHNC", "X")
    stream = FakeStream()
    loader = LayerwiseLoader(kv, stream)
    slot = _slot(kv, 2, 0)
    for li in range(3):
        slot[li] = li + 1
    loader.start([ChunkJob(slot, (5, 6), 0)])
    names = kv.names
    assert all(not bool((kv.layers[li][5] == li + 1).all()) for li in range(3))  # nothing copied yet
    loader.wait_for_layer_load(names[0])
    assert bool((kv.layers[0][[5, 6]] == 1).all())
    assert not bool((kv.layers[1][5] == 2).all()) and not bool((kv.layers[2][5] == 3).all())  # still in flight
    loader.wait_for_layer_load(names[1])
    assert bool((kv.layers[1][[5, 6]] == 2).all()) and not bool((kv.layers[2][5] == 3).all())
    loader.wait_for_layer_load(names[1])  # a second wait, or a layer kvtier never loaded, is a no-op
    loader.wait_for_layer_load("model.layers.99.attn")
    assert loader.pending
    loader.finish()
    assert bool((kv.layers[2][[5, 6]] == 3).all()) and not loader.pending
    # after the compute stream's earlier work; each layer's event recorded right after that layer's copies
    assert stream.log[:9] == ["wait_compute", "run1", "run2", "record2", "run3", "record3", "run4", "record4", "record4"]


def test_loader_refuses_to_start_twice_and_checks_ids() -> None:
    kv = register_kv(vllm_kv("LBHNC"), "LBHNC", "X")
    loader = LayerwiseLoader(kv, FakeStream())
    loader.start([ChunkJob(_slot(kv, 2, 1), (1,), 1)])
    with pytest.raises(RuntimeError, match="before finish"):
        loader.start([ChunkJob(_slot(kv, 2, 1), (2,), 0)])
    loader.finish()
    with pytest.raises(IndexError):
        loader.start([ChunkJob(_slot(kv, 2, 1), (9,), 0)])
    with pytest.raises(ValueError, match="duplicate"):
        loader.start([ChunkJob(_slot(kv, 2, 1), (3, 3), 0)])
    with pytest.raises(ValueError, match="outside the slot"):
        loader.start([ChunkJob(_slot(kv, 2, 1), (3, 4), 1)])
    assert not loader.pending


def test_saver_copies_each_layer_after_its_compute_and_finishes_the_rest() -> None:
    kv = register_kv(vllm_kv("BLHNC"), "BLHNC", "X")
    stream = FakeStream()
    saver = LayerwiseSaver(kv, stream)
    slot = _slot(kv, 2, 0)
    saver.start([ChunkJob(slot, (4, 2))])
    saver.save_layer(kv.names[1])
    assert stream.log[-2:] == ["wait_compute", "run2"]  # ordered after the compute stream's work
    saver.save_layer(kv.names[1])  # twice: one copy
    assert stream.done == 0 and not bool(slot.any())  # not executed until the host waits
    saver.finish()  # layers 0 and 2 were never reported: copied now, then the host waits
    assert stream.log.count("wait_compute") == 3 and stream.log[-1].startswith("host_waits")
    for li in range(3):
        for j, b in enumerate((4, 2)):
            assert bytes(slot[li, j].tolist()) == naive_block(kv, li, b)
    assert not saver.pending


def test_sync_stream_gives_the_same_result_without_deferral() -> None:
    kv = register_kv(vllm_kv("LHBNC"), "LHBNC", "X")
    loader = LayerwiseLoader(kv, SyncStream())
    slot = _slot(kv, 2, 7)
    loader.start([ChunkJob(slot, (0, 8))])
    assert all(bool((layer[[0, 8]] == 7).all()) for layer in kv.layers)  # copied at start on CPU
    loader.finish()


# -- pinned host pool ---------------------------------------------------------------------------
def test_pool_is_not_pinned_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the default pins (see test_pool_is_pinned_with_cuda)")
    pool = ChunkPool(4096, 2)
    assert not pool.pinned and ChunkPool(4096, 2, pin_memory=False).pinned is False
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        ChunkPool(4096, 2, pin_memory=True)


@pytest.mark.cuda
@needs_cuda
def test_pool_is_pinned_with_cuda() -> None:
    pool = ChunkPool(4096, 4)
    assert pool.pinned
    view = torch.from_numpy(pool.view(1))
    assert view.is_pinned() and pool.view(1).ctypes.data % 4096 == 0


# -- CUDA (skipped without a device) ------------------------------------------------------------
@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layerwise_load_and_save_on_cuda(layout: str) -> None:
    """Real CudaStream + events: pinned slots -> GPU blocks layer by layer, then GPU blocks -> slots."""
    from kvtier.integrations.vllm.gpu.streams import CudaStream

    kv = register_kv(vllm_kv(layout, device="cuda"), layout, "X")
    stream = CudaStream(kv.device)
    slot = _slot(kv, 2, 0).pin_memory()
    for li in range(3):
        slot[li] = 10 + li
    loader = LayerwiseLoader(kv, stream)
    loader.start([ChunkJob(slot, (3, 7))])
    for name in kv.names:
        loader.wait_for_layer_load(name)
    loader.finish()
    for li in range(3):
        assert bool((kv.layers[li][[3, 7]] == 10 + li).all())
    out = _slot(kv, 2, 0).pin_memory()
    saver = LayerwiseSaver(kv, stream)
    saver.start([ChunkJob(out, (7, 3))])
    saver.save_layer(kv.names[0])
    saver.finish()
    assert torch.equal(out, slot)  # (7, 3) hold the same bytes as (3, 7) did


@pytest.mark.cuda
@needs_cuda
def test_gather_on_cuda_matches_cpu() -> None:
    cpu = register_kv(vllm_kv("BLHNC", seed=9), "BLHNC", "X")
    gpu = register_kv(vllm_kv("BLHNC", seed=9, device="cuda"), "BLHNC", "X")
    ids = [8, 1, 4]
    a = torch.empty(3, 3, cpu.layout.page_bytes, dtype=torch.uint8)
    b = torch.empty_like(a).pin_memory()
    gather(cpu.layers, cpu.stacked, torch.tensor(ids), a)
    gather(gpu.layers, gpu.stacked, torch.tensor(ids, device="cuda"), b)
    torch.cuda.synchronize()
    assert torch.equal(a, b)
