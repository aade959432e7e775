"""An async streaming client for OpenAI-compatible servers, timing each request.

Per request (all times in seconds, measured on this client's monotonic clock from the
moment the request is sent):

- ``ttft``: time to the first streamed chunk carrying text;
- ``itl``: gaps between successive text chunks (inter-token latency; vLLM streams one
  token per chunk);
- ``tpot``: (latency - ttft) / (output_tokens - 1), 0 for a one-token answer;
- ``latency``: time to the end of the stream.

``output_tokens`` and ``prompt_tokens`` come from the server's final usage chunk
(``stream_options.include_usage``); without one, output_tokens is the number of text chunks.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from kvtier.bench.serve.workload import Session


@dataclass
class RequestRecord:
    """One request's outcome.

    Attributes:
        request_id: stable id (``u3-r1`` for multi-round QA, ``nr-7`` for the no-reuse slice).
        ok: True when the stream completed without error.
        error: the error text when not ok.
        answer: the generated text.
        ttft, tpot, latency: seconds (see the module docstring); 0 when not ok.
        itl: inter-token gaps, seconds.
        output_tokens, prompt_tokens: token counts (prompt_tokens 0 if the server sent no usage).
        start: send time, seconds since the run began.
        backend: the instance that served it (``x-kvtier-backend`` of ``kvtier router``; "" when absent).
    """

    request_id: str
    ok: bool = False
    error: str = ""
    answer: str = ""
    ttft: float = 0.0
    tpot: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    start: float = 0.0
    backend: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _chunk_text(obj: dict[str, Any]) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:
        return (c.get("delta") or {}).get("content") or ""
    return c.get("text") or ""


async def stream_request(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    request_id: str,
    *,
    messages: Sequence[dict[str, str]] | None = None,
    prompt: str | None = None,
    max_tokens: int = 16,
    t0: float | None = None,
    timeout_s: float = 600.0,
) -> RequestRecord:
    """Send one streaming request (chat when ``messages``, completion when ``prompt``), temperature 0.

    Never raises for a failed request: the record has ok=False and the error text.
    ``t0``: the run's start on ``time.perf_counter`` (for ``start``).
    """
    if (messages is None) == (prompt is None):
        raise ValueError("give exactly one of messages and prompt")
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if messages is not None:
        path, body["messages"] = "/v1/chat/completions", list(messages)
    else:
        path, body["prompt"] = "/v1/completions", prompt
    rec = RequestRecord(request_id=request_id)
    sent = time.perf_counter()
    rec.start = sent - (t0 if t0 is not None else sent)
    last = 0.0
    parts: list[str] = []
    chunks = 0
    try:
        async with client.stream(
            "POST", base_url.rstrip("/") + path, json=body, headers={"X-Request-Id": request_id}, timeout=timeout_s
        ) as resp:
            rec.backend = resp.headers.get("x-kvtier-backend", "")
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    rec.error = str(obj["error"])[:300]
                    return rec
                usage = obj.get("usage")
                if usage:
                    rec.output_tokens = int(usage.get("completion_tokens") or 0)
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                text = _chunk_text(obj)
                if not text:
                    continue
                now = time.perf_counter() - sent
                if chunks == 0:
                    rec.ttft = now
                else:
                    rec.itl.append(now - last)
                last = now
                chunks += 1
                parts.append(text)
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
        return rec
    rec.latency = time.perf_counter() - sent
    rec.answer = "".join(parts)
    if not rec.output_tokens:
        rec.output_tokens = chunks
    rec.tpot = (rec.latency - rec.ttft) / (rec.output_tokens - 1) if rec.output_tokens > 1 else 0.0
    rec.ok = True
    return rec


OnDone = Callable[[RequestRecord], None]


async def run_sessions(
    base_url: str,
    model: str,
    sessions: Sequence[Session],
    concurrency: int = 1,
    qps: float | None = None,
    max_tokens: int = 16,
    on_done: OnDone | None = None,
    shuffle_seed: int | None = 0,
) -> tuple[list[RequestRecord], float]:
    """Drive multi-round QA sessions: rounds issued round-major, at most ``concurrency`` in flight.

    Within a round, users come in a seeded random order (``shuffle_seed``; None: user order),
    a different one each round, as users of a real service do: a fixed order would line
    up with a round-robin router (with an even number of users it sends every user back to
    the same instance, with an odd number never). A round waits for the same user's previous
    round (its answer is history). With ``qps``, request starts are also paced to that rate.
    A failed round gets an empty answer so later rounds still run. Returns the records (issue
    order) and the wall time in seconds.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    rounds = len(sessions[0].questions) if sessions else 0
    order = [
        (r, s)
        for r in range(rounds)
        for s in (list(sessions) if shuffle_seed is None else random.Random(shuffle_seed * 1000 + r).sample(list(sessions), len(sessions)))
    ]
    done: dict[tuple[int, int], asyncio.Event] = {(r, s.user): asyncio.Event() for r, s in order}
    for s in sessions:
        s.answers = []
    records: dict[str, RequestRecord] = {}
    sem = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async with httpx.AsyncClient(limits=limits, timeout=None) as client:

        async def one(i: int, r: int, s: Session) -> None:
            if r:
                await done[(r - 1, s.user)].wait()
            async with sem:
                if qps:
                    delay = t0 + i / qps - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                rec = await stream_request(
                    client, base_url, model, s.request_id(r), messages=s.messages(r), max_tokens=max_tokens, t0=t0
                )
            s.answers.append(rec.answer)
            records[rec.request_id] = rec
            done[(r, s.user)].set()
            if on_done:
                on_done(rec)

        # Tasks are created in issue order; the semaphore is FIFO, so requests start round-major.
        await asyncio.gather(*(one(i, r, s) for i, (r, s) in enumerate(order)))
    wall = time.perf_counter() - t0
    return [records[s.request_id(r)] for r, s in order], wall


async def run_prompts(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    concurrency: int = 1,
    max_tokens: int = 16,
    id_prefix: str = "nr",
    on_done: OnDone | None = None,
) -> tuple[list[RequestRecord], float]:
    """Independent completion requests (the no-reuse slice), ``concurrency`` in flight."""
    sem = asyncio.Semaphore(max(1, concurrency))
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=None) as client:

        async def one(i: int, p: str) -> RequestRecord:
            async with sem:
                rec = await stream_request(client, base_url, model, f"{id_prefix}-{i}", prompt=p, max_tokens=max_tokens, t0=t0)
            if on_done:
                on_done(rec)
            return rec

        recs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return list(recs), time.perf_counter() - t0


def run_sync(coro: Awaitable[Any]) -> Any:
    """Run a coroutine from synchronous code (the bench is synchronous)."""
    return asyncio.run(coro)  # type: ignore[arg-type]
