"""The worker's torch (GPU) path driven by the fake vLLM engine on CPU tensors.

``register_kv_caches(..., torch_path=True)`` makes the worker use
:mod:`kvtier.integrations.vllm.gpu` (layer-wise loader/saver over a synchronous
stream) exactly as it does for CUDA KV; the fake engine checks every loaded
block against the KV it should hold. (The fake engine reads KV through numpy
views of CPU memory, so the CUDA variant is the vLLM TTFT demo of scripts/gpu-check.sh.)
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import pytest

from fake_vllm import ConnectorPair, FakeEngine, Knobs, make_connectors
from test_connector_lifecycle import GEOM, assert_quiescent, extra_config, prompt_set, tokens_of


@pytest.fixture
def torch_pair() -> Iterator[Any]:
    made: list[ConnectorPair] = []

    def make(extra: dict[str, Any], kv_layout: str = "stacked") -> ConnectorPair:
        pair = make_connectors(GEOM, extra, engine_id=f"gpu-path-{uuid.uuid4().hex[:12]}", kv_layout=kv_layout)
        pair.worker.worker.register_kv_caches(pair.kv_caches, torch_path=True)
        assert pair.worker.worker._torch is not None, "the torch path was not taken"
        made.append(pair)
        return pair

    yield make
    for p in made:
        p.shutdown()


class LayerwiseEngine(FakeEngine):
    """The fake engine, calling the layer-wise hooks as vLLM's attention layers do: each layer
    waits for its load before the batch's forward, and reports its save after it."""

    def _execute(self, so: Any, scheduled: Any) -> Any:
        w = self.worker
        names = list(self.pair.kv_caches)
        orig_write, orig_wait_for_save = self.write, w.wait_for_save
        waited: list[bool] = []

        def write(r: Any, start: int, end: int, values: Any) -> None:
            if not waited:  # the forward's first layer-wise hook of this step
                waited.append(True)
                for name in names:
                    w.wait_for_layer_load(name)
            orig_write(r, start, end, values)

        def wait_for_save() -> None:  # after the whole batch's forward: each layer reports its save
            for name in names:
                w.save_kv_layer(name, self.pair.kv_caches[name], None)
            orig_wait_for_save()

        self.write, w.wait_for_save = write, wait_for_save  # type: ignore[method-assign]
        try:
            return super()._execute(so, scheduled)
        finally:
            self.write, w.wait_for_save = orig_write, orig_wait_for_save  # type: ignore[method-assign]


@pytest.mark.slow
@pytest.mark.parametrize(("kv_layout", "disk", "engine_cls"), [
    ("stacked", False, FakeEngine), ("separate", True, LayerwiseEngine), ("stacked", True, LayerwiseEngine)])
def test_stress_torch_path(torch_pair, tmp_path, kv_layout: str, disk: bool, engine_cls: type) -> None:
    """Sync loads (layer-wise), async loads (disk hits: whole-chunk copies on the loader thread), saves."""
    extra = extra_config(cpu_chunks=4, disk_dir=tmp_path / "disk", disk_chunks=12) if disk else extra_config(cpu_chunks=6)
    pair = torch_pair(extra, kv_layout=kv_layout)
    prompts, weights = prompt_set(21)
    eng = engine_cls(pair, GEOM, prompts, seed=21, weights=weights)
    eng.pair = pair
    eng.run(1_500, max_steps=30_000)
    assert_quiescent(pair)
    s = eng.stats
    assert s.loads > 50 and s.loaded_blocks_verified > 300, s  # loads happened and were checked block by block
    assert s.error_blocks == 0 and pair.scheduler.scheduler.ledger.load_failures_total == 0
    assert (s.async_loads > 0) == disk, s


def test_torch_path_chunks_are_byte_identical_to_the_numpy_path(torch_pair) -> None:
    """A chunk saved by the torch path loads correctly through the CPU (numpy) path, and back."""
    extra = extra_config(cpu_chunks=16)
    pair = torch_pair(extra)
    eng = FakeEngine(pair, GEOM, [], seed=5, knobs=Knobs(p_alloc_fail=0, p_preempt=0, p_abort=0,
                                                          p_abort_mid_step=0, p_local_hit=0))
    prompt = tokens_of(3, 3 * 32 + 7)
    eng.serve(prompt)  # stored by the torch path
    pair.worker.worker._torch = None  # the numpy path from now on (same manager, same memory)
    pair.worker.worker.register_kv_caches(pair.kv_caches, torch_path=False)
    before = eng.stats.loaded_blocks_verified
    eng.serve(prompt)  # loaded by the numpy path: the engine verifies every block
    assert eng.stats.loaded_blocks_verified >= before + 6
    assert pair.scheduler.scheduler.ledger.load_failures_total == 0
    assert_quiescent(pair)


def test_mismatching_layout_disables_kvtier_instead_of_copying(torch_pair) -> None:
    pair = make_connectors(GEOM, extra_config(cpu_chunks=4), engine_id=f"gpu-bad-{uuid.uuid4().hex[:8]}")
    w = pair.worker.worker
    bad = {k: v.transpose(1, 2) for k, v in pair.kv_caches.items()}  # [B, N, H, C]: not the keys' LBHNC
    w.register_kv_caches(bad, torch_path=True)
    assert w.store is None and w._torch is None  # disabled, with an error logged
    pair.scheduler.shutdown()
