"""Dashboard routes on the controller's FastAPI app.

Read-only routes need no token: ``GET /`` (the page), ``/dashboard/static/<file>``,
``/dashboard/snapshot``, ``/dashboard/events`` (server-sent events, at most
``max_streams`` at once; more get 503). Operations need the controller's bearer token
(the ``auth`` dependencies of the API): ``POST /dashboard/ops/{op}`` runs ``clear``
(``instance``, ``tier``) or, on a hot chain named by ``head`` (its hex id on the page),
``pin``/``unpin``/``move``/``compress``/``decompress`` with the chain's token ids kept
on the controller. The reply is the operation record (``event_id``, ``state``); its
end is read from ``GET /check_finish/{event_id}``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, HTTPException
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from kvtier.dashboard.assets import Assets
from kvtier.dashboard.controller_view import ControllerDashboard
from kvtier.dashboard.source import sse_event
from kvtier.storage.types import TIER_KINDS

Op = Literal["clear", "pin", "unpin", "move", "compress", "decompress"]


class OpBody(BaseModel):
    """One operation from the page (fields by op, see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    head: str | None = Field(None, pattern=r"^[0-9a-f]{32}$")
    instance: str | None = Field(None, min_length=1, max_length=255)
    tier: Literal[TIER_KINDS] | None = None  # type: ignore[valid-type]
    to_tier: Literal[TIER_KINDS] | None = None  # type: ignore[valid-type]
    to_instance: str | None = Field(None, min_length=1, max_length=255)
    codec: str | None = Field(None, min_length=1, max_length=64)
    ttl_s: float | None = Field(None, gt=0, le=1e7)


def mount_dashboard(app: FastAPI, controller: Any, registry: Any, deps: list[Any], max_streams: int = 4,
                    stream_s: float = 300.0) -> ControllerDashboard:
    """Add the dashboard routes to ``app``; returns the dashboard (feed it lookups)."""
    from kvtier.dashboard.source import tokenizer_from_env

    def server_stopped() -> bool:
        # uvicorn waits for open responses on shutdown: streams (and the sampler) end when it stops
        return bool(getattr(getattr(controller, "_server", None), "should_exit", False))

    dash = ControllerDashboard(controller, registry, decode=tokenizer_from_env(),
                               alive=lambda: not server_stopped())

    def stopping() -> bool:
        return dash.stopped.is_set() or server_stopped()
    assets = Assets()
    streams = asyncio.Semaphore(max_streams)
    ops = controller.ops

    @app.get("/", include_in_schema=False)
    def page() -> HTMLResponse:
        return HTMLResponse(assets.index()[1], headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/static/{name:path}", include_in_schema=False)
    def static(name: str) -> Response:
        got = assets.files.get(name)
        if got is None:
            raise HTTPException(404, "no such asset")
        return Response(got[1], media_type=got[0], headers={"Cache-Control": "max-age=300"})

    @app.get("/dashboard/snapshot", summary="The dashboard's data (JSON)")
    def snapshot() -> Response:
        return Response(json.dumps(dash.snapshot(), separators=(",", ":")), media_type="application/json")

    @app.get("/dashboard/events", include_in_schema=False)  # a stream: not for schema-driven clients
    async def events() -> Response:
        if streams.locked():
            return Response(status_code=503, headers={"Retry-After": "5"})
        await streams.acquire()

        async def gen() -> AsyncIterator[bytes]:
            try:
                yield f"retry: {int(dash.step_s * 1000)}\n\n".encode()
                loop = asyncio.get_running_loop()
                end = loop.time() + stream_s
                while not stopping() and loop.time() < end:
                    yield sse_event(await run_in_threadpool(dash.snapshot))
                    for _ in range(max(1, int(dash.step_s / 0.1))):
                        if stopping():
                            return
                        await asyncio.sleep(0.1)
            finally:
                streams.release()

        return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/dashboard/ops/{op}", dependencies=deps, summary="Run an operation from the dashboard (async)")
    def run_op(op: Op, body: OpBody) -> JSONResponse:
        if op == "clear":
            rec = ops.clear(body.instance, body.tier, None)
        else:
            chain = dash.hot.get(bytes.fromhex(body.head)) if body.head else None
            if chain is None or not chain.tokens:
                raise HTTPException(404, "head: no such hot chain (it may have left the top-k)")
            tokens = np.frombuffer(chain.tokens, dtype="<u4").tolist()
            inst = body.instance or chain.instance
            if op == "pin":
                rec = ops.pin(tokens, inst, body.ttl_s, chain.salt)
            elif op == "unpin":
                rec = ops.unpin(tokens, inst, None, chain.salt)
            elif op == "move":
                if body.to_tier is None or inst is None:
                    raise HTTPException(422, "to_tier: required for move")
                rec = ops.move(tokens, inst, body.to_tier, body.to_instance, body.tier, False, chain.salt)
            else:
                codec = "raw" if op == "decompress" else body.codec
                from kvtier.serde.registry import CODECS

                if codec not in CODECS:
                    raise HTTPException(422, f"codec: choose one of {sorted(CODECS)}")
                rec = ops.compress(tokens, codec, inst, body.tier, chain.salt)
        return JSONResponse(ops.tracker.get(rec.event_id) or {"event_id": rec.event_id, "state": "pending"})

    return dash
