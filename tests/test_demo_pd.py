"""``kvtier demo-pd``: summary logic and the streamed-TTFT client, without vLLM.

The real two-instance run (four vLLM servers, minutes on 2 cores) is
``kvtier demo-pd --json PATH`` under ``flock /tmp/kvtier-heavy.lock``; it is not
part of the test suite.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from kvtier.demo.pd_client import (
    DemoRequestError,
    engine_hit_tokens,
    metric_delta,
    stream_completion,
)
from kvtier.demo.pd_summary import P2PRow, PDRow, print_tables, report, summarize


def pd_row(i: int, computed: int = 1, decode: float = 0.12, hit: float = 0.10, same: bool = True) -> PDRow:
    return PDRow(i, "doc", 2300, same, False, computed, decode, hit, 60)


def p2p_row(i: int, peer: int = 2176, p2p: float = 0.11, local: float = 0.10, same: bool = True) -> P2PRow:
    return P2PRow(i, "doc", 2300, 2176, peer, 2176, same, True, p2p, local)


def test_summary_passes_and_uses_medians() -> None:
    pd = [pd_row(0, decode=0.12), pd_row(1, decode=0.14), pd_row(2, decode=9.0)]  # one outlier
    p2p = [p2p_row(0, p2p=0.12), p2p_row(1, p2p=0.10), p2p_row(2, p2p=0.11)]
    s = summarize(pd, p2p)
    assert s["answers_identical"] is True
    assert s["max_decoder_computed_prompt_tokens"] == 1
    assert s["decode_ttft_over_engine_hit"] == pytest.approx(0.14 / 0.10)
    assert s["p2p_ttft_over_local_hit"] == pytest.approx(0.11 / 0.10)
    assert s["passed"] and all(s["targets"].values())


@pytest.mark.parametrize(
    ("pd", "p2p", "failed"),
    [
        ([pd_row(0, computed=2)], [p2p_row(0)], "decoder_computed_le_1"),
        ([pd_row(0, decode=0.16)], [p2p_row(0)], "decode_ttft_le_1_5x_engine_hit"),
        ([pd_row(0, same=False)], [p2p_row(0)], "pd_answers_identical"),
        ([pd_row(0)], [p2p_row(0, peer=128)], "p2p_served_from_peer"),
        ([pd_row(0)], [p2p_row(0, same=False)], "p2p_answers_identical"),
        ([pd_row(0)], [p2p_row(0, p2p=0.14)], "p2p_ttft_le_1_3x_local_hit"),
    ],
)
def test_each_target_can_fail(pd: list[PDRow], p2p: list[P2PRow], failed: str) -> None:
    s = summarize(pd, p2p)
    assert [k for k, ok in s["targets"].items() if not ok] == [failed]
    assert not s["passed"]
    if failed.endswith("answers_identical"):
        assert s["answers_identical"] is False


def test_empty_legs_fail_with_null_figures() -> None:
    s = summarize([], [])
    assert s["max_decoder_computed_prompt_tokens"] is None
    assert s["decode_ttft_over_engine_hit"] is None and s["p2p_ttft_over_local_hit"] is None
    assert not any(s["targets"].values()) and not s["passed"]


def test_report_is_json_and_prints_a_table() -> None:
    doc = json.loads(json.dumps(report([pd_row(0)], [p2p_row(0)], {"chunk_size": 128})))
    assert set(doc) == {"settings", "pd", "p2p", "summary"}
    assert doc["p2p"][0]["served_from_peer"] is True
    assert {"answers_identical", "max_decoder_computed_prompt_tokens", "decode_ttft_over_engine_hit",
            "p2p_ttft_over_local_hit"} <= set(doc["summary"])
    lines: list[str] = []
    print_tables(doc, lines.append)
    assert lines[-1] == "PASS" and any("decode_ttft_over_engine_hit 1.20" in ln for ln in lines)


def _sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_stream_completion_collects_tokens_usage_and_request_fields() -> None:
    seen: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        events = [
            {"choices": [{"text": "", "token_ids": None, "prompt_token_ids": [1, 2, 3]}]},  # no token yet
            {"choices": [{"text": " Yes", "token_ids": [11]}]},
            {"choices": [{"text": ",", "token_ids": [12, 13]}]},
            {"choices": [], "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}},
        ]
        return httpx.Response(200, content=_sse(events), headers={"content-type": "text/event-stream"})

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        c = stream_completion(client, "http://x/", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3})
    assert seen["stream"] is True and seen["return_token_ids"] is True and seen["prompt"] == [1, 2, 3]
    assert c.token_ids == [11, 12, 13] and c.text == " Yes,"
    assert c.prompt_tokens == 3 and c.cached_tokens == 2
    assert 0 <= c.ttft_s <= c.total_s


@pytest.mark.parametrize("status,events", [(500, []), (200, [{"error": {"message": "boom"}}]), (200, [])])
def test_stream_completion_errors(status: int, events: list[dict[str, Any]]) -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(status, content=_sse(events)))
    with httpx.Client(transport=transport) as client, pytest.raises(DemoRequestError):
        stream_completion(client, "http://x", {"model": "m", "prompt": [1], "max_tokens": 1})


def test_metric_deltas() -> None:
    before = {'vllm:prefix_cache_hits_total{engine="0"}': 10.0, 'vllm:external_prefix_cache_hits_total{engine="0"}': 0.0,
              'kvtier:external_hit_tokens_total{engine="0",tier="peer"}': 0.0}
    after = {'vllm:prefix_cache_hits_total{engine="0"}': 10.0, 'vllm:external_prefix_cache_hits_total{engine="0"}': 2175.0,
             'kvtier:external_hit_tokens_total{engine="0",tier="peer"}': 2176.0,
             'kvtier:external_hit_tokens_total{engine="0",tier="cpu"}': 5.0}
    assert engine_hit_tokens(after, before) == 2175
    assert metric_delta(after, before, "kvtier:external_hit_tokens_total", tier="peer") == 2176
    assert metric_delta(after, before, "kvtier:external_hit_tokens_total", tier="cpu") == 5


def test_computed_prompt_tokens_counts_the_replayed_last_token() -> None:
    from kvtier.demo.pd_demo import computed_prompt_tokens

    assert computed_prompt_tokens(2284, 2284) == 1  # a full-prompt load: vLLM still runs the last token
    assert computed_prompt_tokens(2284, 2283) == 1
    assert computed_prompt_tokens(2284, 2176) == 108
