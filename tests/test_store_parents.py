"""Every path that stores a chunk names its parent, so a chunk stored after a hit never evicts
the chunks it extends (issue 23, item 9).

The storage API requires the parents (no default: a new store path cannot forget
them); the worker's saves, a kvtier server's stores and promotions pass them; the
issue's two replays run on vLLM's real scheduler with kvtier's worker.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from conftest import payload_for, small_namespace  # noqa: E402
from kvtier.index.keys import chain_parents  # noqa: E402
from service_helpers import connect, short_dir, start_server  # noqa: E402,F401 (fixture)
from kvtier.service.client import ServiceClient  # noqa: E402
from kvtier.storage.backend import KVStore  # noqa: E402
from kvtier.storage.manager import StorageManager  # noqa: E402
from kvtier.storage.types import WriteSkip  # noqa: E402


@pytest.fixture
def managers():
    made: list[StorageManager] = []

    def make(config) -> StorageManager:
        m = StorageManager(config, small_namespace())
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


@pytest.mark.parametrize("store_cls", [StorageManager, ServiceClient, KVStore])
@pytest.mark.parametrize("method,arg", [("open_write_many", "parents"), ("open_write", "parent"), ("commit", "parent")])
def test_the_store_api_has_no_default_parent(store_cls, method, arg) -> None:
    param = inspect.signature(getattr(store_cls, method)).parameters[arg]
    assert param.default is inspect.Parameter.empty, f"{store_cls.__name__}.{method} defaults {arg}"


def test_server_block_copies_have_no_default_parent() -> None:
    param = inspect.signature(ServiceClient.store_blocks).parameters["parents"]
    assert param.default is inspect.Parameter.empty


def test_open_write_many_refuses_missing_or_short_parents(make_config, managers) -> None:
    mgr = managers(make_config(cpu_chunks=4))
    keys = mgr.keys(list(range(3 * mgr.namespace.chunk_size)))
    with pytest.raises(TypeError):
        mgr.open_write_many(keys)  # type: ignore[call-arg]
    for bad in (None, keys[:1]):
        with pytest.raises(ValueError, match="parents"):
            mgr.open_write_many(keys, bad)  # type: ignore[arg-type]
    assert len(mgr.cpu) == 0  # nothing reserved by a refused call


def _store(store, keys: list[bytes], first_parent: bytes | None = None) -> list:
    got = store.open_write_many(keys, chain_parents(keys, first_parent))
    for k, parent, buf in zip(keys, chain_parents(keys, first_parent), got):
        if isinstance(buf, np.ndarray):
            buf[:] = payload_for(k, store.chunk_bytes)
            store.commit(k, parent)
    return got


def test_a_chunk_stored_after_a_hit_does_not_evict_its_parent(make_config, managers) -> None:
    """A CPU tier of one chunk holds chunk 0; storing chunk 1 (parent chunk 0) finds no room
    instead of evicting chunk 0 (chunk 1 would be unreachable: the next lookup hits nothing)."""
    mgr = managers(make_config(cpu_chunks=1))
    tokens = list(range(2 * mgr.namespace.chunk_size + 1))
    k0, k1 = mgr.keys(tokens)
    assert _store(mgr, [k0, k1])[1] is WriteSkip.NO_ROOM  # one slot: chunk 1 finds no room
    assert _store(mgr, [k1], first_parent=k0) == [WriteSkip.NO_ROOM]
    assert mgr.lookup(tokens).num_tokens == mgr.namespace.chunk_size
    mgr.check_invariants()


def test_a_parent_on_disk_may_leave_the_cpu_tier(make_config, managers) -> None:
    """With a disk below, evicting the parent from CPU keeps the chain reachable: a small CPU
    tier goes on staging a long prompt's chunks for the disk."""
    mgr = managers(make_config(cpu_chunks=2, disk_chunks=16))
    tokens = list(range(6 * mgr.namespace.chunk_size + 1))
    keys = mgr.keys(tokens)
    for i, k in enumerate(keys):
        assert isinstance(_store(mgr, [k], keys[i - 1] if i else None)[0], np.ndarray)
        assert mgr.flush(10)
    assert mgr.lookup(tokens).num_tokens == 6 * mgr.namespace.chunk_size


def test_a_kvtier_server_store_keeps_the_parent(short_dir) -> None:
    """The server's reserve path passes the client's parents to the chain rule."""
    with start_server(short_dir, cpu_chunks=1) as _:
        c = connect(short_dir / "s.sock", sync_commit=True)
        k0, k1 = bytes([1]) * 32, bytes([2]) * 32
        assert isinstance(_store(c, [k0])[0], np.ndarray)
        assert c.flush(10)
        assert _store(c, [k1], first_parent=k0) == [WriteSkip.NO_ROOM]
        assert c.contains(k0)
        c.close()


def test_a_promotion_keeps_the_parent(make_config, managers) -> None:
    """A chunk read from disk into a one-chunk CPU tier holding its parent is served without
    evicting that parent (the promotion passes the reader's parent)."""
    mgr = managers(make_config(cpu_chunks=1, disk_chunks=8))
    tokens = list(range(2 * mgr.namespace.chunk_size + 1))
    k0, k1 = mgr.keys(tokens)
    _store(mgr, [k0])
    assert mgr.flush(10)
    mgr.cpu.clear()
    _store(mgr, [k1], first_parent=k0)
    assert mgr.flush(10)
    mgr.cpu.clear()
    with mgr.open_read(k0, None) as h:  # k0 back in CPU
        assert h is not None
    (h,) = mgr.open_read_many([(k1, k0)])
    assert h is not None and np.array_equal(h.buffer, payload_for(k1, mgr.chunk_bytes))
    h.close()
    assert mgr.cpu.contains(k0)


# -- the replays on vLLM's real scheduler ---------------------------------------------------
@pytest.mark.parametrize(
    "chunk,cpu_chunks,prompt_len,sends,want",
    [(32, 1, 65, 3, [0, 32, 32]), (256, 2, 778, 4, [0, 512, 512, 512])],
    ids=["1-chunk-tier-65-tokens", "2-chunk-tier-778-tokens"],
)
def test_resending_a_prompt_after_a_hit_keeps_hitting(chunk, cpu_chunks, prompt_len, sends, want) -> None:
    from sched_harness import Engine, EngineSpec, tokens

    e = Engine(EngineSpec(chunk_size=chunk, cpu_chunks=cpu_chunks, num_blocks=64, max_num_batched_tokens=1024))
    try:
        prompt = tokens(23, prompt_len)
        got = []
        for i in range(sends):
            e.add(f"s{i}", prompt)
            e.run()
            got.append(e.hits(f"s{i}").kvtier_hit_tokens)
            assert e.reset_prefix_cache()
        assert got == want
        assert e.audit.bad_commits == []
    finally:
        e.shutdown()
