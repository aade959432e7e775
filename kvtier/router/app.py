"""The router's HTTP app (FastAPI) and its process glue.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming passed through
chunk by chunk), ``GET /v1/models`` (from a healthy backend), ``GET /health`` (200 while a
backend is healthy, else 503), ``GET /metrics`` (Prometheus text, a private registry),
``GET /router/state`` (pool, load, index, feeds, the last decisions with their scores).

Each routed answer carries ``x-kvtier-backend``, ``x-kvtier-route-reason`` and
``x-kvtier-predicted-hit-tokens`` headers. A request whose backend cannot be reached (connect
timeout ``connect_timeout_s``, refused, reset, 502/503/504, or the backend leaving the pool
while the request waits) is retried once on the next-ranked backend, provided nothing was
sent to the client yet. Answers (streamed or not) pass through chunk by chunk; one the backend
cuts after its first bytes reaches the client as a cut (an SSE error event for a stream, then
an incomplete body), never as a clean finish.

Modules: :mod:`.router` (decisions, state), :mod:`.forward` (forwarding, streaming, retry),
:mod:`.metrics`, :mod:`.server` (:class:`RouterServer`). Their public names are re-exported
here.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvtier.router.forward import BackendUnavailable, Forwarded, Forwarder
from kvtier.router.metrics import RouterMetrics
from kvtier.router.router import Router
from kvtier.router.server import RouterServer

__all__ = ["BackendUnavailable", "Forwarded", "Forwarder", "Router", "RouterMetrics", "RouterServer", "create_app"]


def create_app(router: Router) -> FastAPI:
    """The FastAPI app serving ``router`` (starts and stops it with the app's lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="kvtier router", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.route(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.route(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.models()

    @app.get("/health")
    async def health() -> Response:
        n = len(router.pool.healthy())
        return JSONResponse({"healthy_backends": n}, status_code=200 if n else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/state")
    async def state() -> dict[str, Any]:
        return router.state()

    return app
