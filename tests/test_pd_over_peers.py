"""PD between two embedded connectors (no shared ``kvtier server``): the decoder pulls over a transfer channel.

Across machines a prefiller and a decoder share no store. The prefiller's connector
serves its store on ``peer_listen``; the decoder lists it in ``peers`` (a peer is one
more lower tier, :class:`kvtier.transfer.peer_tier.PeerTier`), so the decode leg's
lookup misses locally, finds the chunks (full and partial) on the prefiller, pulls them
into its CPU tier and loads them. Same fake engines as ``test_pd_protocol``.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import numpy as np
import pytest

from fake_vllm import ConnectorPair, expected_kv, make_connectors
from test_pd_protocol import CHUNK, GEOM, Side, decode, free_port, req, tokens_of, wait_sending


@pytest.fixture
def embedded(fleet) -> Iterator[Any]:
    made: list[ConnectorPair] = []

    def make(role: str, **extra: Any) -> Side:
        keys = fleet.config("a" if role == "prefill" else "b")  # TCP peers authenticate (issue 24)
        cfg: dict[str, Any] = dict(chunk_size=CHUNK, model_id="fake/pd-peers", cpu_capacity=64 * CHUNK * GEOM.token_bytes,
                                   pd_role=role, lease_ttl_s=3600.0, **keys, **extra)
        pair = make_connectors(GEOM, cfg, engine_id=f"pdp-{role}-{uuid.uuid4().hex[:8]}")
        made.append(pair)
        return Side(pair)

    try:
        yield make
    finally:
        for p in made:
            p.shutdown()


@pytest.mark.parametrize("length", [5 * CHUNK + 21, 4 * CHUNK])
def test_decoder_pulls_the_prompt_from_the_prefiller_over_tcp(embedded, length: int) -> None:
    peer = f"tcp://127.0.0.1:{free_port()}"
    pre = embedded("prefill", pd_port=free_port(), peer_listen=peer)
    dec = embedded("decode", peers=[peer])
    prompt = tokens_of(100 + length, length)
    held, params = pre.prefill(req("p-1", prompt, {"do_remote_decode": True}))
    assert held and params is not None
    d = req("d-1", prompt, params)
    ext, errors = decode(dec, d)
    assert ext == length and not errors
    assert np.array_equal(dec.kv(d, 0, length), expected_kv(prompt, None, GEOM)), "decoder KV differs"
    wait_sending(pre, "p-1")
    assert not pre.worker.worker.pd.held


def test_prefiller_gone_before_the_pull_is_a_miss_not_a_hang(embedded) -> None:
    peer = f"tcp://127.0.0.1:{free_port()}"
    pre = embedded("prefill", pd_port=free_port(), peer_listen=peer)
    dec = embedded("decode", peers=[peer], peer_timeout_s=0.5)
    prompt = tokens_of(7, 3 * CHUNK + 5)
    _, params = pre.prefill(req("p-1", prompt, {"do_remote_decode": True}))
    pre.pair.shutdown()  # the prefiller's process is gone: its peer listener and confirm socket with it
    ext, errors = decode(dec, req("d-1", prompt, params), timeout_s=10.0)
    assert ext == 0 and not errors  # nothing promised: vLLM computes the whole prompt
