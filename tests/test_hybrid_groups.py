"""Hybrid models (issue 23, item 7): kvtier's ``SupportsHMA`` pieces without an engine.

The real-engine check (a tiny sliding-window + full-attention Llama on vLLM's CPU backend under
vLLM's hybrid KV cache manager: kvtier's hit gives the cold answer, a corrupted group changes
it) is tests/test_vllm_contract.py. Here:

- groups kvtier cannot restore (Mamba / linear-attention state, another block size) are
  refused at start with a clear error, alone and inside the connector;
- a chunk is saved only when every group still holds all its blocks: a sliding-window group's
  blocks freed out of the window (vLLM's null block, or below ``computed - window + 1``) stop
  the chain there, never a chunk with another request's KV in it;
- each layer is copied with its own group's block ids, and null blocks are skipped on load.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from fake_vllm import CachedRequestData, FakeSchedulerOutput, NewRequestData, make_vllm_config
from kvtier.integrations.block_copy import load_blocks_grouped, save_blocks_grouped
from kvtier.integrations.vllm.groups import KVGroups, kv_groups
from test_connector_lifecycle import GEOM, extra_config, tokens_of

pytest.importorskip("vllm")

BS = GEOM.block_size  # 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(GEOM.num_layers)]


def _attn(block_size: int = BS, window: int | None = None) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if window is None:
        return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.bfloat16,
                             sliding_window=window)


def _config(*specs: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([LAYERS[i]], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=GEOM.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def _mamba() -> Any:
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.bfloat16,))


def test_full_and_sliding_window_groups_are_restorable() -> None:
    g = kv_groups(_config(_attn(window=32), _attn()), BS)
    assert g.multi and g.kinds == ("sliding_window", "full_attention") and g.windows == (32, None)
    assert g.groups_of(LAYERS) == [0, 1]
    one = kv_groups(_config(_attn()), BS)
    assert not one.multi and one.groups_of(LAYERS) == [0, 0]
    assert not kv_groups(None, BS).multi


@pytest.mark.parametrize("case", ["mamba", "block-size"])
def test_unrestorable_groups_are_refused_at_start(case: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.integrations.vllm import KVTierConnector

    kcc = _config(_attn(), _mamba()) if case == "mamba" else _config(_attn(), _attn(block_size=2 * BS))
    with pytest.raises(ValueError, match="Mamba|block size") as exc:
        kv_groups(kcc, BS)
    if case == "mamba":
        assert "cannot restore KV cache group 1" in str(exc.value) and "wrong answers" in str(exc.value)
    cfg = make_vllm_config(GEOM, extra_config(cpu_chunks=4), f"hybrid-{uuid.uuid4().hex[:8]}")
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="Mamba|block size"):
            KVTierConnector(cfg, role, kcc)


def test_the_connector_supports_hma() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from kvtier.integrations.vllm import KVTierConnector

    assert supports_hma(KVTierConnector)


def test_first_held_block_follows_vllms_sliding_window_rule() -> None:
    g = KVGroups(("full_attention", "sliding_window"), (None, 40), None, BS)
    # vLLM frees tokens before computed - window + 1: 100 - 40 + 1 = 61 -> blocks 0..2 (48 tokens) may be gone
    assert g.first_held_block(100) == 61 // BS == 3
    assert g.first_held_block(30) == 0
    assert KVGroups(block_size=BS).first_held_block(10_000) == 0


# -- the scheduler side's save planning ------------------------------------------------------------
@dataclass
class _Req:
    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    lora_request: Any = None
    mm_features: Any = None
    prompt_embeds: Any = None
    kv_transfer_params: Any = None
    block_hashes: Any = ()


def _scheduler(window: int) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.integrations.vllm import KVTierConnector

    cfg = make_vllm_config(GEOM, extra_config(cpu_chunks=8), f"hybrid-{uuid.uuid4().hex[:8]}")
    w = KVTierConnector(cfg, KVConnectorRole.WORKER, _config(_attn(window=window), _attn()))
    s = KVTierConnector(cfg, KVConnectorRole.SCHEDULER, _config(_attn(window=window), _attn()))
    return w, s


def _out(new: list[NewRequestData], cached: CachedRequestData, sched: dict[str, int]) -> FakeSchedulerOutput:
    return FakeSchedulerOutput(new, cached, sched, sum(sched.values()), set(), set(), False)


def test_saves_stop_where_a_sliding_window_freed_blocks() -> None:
    """Prompt of 6 chunks (32 tokens = 2 blocks each) prefilled 64 tokens per step, window 40."""
    w, s = _scheduler(window=40)
    try:
        req = _Req("r1", tokens_of(3, 6 * 32 + 5))
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
        g0 = list(range(1, 14))  # sliding-window group
        g1 = list(range(20, 33))  # full-attention group
        m1 = s.build_connector_meta(_out([NewRequestData("r1", req.prompt_token_ids, (g0[:4], g1[:4]), 0)],
                                          CachedRequestData(), {"r1": 64}))
        (save,) = m1.saves
        assert [c.block_ids for c in save.chunks] == [(1, 2), (3, 4)]
        assert [c.more_blocks for c in save.chunks] == [((20, 21),), ((22, 23),)]
        # step 2 (tokens 64..128): before it vLLM may free SW tokens < 64 - 40 + 1 = 25 (block 0): chunks
        # 2 and 3 are whole (blocks 4..7) and saved
        m2 = s.build_connector_meta(_out([], CachedRequestData(["r1"], set(), [[]], {}, [(g0[4:8], g1[4:8])], [64], [0]),
                                         {"r1": 64}))
        assert [c.block_ids for c in m2.saves[0].chunks] == [(5, 6), (7, 8)]
        # step 3 with a chunk prefill of 40 tokens (128..168): chunk 4 = blocks 8, 9 (tokens 128..160)
        m3 = s.build_connector_meta(_out([], CachedRequestData(["r1"], set(), [[]], {}, [(g0[8:11], g1[8:11])], [128],
                                                                [0]), {"r1": 40}))
        assert [c.block_ids for c in m3.saves[0].chunks] == [(9, 10)]
        # chunk 5 is completed in a step starting at 168: SW tokens < 129 may be freed -> blocks < 8
        # are gone, blocks 10, 11 (tokens 160..192) held: saved
        m4 = s.build_connector_meta(_out([], CachedRequestData(["r1"], set(), [[]], {}, [(g0[11:13], g1[11:13])], [168],
                                                                [0]), {"r1": 29}))
        assert [c.block_ids for c in m4.saves[0].chunks] == [(11, 12)]
    finally:
        s.shutdown()
        w.shutdown()


def test_a_chunk_whose_window_blocks_are_gone_is_never_saved() -> None:
    """vLLM's engine prefix cache already holds the first 4 chunks of the request (a local hit of
    128 tokens, window 40): their sliding-window blocks before token 89 are null. kvtier holds
    nothing: it cannot store chunk 0 whole, so it stores none of this prompt (the chain)."""
    w, s = _scheduler(window=40)
    try:
        req = _Req("r2", tokens_of(4, 6 * 32 + 5))
        assert s.get_num_new_matched_tokens(req, 128) == (0, False)
        null = s.scheduler.null_block
        g0 = [null] * 5 + list(range(1, 9))  # blocks 0..4 out of the window: null
        g1 = list(range(20, 33))
        m = s.build_connector_meta(_out([NewRequestData("r2", req.prompt_token_ids, (g0, g1), 128)],
                                        CachedRequestData(), {"r2": 69}))
        assert m.saves == []
    finally:
        s.shutdown()
        w.shutdown()


# -- the worker side's copies ----------------------------------------------------------------------
def test_grouped_copies_use_each_layers_own_block_ids_and_skip_null_blocks() -> None:
    rng = np.random.default_rng(0)
    layers = [rng.integers(0, 255, (12, 8), dtype=np.uint8) for _ in range(3)]
    groups = [0, 1, 0]
    chunk = np.zeros((3, 2, 8), dtype=np.uint8)
    save_blocks_grouped(layers, groups, chunk, [(3, 4), (7, 8)])
    for i, g in enumerate(groups):
        ids = [(3, 4), (7, 8)][g]
        assert (chunk[i] == layers[i][list(ids)]).all()
    out = [np.zeros_like(x) for x in layers]
    load_blocks_grouped(chunk, out, groups, [(-1, 9), (5, 6)], skip=-1)
    assert (out[0][9] == layers[0][4]).all() and not out[0][:9].any()  # the null slot was skipped
    assert (out[1][5] == layers[1][7]).all() and (out[1][6] == layers[1][8]).all()
    with pytest.raises(ValueError):
        save_blocks_grouped(layers, groups, chunk, [(3,), (7, 8)])


def test_the_checked_grouped_copy_is_the_grouped_copy_plus_the_whole_slot_checksum() -> None:
    """Hybrid models' loads through a client that verifies (hostile re-check, December 6: the
    grouped copy read the checked ``buffer`` and copied later, leaving a window between the two
    reads); the checked grouped copy hashes what each engine block received."""
    from kvtier.integrations.block_copy import load_blocks_grouped_checked, load_handle_grouped
    from kvtier.service.integrity import chunk_sum
    from kvtier.storage.types import ChunkUnavailable

    rng = np.random.default_rng(1)
    chunk = rng.integers(0, 255, (3, 2, 8), dtype=np.uint8)
    groups, ids = [0, 1, 0], [(-1, 9), (5, 6)]
    plain = [np.zeros((12, 8), dtype=np.uint8) for _ in range(3)]
    load_blocks_grouped(chunk, plain, groups, ids, skip=-1)
    checked = [np.zeros((12, 8), dtype=np.uint8) for _ in range(3)]
    assert load_blocks_grouped_checked(chunk, checked, groups, ids, 0, -1, chunk_sum(chunk))
    assert all((a == b).all() for a, b in zip(plain, checked))
    bad = chunk.copy()
    bad[0, 0, 0] ^= 1  # a run no block of this load takes (the null slot): still in the checksum
    assert not load_blocks_grouped_checked(bad, checked, groups, ids, 0, -1, chunk_sum(chunk))
    with pytest.raises(IndexError):
        load_blocks_grouped_checked(chunk, checked, groups, [(-1, 12), (5, 6)], 0, -1, chunk_sum(chunk))

    class Handle:  # a client-verified read handle, as kvtier.service.client.ServiceReadHandle
        def __init__(self, view: np.ndarray, want: int) -> None:
            self.view, self.want, self.key, self.verdict, self.taken = view, want, b"k" * 32, 0, False

        def claim(self) -> int | None:
            self.taken = True
            return self.want

        def unclaim(self) -> None:
            self.taken = False

        def settle(self, ok: bool) -> None:
            self.verdict = 1 if ok else 2

    h = Handle(bad.reshape(-1), chunk_sum(chunk))
    with pytest.raises(ChunkUnavailable):
        load_handle_grouped(h, lambda flat: flat.reshape(3, 2, 8), checked, groups, ids, 0, skip=-1)
    assert h.verdict == 2
    h = Handle(chunk.reshape(-1), chunk_sum(chunk))
    load_handle_grouped(h, lambda flat: flat.reshape(3, 2, 8), checked, groups, ids, 0, skip=-1)
    assert h.verdict == 1 and all((a == b).all() for a, b in zip(plain, checked))


def test_a_chunk_prefilled_across_steps_past_its_window_is_not_saved() -> None:
    """Window 8 tokens, chunks of 32 (2 blocks): chunk 0 prefilled as 24 then 8 tokens. Before the
    second step vLLM may free the window group's tokens < 24 - 8 + 1 = 17 (block 0): chunk 0 can no
    longer be read whole, so it is not saved (and nothing after it)."""
    w, s = _scheduler(window=8)
    try:
        req = _Req("r3", tokens_of(5, 2 * 32 + 5))
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
        m1 = s.build_connector_meta(_out([NewRequestData("r3", req.prompt_token_ids, ([1, 2], [20, 21]), 0)],
                                         CachedRequestData(), {"r3": 24}))
        assert m1.saves == []
        m2 = s.build_connector_meta(_out([], CachedRequestData(["r3"], set(), [[]], {}, [([3, 4], [22, 23])], [24], [0]),
                                         {"r3": 45}))
        assert m2.saves == []
    finally:
        s.shutdown()
        w.shutdown()


@dataclass
class _Blocks:
    ids: tuple[list[int], ...]

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...]:
        return tuple(list(x) for x in self.ids)


def test_a_hybrid_hit_loads_async_every_group_and_a_failed_load_is_a_counted_miss() -> None:
    from types import SimpleNamespace

    w, s = _scheduler(window=40)
    try:
        m = w.manager
        req = _Req("r4", tokens_of(6, 4 * 32 + 5))
        keys = m.keys(req.prompt_token_ids)[:4]
        for i, key in enumerate(keys):
            buf = m.open_write(key, keys[i - 1] if i else None)
            buf[:] = 1
            m.commit(key, keys[i - 1] if i else None)
        assert s.get_num_new_matched_tokens(req, 0) == (128, True)  # hybrid: always async
        null = s.scheduler.null_block
        sw = [null] * 5 + [6, 7, 8, 9]  # out of the window of token 128: null
        fa = list(range(20, 29))
        s.update_state_after_alloc(req, _Blocks((sw, fa)), 128)
        meta = s.build_connector_meta(_out([], CachedRequestData(), {}))
        (load,) = meta.loads
        assert load.is_async and [c.block_ids for c in load.chunks] == [(-1, -1), (-1, -1), (-1, 6), (7, 8)]
        assert [c.more_blocks for c in load.chunks] == [((20, 21),), ((22, 23),), ((24, 25),), ((26, 27),)]
        out = SimpleNamespace(finished_recving={"r4"}, finished_sending=set(), failed_recving={"r4"},
                              invalid_block_ids=set(), kv_cache_events=None)
        s.update_connector_output(out)
        rec = s.scheduler.ledger.get("r4")
        assert rec.kvtier_hit_tokens == 0 and rec.load_failures == 1 and rec.tiers == {}
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # recomputed, not offered the hit again
        s.request_finished_all_groups(req, (sw, fa))
        s.check_invariants()
    finally:
        s.shutdown()
        w.shutdown()
