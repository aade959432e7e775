"""The routing core: backend pool, load, prefix index, event feeds, and the decisions.

:class:`Router` tokenizes a request, ranks the healthy backends by predicted cached prefix
net of load (:mod:`.scoring`), forwards it (:mod:`.forward`) and records the decision
(``/router/state``, ``/metrics``). The HTTP app around it is :mod:`.app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import httpx
import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest

from kvtier.router.admission import Admission, Refused
from kvtier.router.config import BackendSpec, RouterConfig, RouterConfigError
from kvtier.router.forward import Forwarder, forward_headers
from kvtier.router.load import LoadTracker
from kvtier.router.metrics import RouterMetrics
from kvtier.router.pool import BackendPool
from kvtier.router.prefix_index import EventFeed, PrefixIndex
from kvtier.router.scoring import Candidate, Decision, predicted_hit, rank
from kvtier.router.request_body import BadBody, prepare
from kvtier.router.tokenize import PromptTokenizer, PromptTooLong, Tokenizer
from kvtier.urls import mask_url

log = logging.getLogger("kvtier.router")


def _credentials(config: RouterConfig) -> Any:
    """The router's fleet credentials (``fleet_key`` + ``fleet_members``), or None.

    Raises:
        RouterConfigError: unusable key or members file (the message says why).
    """
    if config.fleet_key is None or config.fleet_members is None:
        return None
    from kvtier.protocol.trust import Credentials, TrustError

    try:
        return Credentials.from_paths(config.fleet_key, config.fleet_members, name="router")
    except TrustError as exc:
        raise RouterConfigError(f"--fleet-key/--fleet-members: {exc}") from None


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=headers)



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
        self.admission = Admission(config.max_body_bytes)
        #: The model's context (tokens): ``config.max_prompt_tokens``, else learned from the
        #: backends' ``/v1/models`` (``max_model_len``); ``None`` until known (not checked).
        self.max_prompt_tokens: int | None = config.max_prompt_tokens
        self.metrics = RouterMetrics()
        self.forwarder = Forwarder(self.pool, self.load, self.metrics)
        self.decisions: deque[dict[str, Any]] = deque(maxlen=config.decisions_kept)
        self.credentials = _credentials(config)
        self.feeds: dict[str, EventFeed] = {}
        self.controller_errors = 0
        self.controller_last_error: str | None = None
        self._rr = 0
        self._served: dict[str, int] = {}
        self._silent_warned: set[str] = set()
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
                key = self._publisher_key(b)
                self.feeds[b.name] = EventFeed(self.index, b.name, b.events, b.replay, c.events_topic,
                                               on_restart=self._on_feed_restart,
                                               max_message_bytes=c.events_max_message_bytes,
                                               credentials=self.credentials, server_key=key)
        await asyncio.gather(*(asyncio.to_thread(f.start) for f in self.feeds.values()))
        # One probe round before serving, so a backend that is down at start is not tried first.
        await asyncio.gather(*(self.pool.probe(self._probe_client, b, c.health_timeout_s) for b in self.pool.backends))
        if self.max_prompt_tokens is None:
            await self._learn_context()
        self._tasks = [
            asyncio.create_task(self._learn_context(forever=True)),
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
        self.admission.close()

    #: Seconds between attempts to learn the model's context from the backends.
    LEARN_CONTEXT_EVERY_S = 5.0

    async def _learn_context(self, forever: bool = False) -> None:
        """Set :attr:`max_prompt_tokens` to the smallest ``max_model_len`` the healthy backends'
        ``/v1/models`` report (vLLM's field); one round, or (``forever``) one every
        :data:`LEARN_CONTEXT_EVERY_S` seconds until known."""
        while self.max_prompt_tokens is None and self._probe_client is not None:
            found: list[int] = []
            for b in self.pool.healthy():
                try:
                    r = await self._probe_client.get(b.spec.url + "/v1/models")
                    for m in r.json().get("data", []):
                        n = m.get("max_model_len") if isinstance(m, dict) else None
                        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                            found.append(n)
                except (httpx.HTTPError, ValueError, AttributeError, TypeError):
                    continue
            if found:
                self.max_prompt_tokens = min(found)
                log.info("kvtier router: prompts beyond %d tokens (the backends' max_model_len) are refused",
                         self.max_prompt_tokens)
            if not forever:
                return
            await asyncio.sleep(self.LEARN_CONTEXT_EVERY_S)

    def _publisher_key(self, spec: BackendSpec) -> str | None:
        """The public key of the member named like backend ``spec``'s instance id in the router's members
        file (its KV events are then read over CURVE); ``None``: not listed, read plain."""
        if self.credentials is None or not spec.instance_id:
            return None
        return next((m.public for m in self.credentials.members.current().values() if m.name == spec.instance_id),
                    None)

    def _on_down(self, name: str) -> None:
        self.index.drop(name)
        self.load.reset(name)

    def _on_restart(self, name: str) -> None:
        log.warning("kvtier router: backend %s restarted (metrics start time changed): dropping its routes", name)
        self.index.drop(name)

    def _on_feed_restart(self, name: str) -> None:
        log.warning("kvtier router: KV events of %s restarted: dropping its routes", name)

    # -- deciding ---------------------------------------------------------------------------
    async def _controller_rows(self, tokens: list[int], salt: str | None = None) -> dict[str, dict[str, int]]:
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
                                              params={"cache_salt": salt} if salt else None,
                                              headers=headers, timeout=c.controller_timeout_s)
            r.raise_for_status()
            rows = r.json().get("instances", {})
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            self.controller_errors += 1
            self.controller_last_error = f"{type(exc).__name__}: {exc}"
            return {}
        return rows if isinstance(rows, dict) else {}

    async def candidates(self, tokens: list[int] | None, salt: str | None = None) -> list[Candidate]:
        """The healthy backends with their predicted hits and load for ``tokens``.

        ``salt`` (the request's ``cache_salt``) enters the first block's key as vLLM's does (its
        event ``extra_keys`` carry ``(salt,)`` for block 0), so a salted prompt matches only
        blocks stored under the same salt, and the controller is asked within that salt."""
        healthy = self.pool.healthy()
        w = self.config.weights
        rows = await self._controller_rows(tokens, salt) if tokens and self.config.policy == "kv-aware" else {}
        extra = [(salt,)] if salt else None
        keys_by_bs: dict[int, list[bytes]] = {}
        out = []
        for b in healthy:
            hit_tokens, hit_score = 0, 0.0
            per_tier: dict[str, int] = {}
            if tokens and self.config.policy == "kv-aware":
                row = rows.get(b.spec.instance_id or "") if b.spec.instance_id else None
                hit_tokens, hit_score, per_tier = predicted_hit(self.index, b.name, tokens, keys_by_bs, w,
                                                                row if isinstance(row, dict) else None,
                                                                extra_keys=extra)
            out.append(Candidate(name=b.name, index=b.index, hit_tokens=hit_tokens, hit_score=hit_score,
                                 per_tier=per_tier, load_tokens=self.load.load_tokens(b.name),
                                 last_assigned=self.load.last_assigned(b.name)))
        return out

    async def decide(self, tokens: list[int] | None, salt: str | None = None) -> Decision | None:
        """Rank the healthy backends for a prompt (``None``: none healthy); ``salt``: its ``cache_salt``."""
        cands = await self.candidates(tokens, salt)
        if not cands:
            return None
        d = rank(self.config.policy, cands, self.config.weights.load, self._rr)
        if d.policy == "round-robin":
            self._rr = (d.choice.index + 1) % len(self.config.backends)
        return d

    #: Requests a backend serves before a feed that delivered no KV event is reported silent.
    SILENT_AFTER_REQUESTS = 4

    def events_silent(self, name: str) -> bool:
        """True when ``name`` has a KV-event feed that delivered nothing although the backend
        served :data:`SILENT_AFTER_REQUESTS` requests: kv-aware routing is blind to its cache
        (a silent 0% predicted hit rate, e.g. vLLM *connecting* its publisher because its
        endpoint was ``tcp://HOST:PORT`` instead of the bind form ``tcp://*:PORT``)."""
        feed = self.feeds.get(name)
        return (feed is not None and feed.batches == 0
                and self._served.get(name, 0) >= self.SILENT_AFTER_REQUESTS)

    def _record(self, path: str, tokens: list[int] | None, d: Decision, served_by: str | None,
                attempts: list[dict[str, Any]]) -> None:
        if served_by is not None:
            self._served[served_by] = self._served.get(served_by, 0) + 1
            if served_by not in self._silent_warned and self.events_silent(served_by):
                self._silent_warned.add(served_by)
                feed = self.feeds[served_by]
                log.warning("kvtier router: no KV events from %s (%s) after %d requests it served: routing "
                            "cannot see its cache. vLLM binds its publisher only for tcp://*:PORT (or ipc://); "
                            "with tcp://HOST:PORT it connects, and nobody receives.", served_by,
                            feed.stats().get("endpoint"), self._served[served_by])
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
        """Read the body within its bound, parse and tokenize it off the loop (:mod:`.admission`),
        decide, forward (with one retry), record. Refusals: 413 (body beyond ``max_body_bytes``),
        429 (the client has too much work in progress), 400 (not a JSON object, or a prompt
        beyond the model's context)."""
        limit = self.max_prompt_tokens
        try:
            body = await self.admission.read_body(request)
            prep = await self.admission.run(request, len(body), lambda: prepare(body, chat, self.tokenizer, limit))
        except Refused as exc:
            self.metrics.refused.labels(str(exc.status)).inc()
            kind = {429: "TooManyRequests", 408: "RequestTimeout", 503: "ServiceUnavailable"}.get(exc.status,
                                                                                                 "PayloadTooLarge")
            return _error(exc.status, exc.message, kind, exc.headers)
        except BadBody as exc:
            self.metrics.refused.labels("400").inc()
            return _error(400, str(exc), "BadRequestError")
        except PromptTooLong as exc:
            self.metrics.refused.labels("400").inc()
            return _error(400, f"{exc} (max_model_len {exc.limit}); shorten the prompt", "BadRequestError")
        tokens, salt = prep.tokens, prep.salt
        if tokens is None:
            log.debug("kvtier router: routing without tokens: %s", prep.why_untokenized)
            self.metrics.untokenized.inc()
        d = await self.decide(tokens, salt)
        if d is None:
            why = "; ".join(f"{b.name}: {b.last_error}" for b in self.pool.backends)
            return JSONResponse({"error": {"message": f"no healthy backend ({why})", "type": "ServiceUnavailable",
                                           "code": 503}}, status_code=503)
        headers = forward_headers(request.headers)
        n_tokens = len(tokens) if tokens else 0
        assert self._client is not None
        fwd = await self.forwarder.forward(self._client, d, path, body, headers, n_tokens)
        self._record(path, tokens, d, fwd.served_by, fwd.attempts)
        if fwd.response is not None:
            return fwd.response
        return JSONResponse({"error": {"message": f"no backend answered: {fwd.attempts}", "type": "ServiceUnavailable",
                                       "code": 503}}, status_code=503)

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
                        "events": self.feeds[n].stats() if n in self.feeds else None,
                        "events_silent": self.events_silent(n), "served": self._served.get(n, 0)} for n in pool}
        return {"policy": self.config.policy, "backends": backends, "decisions": list(self.decisions),
                "bounds": {"max_prompt_tokens": self.max_prompt_tokens, **self.admission.stats()},
                "controller": {"url": mask_url(self.config.controller_url or "") or None,
                               "errors": self.controller_errors, "last_error": self.controller_last_error}}

    def metrics_text(self) -> bytes:
        """The Prometheus exposition of :attr:`metrics` (gauges refreshed first)."""
        for b in self.pool.backends:
            self.metrics.healthy.labels(b.name).set(1 if b.healthy else 0)
            self.metrics.load.labels(b.name).set(self.load.load_tokens(b.name))
        for n, st in self.index.stats().items():
            self.metrics.blocks.labels(n).set(st["blocks"])
        return generate_latest(self.metrics.registry)
