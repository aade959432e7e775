"""Dashboard routes on the controller's FastAPI app.

Served to anyone who reaches the port: ``GET /`` (the page) and ``/dashboard/static/<file>``.
Everything else follows :mod:`kvtier.dashboard.access` (the controller's token, presented as
a bearer token or the session cookie of ``POST /dashboard/login``; ``POST
/dashboard/logout`` ends it): ``/dashboard/snapshot``, ``/dashboard/events`` (server-sent
events, bounded per client and in total, :class:`~kvtier.dashboard.access.StreamSlots`), and
the operations: ``POST /dashboard/ops/{op}`` runs ``clear`` (``instance``, ``tier``) or, on a
hot chain named by ``head`` (its hex id on the page), ``pin``/``unpin``/``move``/
``compress``/``decompress`` with the chain's token ids kept on the controller. The reply is
the operation record (``event_id``, ``state``); its end is read from ``GET
/dashboard/op/{event_id}`` (or the API's ``/check_finish``).

Hot prefixes are shown as text (``$KVTIER_DASHBOARD_TOKENIZER``) only on a controller with a
token: its data reaches only viewers that presented it. A tokenless controller shows keys.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import Depends, FastAPI, HTTPException, Path, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from kvtier.dashboard.access import CSRF_HEADER, DashboardAccess, Denied, StreamSlots
from kvtier.dashboard.assets import Assets
from kvtier.dashboard.controller_view import ControllerDashboard
from kvtier.dashboard.source import sse_event
from kvtier.storage.types import TIER_KINDS

log = logging.getLogger(__name__)

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


class LoginBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token: str = Field(..., max_length=4096)


def mount_dashboard(app: FastAPI, controller: Any, registry: Any, access: DashboardAccess, max_streams: int = 8,
                    per_client_streams: int = 4, stream_s: float = 300.0) -> ControllerDashboard:
    """Add the dashboard routes to ``app``; returns the dashboard (feed it lookups).

    ``access`` decides who reads and operates (the controller's token); streams are bounded
    to ``per_client_streams`` per client and ``max_streams`` in all (the oldest closes)."""
    from kvtier.dashboard.source import tokenizer_from_env

    def server_stopped() -> bool:
        # uvicorn waits for open responses on shutdown: streams (and the sampler) end when it stops
        return bool(getattr(getattr(controller, "_server", None), "should_exit", False))

    decode = None
    if controller.token:
        decode = tokenizer_from_env()
    elif _tokenizer_named():
        log.warning("kvtier dashboard: KVTIER_DASHBOARD_TOKENIZER is set but the controller has no token: hot "
                    "prefixes are shown as keys (prompt text only ever reaches viewers holding the token)")
    dash = ControllerDashboard(controller, registry, decode=decode, alive=lambda: not server_stopped())

    def stopping() -> bool:
        return dash.stopped.is_set() or server_stopped()
    assets = Assets()
    streams = StreamSlots(max_streams, per_client_streams)
    ops = controller.ops

    def _headers(request: Request) -> tuple[str | None, str | None, str | None]:
        h = request.headers
        return h.get("host"), h.get("authorization"), h.get("cookie")

    async def may_read(request: Request) -> None:
        try:
            access.check_read(*_headers(request))
        except Denied as exc:
            raise HTTPException(exc.status, exc.reason,
                                headers={"WWW-Authenticate": "Bearer"} if exc.status == 401 else None) from None

    async def may_operate(request: Request) -> None:
        try:
            access.check_operation(*_headers(request), request.headers.get(CSRF_HEADER))
        except Denied as exc:
            raise HTTPException(exc.status, exc.reason,
                                headers={"WWW-Authenticate": "Bearer"} if exc.status == 401 else None) from None

    read = [Depends(may_read)]
    operate = [Depends(may_operate)]

    @app.get("/", include_in_schema=False)
    def page() -> HTMLResponse:
        return HTMLResponse(assets.index()[1], headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/static/{name:path}", include_in_schema=False)
    def static(name: str) -> Response:
        got = assets.files.get(name)
        if got is None:
            raise HTTPException(404, "no such asset")
        return Response(got[1], media_type=got[0], headers={"Cache-Control": "max-age=300"})

    @app.post("/dashboard/login", summary="Sign in with the operator token (sets the session cookie)")
    def login(body: LoginBody, request: Request) -> Response:
        try:
            access.check_host(request.headers.get("host"))
            sid = access.login(body.token)
        except Denied as exc:
            raise HTTPException(exc.status, exc.reason) from None
        return Response(status_code=204, headers={"Set-Cookie": access.set_cookie(sid), "Cache-Control": "no-store"})

    @app.post("/dashboard/logout", summary="End the session of the cookie")
    def logout(request: Request) -> Response:
        access.logout(request.headers.get("cookie"))
        return Response(status_code=204, headers={"Set-Cookie": access.clear_cookie()})

    @app.get("/dashboard/snapshot", dependencies=read, summary="The dashboard's data (JSON)")
    def snapshot() -> Response:
        return Response(json.dumps(dash.snapshot(), separators=(",", ":")), media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/events", dependencies=read, include_in_schema=False)  # a stream: not for schema clients
    async def events(request: Request) -> Response:
        ended = streams.open(request.client.host if request.client else "?")

        async def gen() -> AsyncIterator[bytes]:
            try:
                yield f"retry: {int(dash.step_s * 1000)}\n\n".encode()
                loop = asyncio.get_running_loop()
                end = loop.time() + stream_s
                while not stopping() and not ended.is_set() and loop.time() < end:
                    yield sse_event(await run_in_threadpool(dash.snapshot))
                    for _ in range(max(1, int(dash.step_s / 0.1))):
                        if stopping() or ended.is_set():
                            return
                        await asyncio.sleep(0.1)
            finally:
                streams.close(ended)

        return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/op/{event_id}", dependencies=operate, summary="State of an operation run from the dashboard")
    def op_state(event_id: Annotated[str, Path(min_length=1, max_length=64)]) -> dict[str, Any]:
        out = ops.check_finish(event_id)
        if out is None:
            raise HTTPException(404, f"unknown event_id {event_id!r}")
        return out

    @app.post("/dashboard/ops/{op}", dependencies=operate, summary="Run an operation from the dashboard (async)")
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


def _tokenizer_named() -> bool:
    import os

    from kvtier.dashboard.source import TOKENIZER_ENV

    return bool(os.environ.get(TOKENIZER_ENV))
