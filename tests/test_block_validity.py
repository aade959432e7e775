"""BlockValidity: which engine blocks may hold KV computed over a failed load (unit level)."""

from __future__ import annotations

import pytest

from kvtier.integrations.vllm.types import ChunkCopy, StepBlocks, TransferSpec
from kvtier.integrations.vllm.validity import BlockValidity

BS = 16


def save(req: str, *chunks: tuple[int, ...]) -> TransferSpec:
    return TransferSpec(req, [ChunkCopy(bytes([i]) * 32, blocks) for i, blocks in enumerate(chunks)])


def kept(v: BlockValidity, spec: TransferSpec) -> int:
    out = v.clean([spec])
    return len(out[0].chunks) if out else 0


def test_a_failed_load_taints_what_reads_it_and_a_recompute_cleans_it() -> None:
    v = BlockValidity(BS)
    # a loads block 10 (fails) and computes blocks 11, 12; b shares 10 and computes 20.
    v.begin_step(StepBlocks(tables={"a": [10, 11, 12], "b": [10, 20]}, computing={"a": (16, 48), "b": (16, 32)}))
    v.load_failed([10])
    assert kept(v, save("a", (10,), (11,), (12,))) == 0
    assert kept(v, save("b", (10,), (20,))) == 0
    assert v.bad == {10, 11, 12, 20}
    # vLLM rewinds a to 0 and b to 16; both run again in one step: a rewrites 10 first.
    v.begin_step(StepBlocks(computing={"a": (0, 48), "b": (16, 32)}))
    assert kept(v, save("b", (10,), (20,))) == 2
    assert kept(v, save("a", (10,), (11,), (12,))) == 3
    assert not v.bad


def test_a_partial_rewrite_does_not_clean_a_block() -> None:
    v = BlockValidity(BS)
    v.begin_step(StepBlocks(tables={"a": [5, 6]}, computing={"a": (16, 17)}))
    v.load_failed([5])
    v.settle()
    v.begin_step(StepBlocks(computing={"a": (8, 32)}))  # rewrites positions 8..15 of block 5 only
    assert kept(v, save("a", (5,), (6,))) == 0
    assert v.bad == {5, 6}


def test_only_chunks_after_the_bad_block_are_dropped_and_a_good_load_cleans() -> None:
    v = BlockValidity(BS)
    v.begin_step(StepBlocks(tables={"a": [1, 2, 3, 4]}, computing={"a": (32, 64)}))
    v.load_failed([2])  # blocks 1, 2 loaded (2 failed), 3, 4 computed over them
    assert kept(v, save("a", (1,), (2,), (3,), (4,))) == 1
    assert v.bad == {2, 3, 4}
    v.begin_step(StepBlocks(gone=["a"], tables={"c": [7, 3]}, computing={"c": (32, 40)}))
    v.loaded([3])  # c loads into block 3 (reused): it holds a stored chunk now
    assert 3 not in v.bad


def test_tables_follow_preemption_resume_and_appends() -> None:
    v = BlockValidity(BS)
    v.begin_step(StepBlocks(tables={"a": [1, 2]}, computing={"a": (0, 32)}))
    v.begin_step(StepBlocks(appended={"a": [3]}, computing={"a": (32, 48)}))
    assert v.table("a") == [1, 2, 3]
    v.begin_step(StepBlocks(gone=["a"]))
    assert v.table("a") is None
    v.begin_step(StepBlocks(gone=["a"], tables={"a": [9, 8]}, computing={"a": (0, 32)}))
    assert v.table("a") == [9, 8]


def test_saves_of_an_unknown_request_are_not_trusted_while_blocks_are_bad() -> None:
    v = BlockValidity(BS)
    v.begin_step(StepBlocks(tables={"a": [1]}, computing={"a": (0, 16)}))
    assert kept(v, save("x", (4,))) == 1  # nothing bad: nothing to doubt
    v.load_failed([1])
    assert kept(v, save("x", (4,))) == 0


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        BlockValidity(0)


def test_blocks_another_connector_loads_are_bad_until_verified() -> None:
    from kvtier.integrations.vllm.validity import ForeignLoads

    fl = ForeignLoads()
    v = BlockValidity(BS)
    step = StepBlocks(tables={"a": [1, 2]}, computing={"a": (16, 32)}, unverified=[1])
    n = fl.fill(step)
    v.begin_step(step)
    assert kept(v, save("a", (1,), (2,))) == 0  # block 1 not known good yet
    fl.on_output([n], invalid=set())
    nxt = StepBlocks()
    fl.fill(nxt)
    assert nxt.verified == [1]
    v.begin_step(nxt)
    assert 1 not in v.bad and 2 in v.bad  # 2 was computed while 1 was in doubt: stays bad


def test_an_invalid_block_taints_what_its_holders_computed_after_it() -> None:
    from kvtier.integrations.vllm.validity import ForeignLoads

    fl = ForeignLoads()
    v = BlockValidity(BS)
    step = StepBlocks(tables={"a": [1, 2, 3], "b": [1, 4]}, computing={"a": (0, 48), "b": (16, 32)}, unverified=[7])
    n = fl.fill(step)
    v.begin_step(step)
    v.settle()
    fl.on_output([n], invalid={1, 7})  # vLLM reports 1 (another connector) and 7 invalid
    nxt = StepBlocks()
    fl.fill(nxt)
    assert nxt.invalid == [1, 7] and nxt.verified == []
    v.begin_step(nxt)
    assert {1, 2, 3, 4, 7} <= v.bad
