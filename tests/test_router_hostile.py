"""kvtier router against hostile input (issue 24, kind 6): misleading KV events, salted prompts,
oversized bodies and prompts, slow tokenization, huge answers, cut streams, token on argv.

Every test runs the real router (uvicorn on a free loopback port) in front of the fake vLLM
backends of ``test_router`` and fails on the behaviour issue 24 found.
"""

from __future__ import annotations

import contextlib
from typing import Any

import httpx
import pytest
from test_router import BS, DOC, FakeBackend, _blocks, _complete, _router, _stored, _wait  # noqa: F401

from kvtier.events.codec import make_batch
from kvtier.events.publisher import EventPublisher
from kvtier.events.schema import BlockRemoved, BlockStored
from kvtier.router.config import Weights
from kvtier.router.prefix_index import PrefixIndex, chain_keys, index_medium


@pytest.fixture()
def fleet(tmp_path):
    backs = [FakeBackend("a").start(), FakeBackend("b").start()]
    pubs = [EventPublisher(f"ipc://{tmp_path}/ev{i}.sock") for i in range(2)]
    yield backs, pubs, tmp_path
    for b in backs:
        b.stop()
    for p in pubs:
        p.close()


# -- media: an unknown name never outranks a known tier ------------------------------------------


def test_media_names_of_vllm_and_kvtier_and_unknown_ones() -> None:
    assert [index_medium(m) for m in (None, "GPU", "cpu", "STORAGE", "DISK", "REMOTE")] == \
        ["GPU", "GPU", "CPU", "DISK", "DISK", "REMOTE"]
    assert index_medium("STORAGE", "REMOTE") == index_medium("CPU", "REMOTE") == "REMOTE"
    assert index_medium("GPU", "REMOTE") == "GPU"  # the engine's own blocks are local by definition
    assert index_medium("STORAGE", "LOCAL") == "DISK"
    for bad in ("HBM", "NVME", "", "gpu2"):
        assert index_medium(bad) is None
    w = Weights()
    assert w.medium("HBM") == 0.0 < w.remote  # weighs least
    assert w.medium("STORAGE") == w.disk and w.medium(None) == w.gpu


def test_unknown_medium_is_not_indexed_but_links_the_chain() -> None:
    idx = PrefixIndex(["a"])
    half = 4 * BS
    idx.apply("a", make_batch([_stored(DOC[:half], salt=1, medium="HBM_X")]))
    keys = chain_keys(DOC, BS)
    assert idx.match("a", keys, BS).tokens == 0  # not weighed like an engine block
    assert idx.stats()["a"]["unknown_medium"] == 4 and idx.stats()["a"]["stored"] == 0
    # A GPU store whose parent is the unknown-medium block still keys right (the hash linked).
    idx.apply("a", make_batch([_stored(DOC[half:], salt=1, parent=1_000_003 + 4)]))
    assert idx.stats()["a"]["orphans"] == 0
    # Removing an unknown medium removes nothing known.
    idx.apply("a", make_batch([_stored(DOC[:half], salt=1, medium="CPU")]))
    idx.apply("a", make_batch([BlockRemoved(block_hashes=[1_000_003 + 1], medium="HBM_X")]))
    assert idx.match("a", keys, BS).tokens == 8 * BS


def test_unknown_medium_does_not_outrank_a_known_tier(fleet) -> None:
    backs, pubs, _ = fleet
    with contextlib.closing(_router(backs, pubs)) as r, httpx.Client(base_url=r.url, timeout=10) as c:
        pubs[0].publish([_stored(DOC, salt=3, medium="STORAGE")])  # a holds it on disk (vLLM's name)
        pubs[1].publish([_stored(DOC, salt=4, medium="HBM_FANCY")])  # b claims a tier nobody knows
        _wait(lambda: r.router.feeds["b"].batches == 1 and _blocks(r, "a") == 8)
        resp = _complete(c, DOC)
        assert resp.json()["backend"] == "a" and resp.headers["x-kvtier-route-reason"] == "prefix"
        cands = c.get("/router/state").json()["decisions"][-1]["candidates"]
        assert {x["backend"]: x["hit_tokens"] for x in cands} == {"a": 8 * BS, "b": 0}
