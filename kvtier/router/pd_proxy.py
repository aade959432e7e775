"""``kvtier pd-proxy``: the prefill/decode disaggregation proxy (vLLM's documented PD proxy pattern).

Each ``POST /v1/completions`` or ``/v1/chat/completions`` goes first to a prefiller
(round robin) as a non-streaming request with ``max_tokens=1`` (and
``max_completion_tokens=1``) and ``kv_transfer_params={"do_remote_decode": true}``;
the ``kv_transfer_params`` of its answer are added to the original request, which
goes to a decoder (round robin), its answer (streamed or not) passed through.

The proxy's clients are not trusted with the PD protocol: ``kv_transfer_params`` a client
sends (at the top level or inside ``vllm_xargs``) are dropped from both legs, so a decoder
only ever receives the parameters the proxy's own prefiller returned (or none), never a
host:port, engine id or request id of the client's choosing (:func:`client_body`). The
prefill leg also drops what would make the one-token leg fail or grow (``min_tokens``,
``echo``, ``prompt_logprobs``), and its answer is read up to :data:`MAX_PREFILL_ANSWER_BYTES`.

A prefiller that cannot be reached, answers an error or returns no
``kv_transfer_params`` is skipped: the decoder then computes the prompt itself
(slower, same tokens). A decoder that cannot be reached answers 502; one that cuts its
answer mid-way is passed on as a cut (:mod:`kvtier.router.passthrough`). Answers carry
``x-kvtier-prefill`` (the prefiller's URL, or "skipped") and ``x-kvtier-decode``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvtier.protocol.decoding import json_dumps, json_loads
from kvtier.urls import mask_url
from kvtier.router.admission import DEFAULT_MAX_BODY_BYTES, Admission, Refused
from kvtier.router.app_server import AppServer
from kvtier.router.passthrough import PassThrough, StreamCut

log = logging.getLogger("kvtier.router.pd")

#: Request headers not passed on (hop-by-hop, or recomputed by the client).
_HOP = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade",
                  "te", "trailer", "accept-encoding"})


@dataclass
class PDProxyStats:
    """Counters of one proxy (requests, prefills skipped, decoder failures)."""

    requests: int = 0
    prefilled: int = 0
    prefill_skipped: int = 0
    decode_failed: int = 0
    last_params: dict[str, Any] = field(default_factory=dict)  # the last prefill's kv_transfer_params


#: Longest prefill-leg answer read (bytes; one token's answer is < 1 KiB plus the params).
MAX_PREFILL_ANSWER_BYTES = 1 << 20
#: Prefill-leg fields the proxy drops: they would make a one-token leg fail (``min_tokens`` > 1)
#: or make its answer as large as the prompt (``echo``, ``prompt_logprobs``).
_PREFILL_DROPPED = ("stream_options", "min_tokens", "echo", "prompt_logprobs")


def client_body(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` without any ``kv_transfer_params`` of the client's (top level and ``vllm_xargs``,
    where vLLM also reads them): only the proxy sets them."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    xargs = out.get("vllm_xargs")
    if isinstance(xargs, dict) and "kv_transfer_params" in xargs:
        out["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_transfer_params"}
    return out


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg of ``body``: one token, not streamed, ``do_remote_decode`` (the client's
    own ``kv_transfer_params`` and the fields in :data:`_PREFILL_DROPPED` removed)."""
    out = client_body(body)
    for k in _PREFILL_DROPPED:
        out.pop(k, None)
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg of ``body``: the client's request with the prefiller's ``params`` only
    (``None``: no ``kv_transfer_params`` at all; the decoder computes the prompt)."""
    out = client_body(body)
    if params is not None:
        out["kv_transfer_params"] = params
    return out


def _parse_and_prefill_leg(raw: bytes) -> tuple[dict[str, Any], bytes]:
    """The client's body and its prefill leg, encoded (on a worker thread).

    Raises:
        ValueError: not JSON, or not an object.
    """
    body = json_loads(raw)
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    return body, json_dumps(prefill_body(body))


def create_pd_app(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 600.0,
                  connect_timeout_s: float = 5.0,
                  max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> tuple[FastAPI, PDProxyStats]:
    """The proxy app and its counters (``max_body_bytes``: larger request bodies are 413).

    Raises:
        ValueError: no prefill or no decode URL.
    """
    if not prefill_urls or not decode_urls:
        raise ValueError("pd-proxy needs at least one --prefill and one --decode URL")
    stats = PDProxyStats()
    prefills = itertools.cycle([u.rstrip("/") for u in prefill_urls])
    decodes = itertools.cycle([u.rstrip("/") for u in decode_urls])
    holder: dict[str, httpx.AsyncClient] = {}
    admission = Admission(max_body_bytes)  # bodies bounded, parsed off the event loop

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        holder["c"] = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        try:
            yield
        finally:
            await holder["c"].aclose()
            admission.close()

    app = FastAPI(title="kvtier pd-proxy", lifespan=lifespan)

    async def prefill(path: str, content: bytes, headers: dict[str, str]) -> tuple[str, dict | None]:
        url = next(prefills)
        try:
            client = holder["c"]
            req = client.build_request("POST", url + path, content=content, headers=headers)
            r = await client.send(req, stream=True)
            try:
                raw = b""
                async for chunk in r.aiter_bytes():
                    raw += chunk
                    if len(raw) > MAX_PREFILL_ANSWER_BYTES:
                        raise ValueError(f"prefill answer beyond {MAX_PREFILL_ANSWER_BYTES} bytes")
            finally:
                await r.aclose()
            if r.status_code != 200:
                log.warning("pd-proxy: prefiller %s answered %d; the decoder computes the prompt", mask_url(url), r.status_code)
                return url, None
            params = json_loads(raw).get("kv_transfer_params")
            return url, params if isinstance(params, dict) else None
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            log.warning("pd-proxy: prefiller %s failed (%s); the decoder computes the prompt", mask_url(url), exc)
            return url, None

    async def handle(path: str, request: Request) -> Response:
        stats.requests += 1
        # The body is parsed and each leg encoded on the proxy's worker threads, never its event loop.
        try:
            raw = await admission.read_body(request)
            body, pleg = await admission.run(request, len(raw), lambda: _parse_and_prefill_leg(raw))
        except Refused as exc:
            return JSONResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers)
        except ValueError as exc:
            return JSONResponse({"error": f"bad request body: {exc}"}, status_code=400)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers["content-type"] = "application/json"
        purl, params = await prefill(path, pleg, headers)
        if params is None:
            stats.prefill_skipped += 1
            purl = "skipped"
        else:
            stats.prefilled += 1
            stats.last_params = params
        try:
            dleg = await admission.run(request, len(raw), lambda: json_dumps(decode_body(body, params)))
        except Refused as exc:
            return JSONResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers)
        durl = next(decodes)
        out_headers = {"x-kvtier-prefill": mask_url(purl), "x-kvtier-decode": mask_url(durl)}  # clients see these
        client = holder["c"]
        try:
            req = client.build_request("POST", durl + path, content=dleg, headers=headers)
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as exc:
            stats.decode_failed += 1
            return JSONResponse({"error": f"decoder {mask_url(durl)} unreachable: {exc}"}, status_code=502, headers=out_headers)
        media = resp.headers.get("content-type", "application/json")

        async def body_iter() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:  # surfaced to the client as a cut, never a clean finish
                log.warning("pd-proxy: decoder %s stream cut: %s", mask_url(durl), exc)
                raise StreamCut(f"the decoder's answer was cut: {type(exc).__name__}") from None
            finally:
                await resp.aclose()

        passed = {k: v for k, v in resp.headers.items() if k.lower() in ("content-length", "content-encoding")}
        return PassThrough(body_iter(), status_code=resp.status_code, media_type=media,
                           headers={**passed, **out_headers})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            r = await holder["c"].get(next(decodes) + "/v1/models")
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        except httpx.HTTPError as exc:
            return JSONResponse({"error": str(exc)}, status_code=502)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"requests": stats.requests, "prefilled": stats.prefilled,
                             "prefill_skipped": stats.prefill_skipped, "decode_failed": stats.decode_failed})

    return app, stats


class PDProxyServer(AppServer):
    """Run the proxy on uvicorn in a background thread (tests) or the calling one (the CLI).

    ``port`` 0: any free port (see :attr:`url`).
    """

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], host: str = "127.0.0.1", port: int = 8200,
                 timeout_s: float = 600.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        app, self.stats = create_pd_app(prefill_urls, decode_urls, timeout_s, max_body_bytes=max_body_bytes)
        super().__init__(app, host, port, "kvtier pd-proxy")
