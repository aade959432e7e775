"""The router's HTTP app (FastAPI) and its process glue.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming passed through
chunk by chunk), ``GET /v1/models`` (from a healthy backend), ``GET /health`` (200 while a
backend is healthy, else 503), ``GET /metrics`` (Prometheus text, a private registry),
``GET /router/state`` (pool, load, index, feeds, the last decisions with their scores).

Each routed answer carries ``x-kvtier-backend``, ``x-kvtier-route-reason`` and
``x-kvtier-predicted-hit-tokens`` headers. A request whose backend cannot be reached (connect
timeout ``connect_timeout_s``, refused, reset, 502/503/504, or the backend leaving the pool
while the request waits) is retried once on the next-ranked backend, provided nothing was
sent to the client yet; a stream cut after its first bytes ends early.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import httpx
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvtier.router.config import RouterConfig
from kvtier.router.load import LoadTracker
from kvtier.router.pool import BackendPool, BackendState
from kvtier.router.prefix_index import EventFeed, PrefixIndex, chain_keys
from kvtier.router.scoring import Candidate, Decision, rank, weighted_hit
from kvtier.router.tokenize import PromptTokenizer, TokenizeError, Tokenizer

log = logging.getLogger("kvtier.router")
T = TypeVar("T")

_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade",
                "proxy-connection", "te", "trailer", "accept-encoding"}
_RETRY_STATUS = {502, 503, 504}
_CONTROLLER_TIERS = ("CPU", "DISK", "REMOTE")


class BackendUnavailable(Exception):
    """The backend could not serve the request before anything reached the client."""


async def _race(aw: Awaitable[T], down: asyncio.Event) -> T:
    """``await aw``, unless ``down`` is set first (then BackendUnavailable)."""
    task = asyncio.ensure_future(aw)
    if down.is_set():
        task.cancel()
        raise BackendUnavailable("backend left the pool")
    waiter = asyncio.ensure_future(down.wait())
    try:
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        waiter.cancel()
        raise
    if task in done:
        waiter.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise BackendUnavailable("backend left the pool while the request waited")


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvtier_router_requests", "Requests forwarded per backend",
                                ["backend", "endpoint"], registry=r)
        self.decisions = Counter("kvtier_router_decisions", "Routing decisions by reason",
                                 ["policy", "reason"], registry=r)
        self.hit_tokens = Counter("kvtier_router_predicted_hit_tokens", "Predicted cached prompt tokens of routed requests",
                                  ["backend"], registry=r)
        self.prompt_tokens = Counter("kvtier_router_prompt_tokens", "Prompt tokens of routed requests",
                                     ["backend"], registry=r)
        self.retries = Counter("kvtier_router_retries", "Requests retried on another backend", registry=r)
        self.failures = Counter("kvtier_router_backend_failures", "Requests a backend failed", ["backend"], registry=r)
        self.untokenized = Counter("kvtier_router_untokenized", "Requests routed without token ids", registry=r)
        self.healthy = Gauge("kvtier_router_backend_healthy", "1 while the backend is in the pool", ["backend"],
                             registry=r)
        self.load = Gauge("kvtier_router_backend_load_tokens", "Load term per backend (tokens)", ["backend"],
                          registry=r)
        self.blocks = Gauge("kvtier_router_index_blocks", "Blocks the prefix index holds per backend", ["backend"],
                            registry=r)


class Router:
    """The routing core: pool, load, prefix index, event feeds, decisions.

    Args:
        config: validated on construction.
        tokenizer: the model's tokenizer (``None``: only token-id prompts are scored).

    Raises:
        RouterConfigError: invalid configuration.
    """

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config.validate()
        names = [b.name for b in config.backends]
        self.index = PrefixIndex(names)
        self.pool = BackendPool(config.backends, config.down_after_timeouts, on_down=[self._on_down])
        self.load = LoadTracker(names, config.weights, on_restart=self._on_restart)
        self.tokenizer = PromptTokenizer(tokenizer)
        self.metrics = _Metrics()
        self.decisions: deque[dict[str, Any]] = deque(maxlen=config.decisions_kept)
        self.feeds: dict[str, EventFeed] = {}
        self.controller_errors = 0
        self.controller_last_error: str | None = None
        self._rr = 0
        self._client: httpx.AsyncClient | None = None
        self._probe_client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the HTTP clients, start the event feeds, health probes and metrics polls."""
        c = self.config
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=c.connect_timeout_s, read=c.read_timeout_s, write=30.0, pool=c.connect_timeout_s),
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))
        self._probe_client = httpx.AsyncClient(timeout=c.health_timeout_s)
        for b in c.backends:
            if b.events:
                self.feeds[b.name] = EventFeed(self.index, b.name, b.events, b.replay, c.events_topic,
                                               on_restart=self._on_feed_restart)
        await asyncio.gather(*(asyncio.to_thread(f.start) for f in self.feeds.values()))
        # One probe round before serving, so a backend that is down at start is not tried first.
        await asyncio.gather(*(self.pool.probe(self._probe_client, b, c.health_timeout_s) for b in self.pool.backends))
        self._tasks = [
            asyncio.create_task(self.pool.run(self._probe_client, c.health_interval_s, c.health_timeout_s)),
            asyncio.create_task(self.load.run(self._probe_client, [(b.name, b.url) for b in c.backends],
                                              c.metrics_interval_s, c.health_timeout_s)),
        ]

    async def stop(self) -> None:
        """Stop background work and close sockets (idempotent)."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        self._tasks = []
        await asyncio.gather(*(asyncio.to_thread(f.stop) for f in self.feeds.values()))
        for cl in (self._client, self._probe_client):
            if cl is not None:
                await cl.aclose()
        self._client = self._probe_client = None

    def _on_down(self, name: str) -> None:
        self.index.drop(name)
        self.load.reset(name)

    def _on_restart(self, name: str) -> None:
        log.warning("kvtier router: backend %s restarted (metrics start time changed): dropping its routes", name)
        self.index.drop(name)

    def _on_feed_restart(self, name: str) -> None:
        log.warning("kvtier router: KV events of %s restarted: dropping its routes", name)

    # -- deciding ---------------------------------------------------------------------------
    async def _controller_rows(self, tokens: list[int]) -> dict[str, dict[str, int]]:
        c = self.config
        if not c.controller_url or not tokens or self._probe_client is None:
            return {}
        if not any(b.instance_id for b in c.backends):
            return {}
        headers = {"content-type": "application/octet-stream"}
        if c.controller_token:
            headers["authorization"] = f"Bearer {c.controller_token}"
        try:
            r = await self._probe_client.post(c.controller_url.rstrip("/") + "/lookup",
                                              content=np.asarray(tokens, dtype="<u4").tobytes(),
                                              headers=headers, timeout=c.controller_timeout_s)
            r.raise_for_status()
            rows = r.json().get("instances", {})
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            self.controller_errors += 1
            self.controller_last_error = f"{type(exc).__name__}: {exc}"
            return {}
        return rows if isinstance(rows, dict) else {}

    async def candidates(self, tokens: list[int] | None) -> list[Candidate]:
        """The healthy backends with their predicted hits and load for ``tokens``."""
        healthy = self.pool.healthy()
        w = self.config.weights
        rows = await self._controller_rows(tokens) if tokens and self.config.policy == "kv-aware" else {}
        keys_by_bs: dict[int, list[bytes]] = {}
        out = []
        for b in healthy:
            hit_tokens, hit_score, per_tier = 0, 0.0, {}
            if tokens and self.config.policy == "kv-aware":
                segments: list[tuple[int, float]] = []
                bs = self.index.block_size(b.name)
                if bs:
                    if bs not in keys_by_bs:
                        keys_by_bs[bs] = chain_keys(tokens, bs)
                    m = self.index.match(b.name, keys_by_bs[bs], bs)
                    segments = [(end, w.medium(med)) for end, med in m.segments]
                    per_tier = {k.lower() if k != "GPU" else "engine": v for k, v in m.per_medium.items()}
                prefixes: list[tuple[int, float]] = []
                row = rows.get(b.spec.instance_id or "") if b.spec.instance_id else None
                if isinstance(row, dict):
                    for tier in _CONTROLLER_TIERS:
                        n = row.get(tier)
                        if isinstance(n, int) and n > 0:
                            prefixes.append((min(n, len(tokens)), w.medium(tier)))
                            per_tier[f"controller_{tier.lower()}"] = n
                hit_tokens, hit_score = weighted_hit(segments, prefixes)
            out.append(Candidate(name=b.name, index=b.index, hit_tokens=hit_tokens, hit_score=hit_score,
                                 per_tier=per_tier, load_tokens=self.load.load_tokens(b.name),
                                 last_assigned=self.load.last_assigned(b.name)))
        return out

    async def decide(self, tokens: list[int] | None) -> Decision | None:
        """Rank the healthy backends for a prompt (``None``: none healthy)."""
        cands = await self.candidates(tokens)
        if not cands:
            return None
        d = rank(self.config.policy, cands, self.config.weights.load, self._rr)
        if d.policy == "round-robin":
            self._rr = (d.choice.index + 1) % len(self.config.backends)
        return d

    def _record(self, path: str, tokens: list[int] | None, d: Decision, served_by: str | None,
                attempts: list[dict[str, Any]]) -> None:
        self.metrics.decisions.labels(d.policy, d.reason).inc()
        self.decisions.append({
            "t": time.time(), "path": path, "prompt_tokens": len(tokens) if tokens else 0,
            "policy": d.policy, "reason": d.reason, "choice": d.choice.name, "served_by": served_by,
            "predicted_hit_tokens": d.choice.hit_tokens,
            "candidates": [{"backend": c.name, "score": round(d.scores[c.name], 3), "hit_tokens": c.hit_tokens,
                            "hit_score": round(c.hit_score, 3), "per_tier": c.per_tier,
                            "load_tokens": round(c.load_tokens, 3), "last_assigned": c.last_assigned}
                           for c in d.order],
            "attempts": attempts,
        })

    # -- forwarding -------------------------------------------------------------------------
    async def route(self, request: Request, path: str, chat: bool) -> Response:
        """Tokenize, decide, forward (with one retry), record."""
        body = await request.body()
        try:
            payload: Any = json.loads(body)
        except ValueError as exc:
            payload = f"{type(exc).__name__}: {exc}"
        if not isinstance(payload, dict):
            return JSONResponse({"error": {"message": f"body is not a JSON object ({str(payload)[:200]})",
                                           "type": "BadRequest", "code": 400}}, status_code=400)
        tokens: list[int] | None
        try:
            if len(body) > 4096:
                tokens = await asyncio.to_thread(self.tokenizer.chat if chat else self.tokenizer.completion, payload)
            else:
                tokens = (self.tokenizer.chat if chat else self.tokenizer.completion)(payload)
        except TokenizeError as exc:
            log.debug("kvtier router: routing without tokens: %s", exc)
            self.metrics.untokenized.inc()
            tokens = None
        d = await self.decide(tokens)
        if d is None:
            why = "; ".join(f"{b.name}: {b.last_error}" for b in self.pool.backends)
            return JSONResponse({"error": {"message": f"no healthy backend ({why})", "type": "ServiceUnavailable",
                                           "code": 503}}, status_code=503)
        stream = bool(payload.get("stream", False))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        n_tokens = len(tokens) if tokens else 0
        attempts: list[dict[str, Any]] = []
        for cand in d.order[:2]:
            b = self.pool.by_name[cand.name]
            if not b.healthy:
                continue
            if attempts:
                self.metrics.retries.inc()
            try:
                resp = await self._attempt(b, path, body, headers, stream, n_tokens, cand, d, attempts)
            except BackendUnavailable as exc:
                attempts.append({"backend": b.name, "error": str(exc)})
                continue
            self._record(path, tokens, d, b.name, attempts + [{"backend": b.name, "status": resp.status_code}])
            return resp
        self._record(path, tokens, d, None, attempts)
        return JSONResponse({"error": {"message": f"no backend answered: {attempts}", "type": "ServiceUnavailable",
                                       "code": 503}}, status_code=503)

    async def _attempt(self, b: BackendState, path: str, body: bytes, headers: dict[str, str], stream: bool,
                       n_tokens: int, cand: Candidate, d: Decision, attempts: list[dict[str, Any]]) -> Response:
        assert self._client is not None
        down = b.event()
        self.load.begin(b.name, n_tokens)
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                self.load.end(b.name, n_tokens)

        req = self._client.build_request("POST", b.spec.url + path, content=body, headers=headers)
        try:
            resp = await _race(self._client.send(req, stream=True), down)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                httpx.WriteError, httpx.PoolTimeout) as exc:
            end()
            self.metrics.failures.labels(b.name).inc()
            self.pool.failure(b, f"{path}: {type(exc).__name__}: {exc}", definitive=True)
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from None
        except (httpx.TimeoutException, BackendUnavailable) as exc:
            end()
            self.metrics.failures.labels(b.name).inc()
            if isinstance(exc, httpx.TimeoutException):
                self.pool.failure(b, f"{path}: {type(exc).__name__}", definitive=False)
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from None
        except BaseException:
            end()
            raise
        if resp.status_code in _RETRY_STATUS:
            await resp.aclose()
            end()
            self.metrics.failures.labels(b.name).inc()
            self.pool.failure(b, f"{path}: HTTP {resp.status_code}", definitive=False)
            raise BackendUnavailable(f"HTTP {resp.status_code}")
        out_headers = {"x-kvtier-backend": b.name, "x-kvtier-route-reason": d.reason,
                       "x-kvtier-predicted-hit-tokens": str(cand.hit_tokens)}
        ctype = resp.headers.get("content-type")
        self.metrics.requests.labels(b.name, path).inc()
        self.metrics.hit_tokens.labels(b.name).inc(cand.hit_tokens)
        self.metrics.prompt_tokens.labels(b.name).inc(n_tokens)
        chunks = resp.aiter_raw()
        try:
            first = await _race(chunks.__anext__(), down)
        except StopAsyncIteration:
            first = b""
        except (httpx.HTTPError, BackendUnavailable) as exc:
            await resp.aclose()
            end()
            self.metrics.failures.labels(b.name).inc()
            self.pool.failure(b, f"{path}: {type(exc).__name__}: {exc}", definitive=isinstance(exc, httpx.TransportError))
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from None
        except BaseException:
            await resp.aclose()
            end()
            raise
        if not stream:
            try:
                rest = [first]
                while True:
                    try:
                        rest.append(await _race(chunks.__anext__(), down))
                    except StopAsyncIteration:
                        break
            except (httpx.HTTPError, BackendUnavailable) as exc:
                self.metrics.failures.labels(b.name).inc()
                self.pool.failure(b, f"{path}: {type(exc).__name__}: {exc}",
                                  definitive=isinstance(exc, httpx.TransportError))
                raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from None
            finally:
                await resp.aclose()
                end()
            return Response(b"".join(rest), status_code=resp.status_code, headers=out_headers, media_type=ctype)

        async def body_iter() -> AsyncIterator[bytes]:
            try:
                if first:
                    yield first
                while True:
                    try:
                        chunk = await _race(chunks.__anext__(), down)
                    except StopAsyncIteration:
                        break
                    except (httpx.HTTPError, BackendUnavailable) as exc:
                        self.metrics.failures.labels(b.name).inc()
                        log.warning("kvtier router: stream from %s cut: %s", b.name, exc)
                        break
                    yield chunk
            finally:
                await resp.aclose()
                end()

        return StreamingResponse(body_iter(), status_code=resp.status_code, headers=out_headers, media_type=ctype)

    async def models(self) -> Response:
        """``/v1/models`` of the first healthy backend that answers."""
        assert self._client is not None
        for b in self.pool.healthy():
            try:
                r = await self._client.get(b.spec.url + "/v1/models")
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return JSONResponse({"error": {"message": "no healthy backend", "code": 503}}, status_code=503)

    def state(self) -> dict[str, Any]:
        """Pool, load, index and feeds per backend, and the last decisions (newest last)."""
        pool = self.pool.state()
        load = self.load.state()
        index = self.index.stats()
        backends = {n: {**pool[n], "load": load[n], "index": index[n],
                        "events": self.feeds[n].stats() if n in self.feeds else None} for n in pool}
        return {"policy": self.config.policy, "backends": backends, "decisions": list(self.decisions),
                "controller": {"url": self.config.controller_url, "errors": self.controller_errors,
                               "last_error": self.controller_last_error}}

    def metrics_text(self) -> bytes:
        for b in self.pool.backends:
            self.metrics.healthy.labels(b.name).set(1 if b.healthy else 0)
            self.metrics.load.labels(b.name).set(self.load.load_tokens(b.name))
        for n, st in self.index.stats().items():
            self.metrics.blocks.labels(n).set(st["blocks"])
        return generate_latest(self.metrics.registry)


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


class RouterServer:
    """Run the router on uvicorn in a background thread (tests, benchmarks, the CLI).

    Args:
        config: the router configuration.
        tokenizer: the model's tokenizer (``None`` with ``config.model`` set: loaded from it).
        host, port: where to listen (port 0: any free port; see :attr:`url`).
    """

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None = None,
                 host: str = "127.0.0.1", port: int = 8100) -> None:
        import uvicorn

        if tokenizer is None and config.model:
            from kvtier.router.tokenize import load_tokenizer

            tokenizer = load_tokenizer(config.model)
        self.router = Router(config, tokenizer)
        self.app = create_app(self.router)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on",
                                                     timeout_graceful_shutdown=2))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> RouterServer:
        """Start serving; returns once the app is up.

        Raises:
            RuntimeError: it did not start within ``timeout_s``.
        """
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="kvtier-router", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("kvtier router did not start")
            time.sleep(0.02)
        return self

    def serve_forever(self) -> None:
        """Serve in the calling thread until interrupted."""
        self._server.run(sockets=[self._sock])

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving (idempotent)."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        with contextlib.suppress(OSError):
            self._sock.close()

    def close(self) -> None:
        """Same as :meth:`stop`."""
        self.stop()

    def __enter__(self) -> RouterServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
