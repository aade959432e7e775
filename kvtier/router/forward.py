"""Forwarding one routed request to its backend: one attempt, streaming pass-through, one retry.

A request whose backend cannot be reached (connect timeout, refused, reset, 502/503/504, or
the backend leaving the pool while the request waits) is retried once on the next-ranked
backend, provided nothing was sent to the client yet. Every answer, streamed or not, is passed
through chunk by chunk as it arrives (never held whole: :mod:`.passthrough`); one the backend
cuts after its first bytes reaches the client as a cut (an SSE error event, then an incomplete
body), never as a clean finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from fastapi.responses import Response

from kvtier.router.load import LoadTracker
from kvtier.router.metrics import RouterMetrics
from kvtier.router.passthrough import PassThrough, StreamCut
from kvtier.router.pool import BackendPool, BackendState
from kvtier.router.scoring import Candidate, Decision

log = logging.getLogger("kvtier.router")
T = TypeVar("T")

#: Request headers not passed on to a backend (hop-by-hop, or recomputed by the client).
HOP_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade",
                         "proxy-connection", "te", "trailer", "accept-encoding"})
#: Answer headers passed on from the backend besides the content type (an answer passed whole
#: keeps its length, so a cut falls short of it; its encoding, so a compressed body stays readable).
_PASSED_HEADERS = frozenset({"content-length", "content-encoding"})
#: Backend statuses that count as "unavailable" (the request is retried elsewhere).
RETRY_STATUS = frozenset({502, 503, 504})


class BackendUnavailable(Exception):
    """The backend could not serve the request before anything reached the client."""


async def race(aw: Awaitable[T], down: asyncio.Event) -> T:
    """``await aw``, unless ``down`` is set first.

    Raises:
        BackendUnavailable: ``down`` was set before ``aw`` completed (``aw`` is cancelled).
    """
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


def forward_headers(headers: Any) -> dict[str, str]:
    """The client's request headers, less :data:`HOP_HEADERS` (``headers``: any ``items()`` mapping)."""
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}


@dataclass
class Forwarded:
    """What :meth:`Forwarder.forward` did: the answer (``None``: no backend answered), the
    backend that served it, and every attempt (``{"backend", "error"}`` or, last on success,
    ``{"backend", "status"}``)."""

    response: Response | None
    served_by: str | None
    attempts: list[dict[str, Any]] = field(default_factory=list)


class Forwarder:
    """Sends routed requests to backends, updating the pool, the load and the metrics.

    Args:
        pool: marks a backend failing (and down) on transport errors and 502/503/504.
        load: counts each request's prompt tokens while it is in flight.
        metrics: request, failure, retry and hit counters.
    """

    def __init__(self, pool: BackendPool, load: LoadTracker, metrics: RouterMetrics) -> None:
        self.pool = pool
        self.load = load
        self.metrics = metrics

    async def forward(self, client: httpx.AsyncClient, d: Decision, path: str, body: bytes,
                      headers: dict[str, str], n_tokens: int) -> Forwarded:
        """Try ``d.order[0]``, then ``d.order[1]`` if the first failed (one that left the pool is skipped)."""
        attempts: list[dict[str, Any]] = []
        for cand in d.order[:2]:
            b = self.pool.by_name[cand.name]
            if not b.healthy:
                continue
            if attempts:
                self.metrics.retries.inc()
            try:
                resp = await self.attempt(client, b, path, body, headers, n_tokens, cand, d)
            except BackendUnavailable as exc:
                attempts.append({"backend": b.name, "error": str(exc)})
                continue
            return Forwarded(resp, b.name, attempts + [{"backend": b.name, "status": resp.status_code}])
        return Forwarded(None, None, attempts)

    async def attempt(self, client: httpx.AsyncClient, b: BackendState, path: str, body: bytes,
                      headers: dict[str, str], n_tokens: int, cand: Candidate, d: Decision) -> Response:
        """Send one request to ``b``; its answer streamed through as it comes (:class:`PassThrough`).

        ``n_tokens`` (prompt tokens) count in ``b``'s load until the answer is sent or cut.
        The answer carries the ``x-kvtier-*`` headers of ``cand`` and ``d``.

        Raises:
            BackendUnavailable: ``b`` could not be reached, answered 502/503/504, failed before
                its first bytes, or left the pool while the request waited (nothing was sent
                to the client, so the request may be retried elsewhere).
        """
        down = b.event()
        self.load.begin(b.name, n_tokens)
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                self.load.end(b.name, n_tokens)

        req = client.build_request("POST", b.spec.url + path, content=body, headers=headers)
        try:
            resp = await race(client.send(req, stream=True), down)
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
        if resp.status_code in RETRY_STATUS:
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
            first = await race(chunks.__anext__(), down)
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
        passed = {k: v for k, v in resp.headers.items() if k.lower() in _PASSED_HEADERS}

        async def body_iter() -> AsyncIterator[bytes]:
            try:
                if first:
                    yield first
                while True:
                    try:
                        chunk = await race(chunks.__anext__(), down)
                    except StopAsyncIteration:
                        break
                    except (httpx.HTTPError, BackendUnavailable) as exc:
                        self.metrics.failures.labels(b.name).inc()
                        self.metrics.cut.labels(b.name).inc()
                        log.warning("kvtier router: answer from %s cut: %s", b.name, exc)
                        raise StreamCut(f"the answer from backend {b.name} was cut: {type(exc).__name__}") from None
                    yield chunk
            finally:
                await resp.aclose()
                end()

        return PassThrough(body_iter(), status_code=resp.status_code, headers={**passed, **out_headers},
                           media_type=ctype)
