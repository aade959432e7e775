"""Client side of ``kvtier demo-pd``: one streamed completion timed on this process's clock.

TTFT here is client-side: ``time.perf_counter()`` taken just before the HTTP request
is sent, to the arrival of the first server-sent event that carries a generated token
(the body is one JSON request to vLLM's ``/v1/completions`` with ``stream=True``).
It includes HTTP, scheduling, any KV load (kvtier, peer) and the prefill of whatever
the engine still computes, i.e. what a caller of that instance waits for. Every TTFT
of the demo is taken this way, by the same client, on prompts of the same lengths.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

#: Prometheus series read from vLLM's ``/metrics`` (counters).
LOCAL_HITS = "vllm:prefix_cache_hits_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
KVTIER_HITS = "kvtier:external_hit_tokens_total"


class DemoRequestError(RuntimeError):
    """A completion failed (HTTP status, broken stream, or no token came back)."""


@dataclass
class Completion:
    """One timed completion.

    Attributes:
        ttft_s: seconds from sending the request to the first generated token (client clock).
        total_s: seconds to the end of the stream.
        token_ids: generated token ids (greedy), in order.
        text: generated text.
        prompt_tokens: prompt length in tokens (from the usage chunk; 0 if absent).
        cached_tokens: prompt tokens the engine did not compute (usage
            ``prompt_tokens_details.cached_tokens``; None when the server does not report it).
        kv_transfer_params: ``kv_transfer_params`` of the answer (a PD prefill leg returns them).
    """

    ttft_s: float
    total_s: float
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    kv_transfer_params: dict[str, Any] | None = None


def completion_body(model: str, prompt: list[int], max_tokens: int, cache_salt: str) -> dict[str, Any]:
    """A greedy ``/v1/completions`` body for a token-id prompt (``cache_salt`` isolates its prefix)."""
    return {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
            "cache_salt": cache_salt}


def post_json(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed POST; its JSON answer.

    Raises:
        DemoRequestError: status other than 200, or an answer that is not a JSON object.
    """
    r = client.post(url, json=body)
    if r.status_code != 200:
        raise DemoRequestError(f"POST {url} answered {r.status_code}: {r.text[:500]}")
    out = r.json()
    if not isinstance(out, dict):
        raise DemoRequestError(f"POST {url}: answer is not a JSON object")
    return out


def stream_completion(client: httpx.Client, base_url: str, body: dict[str, Any]) -> Completion:
    """POST ``body`` to ``base_url + /v1/completions`` streamed; time the first token.

    Adds ``stream``, ``stream_options.include_usage`` and ``return_token_ids`` to a copy of ``body``.

    Raises:
        DemoRequestError: status other than 200, an ``error`` event, or no token at all.
    """
    req = {**body, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    tokens: list[int] = []
    text: list[str] = []
    ttft: float | None = None
    usage: dict[str, Any] = {}
    params: dict[str, Any] | None = None
    t0 = time.perf_counter()
    with client.stream("POST", base_url.rstrip("/") + "/v1/completions", json=req) as r:
        if r.status_code != 200:
            raise DemoRequestError(f"{base_url} answered {r.status_code}: {r.read().decode(errors='replace')[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise DemoRequestError(f"{base_url}: {event['error']}")
            for choice in event.get("choices") or []:
                ids = choice.get("token_ids") or []
                if (ids or choice.get("text")) and ttft is None:
                    ttft = time.perf_counter() - t0
                tokens.extend(int(t) for t in ids)
                text.append(choice.get("text") or "")
            if event.get("usage"):
                usage = event["usage"]
            if isinstance(event.get("kv_transfer_params"), dict):
                params = event["kv_transfer_params"]
    total = time.perf_counter() - t0
    if ttft is None:
        raise DemoRequestError(f"{base_url}: the stream ended without a token")
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return Completion(ttft, total, tokens, "".join(text), int(usage.get("prompt_tokens") or 0),
                      None if cached is None else int(cached), params)


def metric_delta(after: dict[str, float], before: dict[str, float], name: str, **labels: str) -> int:
    """``after - before`` of one counter (summed over the samples matching ``labels``), in tokens."""
    from kvtier.integrations.vllm.serve import metric_sum

    return round(metric_sum(after, name, **labels) - metric_sum(before, name, **labels))


def engine_hit_tokens(after: dict[str, float], before: dict[str, float]) -> int:
    """Prompt tokens an engine did not compute between two ``/metrics`` reads (local + external hits)."""
    return metric_delta(after, before, LOCAL_HITS) + metric_delta(after, before, EXTERNAL_HITS)
