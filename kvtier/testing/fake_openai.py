"""A fake OpenAI/vLLM server process for soaks and tests: several backends on one event loop.

Stands in for the vLLM engines behind ``kvtier router`` and ``kvtier pd-proxy`` where starting
real engines is too heavy (``kvtier bench soak-fleet`` on a 2-core machine): what is measured is
the router's and the proxy's own behaviour, not generation. Each backend answers like vLLM's
OpenAI server, instantly:

- ``POST /v1/completions`` and ``/v1/chat/completions``: a small JSON answer, or ``stream: true``
  as three SSE events and ``data: [DONE]``. The model name selects a behaviour a hostile client may
  ask for: ``fake-huge`` answers ``HUGE_BYTES`` bytes of JSON (non-streamed, generated piece by
  piece: this process never holds it whole), ``fake-cut`` streams two events and then cuts the
  connection (no ``[DONE]``, no terminating chunk).
- role ``prefill`` answers with ``kv_transfer_params`` naming itself, as a vLLM prefiller does.
- every request's ``kv_transfer_params`` (top level or in ``vllm_xargs``) is recorded when any
  of its values contains ``MARKER`` (a string only a soak's hostile client puts there):
  ``GET /fake/seen`` lists them (bounded, ``MAX_SEEN``), per backend, with request counts.
- ``GET /v1/models`` reports ``max_model_len`` (``MAX_MODEL_LEN`` tokens), ``/health`` 200,
  ``/metrics`` vLLM-style gauges.

Run as ``python -m kvtier.testing.fake_openai --listen ROLE:PORT [--listen ...] --ready FILE``;
it writes ``FILE`` once every backend listens and runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

#: A string only a hostile client puts into kv_transfer_params (the soak's probe for PD forwarding).
MARKER = "kvtier-soak-hostile"
#: Bytes of a ``fake-huge`` answer (the issue's 256 MB non-streamed answer).
HUGE_BYTES = 256 << 20
#: Piece size of a ``fake-huge`` answer.
HUGE_PIECE = 1 << 20
#: Context length reported by ``/v1/models`` (tokens).
MAX_MODEL_LEN = 4096
#: Recorded kv_transfer_params carrying the marker, per backend (the rest are only counted).
MAX_SEEN = 64
#: Roles a backend can have.
ROLES = ("backend", "prefill", "decode")


@dataclass
class Seen:
    """What one backend received: requests, and client kv_transfer_params that reached it."""

    role: str
    port: int
    requests: int = 0
    marked: int = 0
    marked_examples: list[dict[str, Any]] = field(default_factory=list)
    huge_answers: int = 0
    cut_streams: int = 0


def _marked(body: dict[str, Any]) -> dict[str, Any] | None:
    """The kv_transfer_params of ``body`` (top level, then ``vllm_xargs``) if the marker is in them."""
    for params in (body.get("kv_transfer_params"), (body.get("vllm_xargs") or {}).get("kv_transfer_params")
                   if isinstance(body.get("vllm_xargs"), dict) else None):
        if isinstance(params, dict) and MARKER in json.dumps(params, default=str):
            return params
    return None


def make_app(role: str, port: int) -> tuple[FastAPI, Seen]:
    """The FastAPI app of one backend and its record."""
    seen = Seen(role, port)
    app = FastAPI()
    started = time.time()

    async def complete(request: Request) -> Response:
        raw = await request.body()
        try:  # a large body is parsed off the loop: the other backends of this process keep answering
            body = json.loads(raw) if len(raw) < 1 << 20 else await asyncio.to_thread(json.loads, raw)
        except (ValueError, RecursionError):
            return JSONResponse({"error": "bad json"}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": "not an object"}, status_code=400)
        seen.requests += 1
        params = _marked(body)
        if params is not None:
            seen.marked += 1
            if len(seen.marked_examples) < MAX_SEEN:
                text = json.dumps(params, default=str)
                seen.marked_examples.append(json.loads(text) if len(text) <= 2048 else {"truncated": text[:256]})
        model = str(body.get("model", ""))
        if model == "fake-huge":
            seen.huge_answers += 1
            return StreamingResponse(_huge(), media_type="application/json",
                                     headers={"content-length": str(HUGE_BYTES)})
        if body.get("stream"):
            cut = model == "fake-cut"
            seen.cut_streams += int(cut)
            return StreamingResponse(_events(cut), media_type="text/event-stream")
        out: dict[str, Any] = {"id": "cmpl-fake", "object": "text_completion", "model": model or "fake",
                               "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}
        if role == "prefill":
            out["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                         "remote_engine_id": f"fake-prefill-{port}", "remote_block_ids": [],
                                         "remote_host": "127.0.0.1", "remote_port": port,
                                         "remote_request_id": f"fake-{seen.requests}"}
        return JSONResponse(out)

    app.post("/v1/completions")(complete)
    app.post("/v1/chat/completions")(complete)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": f"fake-{port}",
                                            "max_model_len": MAX_MODEL_LEN}]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0",model_name="fake"} 0.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="fake"} 0.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="fake"} 0.0\n'
            f"process_start_time_seconds {started}\n")

    @app.get("/fake/seen")
    async def fake_seen() -> dict[str, Any]:
        return seen.__dict__

    return app, seen


async def _huge() -> AsyncIterator[bytes]:
    head, tail = b'{"choices": [{"text": "', b'"}]}'
    yield head
    left = HUGE_BYTES - len(head) - len(tail)
    piece = b"a" * HUGE_PIECE
    while left > 0:
        n = min(left, HUGE_PIECE)
        yield piece[:n]
        left -= n
        await asyncio.sleep(0)
    yield tail


async def _events(cut: bool) -> AsyncIterator[bytes]:
    for i in range(2 if cut else 3):
        yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n".encode()
        await asyncio.sleep(0.005)
    if cut:
        raise ConnectionResetError("fake-cut: the backend cuts the stream")  # uvicorn drops the connection
    yield b"data: [DONE]\n\n"


async def serve(listen: list[tuple[str, int]], ready: Path | None) -> None:
    """Serve every ``(role, port)`` until SIGTERM/SIGINT; writes ``ready`` once all listen."""
    import uvicorn

    servers = [uvicorn.Server(uvicorn.Config(make_app(role, port)[0], host="127.0.0.1", port=port,
                                             log_level="critical", lifespan="off", access_log=False))
               for role, port in listen]
    # (uvicorn's serve() takes SIGTERM/SIGINT in capture_signals and re-raises them as it returns,
    # so the loop's handlers below still set ``stop``.)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(s.serve()) for s in servers]
    while not all(s.started for s in servers):
        if any(t.done() for t in tasks):
            raise SystemExit(f"fake_openai: a backend did not start: {[t.exception() for t in tasks if t.done()]}")
        await asyncio.sleep(0.02)
    if ready is not None:
        tmp = ready.with_suffix(".tmp")
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, ready)
    await stop.wait()
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)


def _listen(text: str) -> tuple[str, int]:
    role, _, port = text.partition(":")
    if role not in ROLES or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--listen {text!r}: expected ROLE:PORT with ROLE in {ROLES}")
    return role, int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", type=_listen, action="append", required=True, help="ROLE:PORT (repeat).")
    ap.add_argument("--ready", type=Path, default=None)
    a = ap.parse_args(argv)
    asyncio.run(serve(a.listen, a.ready))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
