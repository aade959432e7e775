"""The controller's HTTP API (FastAPI; the OpenAPI schema is served at ``/openapi.json``).

Endpoints (JSON): ``POST /lookup`` and ``POST /locate`` (synchronous, from the index), ``POST /clear``, ``/pin``,
``/unpin``, ``/move``, ``/compress``, ``/decompress`` (asynchronous: they answer the
operation record with its ``event_id``; ``"wait": true`` waits for the terminal state),
``GET /health``, ``/instances``, ``/check_finish/{event_id}``, ``/metrics`` (Prometheus
text, a private registry).

Errors: malformed input is 422 and ``detail`` names the field (e.g. ``tokens.3: ...``);
an unknown instance is 404 naming it; a request that cannot be served as asked (a tier
the instance lacks, no shared tier for a move, an unresolvable salt scope) is 400; a
missing or wrong bearer token is 401 (when the controller has a token). A controller
without a token (loopback only) answers 403 to any request whose ``Host`` header is not a
loopback name or address (a DNS-rebinding page; :mod:`kvtier.dashboard.access`).
"""

from __future__ import annotations

import hmac
import time
from typing import TYPE_CHECKING, Annotated, Any, Iterator, Literal, Optional, Protocol

import msgspec
import numpy as np
from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from kvtier.controller.operations import BadRequest, UnknownInstance
from kvtier.protocol.decoding import decode
from kvtier.controller.body_gate import BodyGate
from kvtier.protocol.fleet import MAX_LOCATE_KEYS
from kvtier.storage.types import TIER_KINDS

if TYPE_CHECKING:
    from kvtier.controller.operations import FleetOps
    from kvtier.controller.state import FleetState


class ServedController(Protocol):
    """What the HTTP API reads of the controller it serves (:class:`kvtier.controller.server.Controller`).

    A Protocol rather than the class: the server builds this API, so naming the class here made the two
    modules a cycle (issue 25).
    """

    token: str
    state: FleetState
    ops: FleetOps
    http_host: str
    http_port: int

#: Most tokens one request may carry (a 4M-token prompt).
MAX_TOKENS = 1 << 22
#: The token routes that take a body: their body is read only from a client with the token.
API_BODY_ROUTES = ("/lookup", "/locate", "/clear", "/pin", "/unpin", "/move", "/compress", "/decompress")
#: Largest request body of those routes, bytes: a JSON ``/lookup`` of ``MAX_TOKENS`` token ids
#: (up to 10 digits and a separator each; a binary body is 4 bytes a token). Larger: 413.
MAX_BODY_BYTES = 12 * MAX_TOKENS + (64 << 10)

Token = Annotated[StrictInt, Field(ge=0, lt=2**32)]
HexKey = Annotated[str, Field(pattern=r"^[0-9a-fA-F]{64}$")]
Tier = Literal[TIER_KINDS]  # type: ignore[valid-type]
InstanceId = Annotated[str, Field(min_length=1, max_length=255)]
Salt = Annotated[str, Field(max_length=4096)]
Tokens = Annotated[list[Token], Field(min_length=1, max_length=MAX_TOKENS)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LookupRequest(_Model):
    """Exactly one of ``tokens`` (token ids) or ``keys`` (hex chunk keys, prompt order)."""

    tokens: Optional[Annotated[list[Token], Field(max_length=MAX_TOKENS)]] = None
    keys: Optional[Annotated[list[HexKey], Field(max_length=MAX_TOKENS)]] = None
    cache_salt: Optional[Salt] = None
    instance: Optional[InstanceId] = None

    @model_validator(mode="after")
    def _one_of(self) -> "LookupRequest":
        if (self.tokens is None) == (self.keys is None):
            raise ValueError("tokens/keys: give exactly one of tokens or keys")
        return self


class LocateRequest(_Model):
    """Which live instances serve these chunk keys to peers (``POST /locate``).

    ``keys``: hex chunk keys in prompt order; ``namespace``: the hex namespace digest;
    ``exclude_instance`` / ``exclude_host`` + ``exclude_pid``: the asker (never answered).
    """

    keys: Annotated[list[HexKey], Field(min_length=1, max_length=MAX_LOCATE_KEYS)]
    namespace: HexKey
    exclude_instance: Optional[InstanceId] = None
    exclude_host: Optional[Annotated[str, Field(min_length=1, max_length=255)]] = None
    exclude_pid: Optional[Annotated[StrictInt, Field(ge=0, lt=2**32)]] = None


class _Async(_Model):
    wait: StrictBool = Field(False, description="Wait for the terminal state (up to the op deadline).")


class ClearRequest(_Async):
    instance: Optional[InstanceId] = None
    tier: Optional[Tier] = None
    cache_salt: Optional[Salt] = None


class PinRequest(_Async):
    tokens: Tokens
    instance: Optional[InstanceId] = None
    ttl_s: Optional[Annotated[float, Field(gt=0, le=1e7)]] = None
    cache_salt: Optional[Salt] = None


class UnpinRequest(_Async):
    """``pin_id`` (a pin's id: the ``event_id`` of the pin operation) and/or ``tokens`` (every
    pin covering a chunk of them)."""

    tokens: Optional[Tokens] = None
    instance: Optional[InstanceId] = None
    pin_id: Optional[Annotated[str, Field(min_length=1, max_length=256)]] = None
    cache_salt: Optional[Salt] = None

    @model_validator(mode="after")
    def _what(self) -> "UnpinRequest":
        if self.tokens is None and self.pin_id is None:
            raise ValueError("tokens/pin_id: give tokens or pin_id")
        return self


class MoveRequest(_Async):
    tokens: Tokens
    from_instance: InstanceId
    to_tier: Tier
    from_tier: Optional[Tier] = None
    to_instance: Optional[InstanceId] = None
    copy_: StrictBool = Field(False, alias="copy")
    cache_salt: Optional[Salt] = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class DecompressRequest(_Async):
    tokens: Tokens
    instance: Optional[InstanceId] = None
    tier: Optional[Tier] = None
    cache_salt: Optional[Salt] = None


class CompressRequest(DecompressRequest):
    codec: Annotated[str, Field(min_length=1, max_length=64)]

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, v: str) -> str:
        from kvtier.serde.registry import CODECS

        if v not in CODECS:
            raise ValueError(f"unknown codec {v!r}; choose one of {sorted(CODECS)}")
        return v


def _field(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or "body"


class _LookupBody(msgspec.Struct, forbid_unknown_fields=True):
    """The JSON lookup body, decoded by msgspec (same constraints as :class:`LookupRequest`)."""

    tokens: Optional[Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=2**32)]], msgspec.Meta(max_length=MAX_TOKENS)]] = None
    keys: Optional[Annotated[list[Annotated[str, msgspec.Meta(pattern=r"^[0-9a-fA-F]{64}$")]],
                             msgspec.Meta(max_length=MAX_TOKENS)]] = None
    cache_salt: Optional[Annotated[str, msgspec.Meta(max_length=4096)]] = None
    instance: Optional[Annotated[str, msgspec.Meta(min_length=1, max_length=255)]] = None


_LOOKUP_DECODER = msgspec.json.Decoder(_LookupBody)
_JSON = msgspec.json.Encoder()


def _invalid_field(field: str, message: str) -> RequestValidationError:
    return RequestValidationError([{"loc": ("body", *field.split(".")), "msg": message, "type": "value_error"}])


def _decode_lookup(body: bytes) -> _LookupBody:
    """Decode and check a JSON lookup body.

    Raises:
        RequestValidationError: malformed JSON, a field of the wrong type or range (the message
            names it, e.g. ``tokens.3``), or not exactly one of tokens/keys.
    """
    try:
        req = decode(_LOOKUP_DECODER, body)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        path = msg.rsplit(" - at `$", 1)
        field = path[1].rstrip("`").lstrip(".").replace("[", ".").replace("]", "") if len(path) == 2 else "body"
        raise _invalid_field(field or "body", path[0]) from None
    except msgspec.DecodeError as exc:
        raise _invalid_field("body", f"not a JSON object: {exc}") from None
    if (req.tokens is None) == (req.keys is None):
        raise _invalid_field("tokens", "give exactly one of tokens or keys")
    return req


class _Collector:
    """Controller state read at scrape time."""

    def __init__(self, controller: ServedController):
        self._c = controller

    def collect(self) -> Iterator[Metric]:
        state = self._c.state
        insts = self._c.ops.instances()
        yield GaugeMetricFamily("kvtier_controller_instances", "Registered instances", value=len(insts))
        chunks = GaugeMetricFamily("kvtier_controller_tier_chunks", "Chunks indexed per instance and tier",
                                   labels=["instance", "tier"])
        nbytes = GaugeMetricFamily("kvtier_controller_tier_bytes", "Bytes indexed per instance and tier",
                                   labels=["instance", "tier"])
        for i in insts:
            for t in i["tiers"]:
                chunks.add_metric([i["instance"], t["kind"]], t["chunks"])
                nbytes.add_metric([i["instance"], t["kind"]], t["bytes"])
        yield chunks
        yield nbytes
        with state.lock:
            counters = dict(state.counters)
            counters["seq_gaps"] = state.index.gaps
            counters["snapshots_applied"] = state.index.snapshots_applied
            counters["changes_applied"] = state.index.changes_applied
        endpoint = getattr(self._c, "endpoint", None)
        if endpoint is not None:  # times its thread was not running (not held against instances' silence)
            counters["endpoint_stalls"] = endpoint.stalls
            counters["endpoint_stalled_seconds"] = round(endpoint.stalled_s, 3)
        for name, value in sorted(counters.items()):
            yield CounterMetricFamily(f"kvtier_controller_{name}", f"Controller {name.replace('_', ' ')}", value=value)
        ops = GaugeMetricFamily("kvtier_controller_operations", "Tracked operations by state", labels=["state"])
        for st, n in self._c.ops.tracker.counts().items():
            ops.add_metric([st], n)
        yield ops


def create_app(controller: ServedController) -> FastAPI:
    """The FastAPI app serving ``controller`` (its ``ops``, ``state`` and ``token``)."""
    from kvtier.version import __version__

    app = FastAPI(title="kvtier controller", version=__version__,
                  description="One API over every registered kvtier instance's cache.")
    ops = controller.ops
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_Collector(controller))
    lookup_seconds = Histogram("kvtier_controller_lookup_seconds", "Lookup latency",
                               buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 0.1, 1.0), registry=registry)
    bearer = HTTPBearer(auto_error=False)

    async def auth(creds: Optional[HTTPAuthorizationCredentials] = Depends(bearer)) -> None:
        # async: a sync dependency would cost a thread-pool hop on every request (~0.3 ms)
        token = controller.token
        if not token:
            return
        if creds is None or not hmac.compare_digest(creds.credentials.encode(), token.encode()):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"field": _field(tuple(e.get("loc", ()))), "message": str(e.get("msg", ""))} for e in exc.errors()]
        detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors[:5]) or "invalid request"
        return JSONResponse({"detail": detail, "errors": errors[:50]}, status_code=422)

    @app.exception_handler(UnknownInstance)
    async def _unknown(request: Request, exc: UnknownInstance) -> JSONResponse:
        return JSONResponse({"detail": str(exc), "field": "instance", "instance": exc.instance}, status_code=404)

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse({"detail": str(exc), "field": exc.field}, status_code=400)

    deps = [Depends(auth)]
    from kvtier.dashboard.access import DashboardAccess, LoopbackHostOnly
    from kvtier.dashboard.fastapi_routes import mount_dashboard  # the page at /; its data behind the token

    access = DashboardAccess(lambda: controller.token, controller.http_host, lambda: controller.http_port)
    app.add_middleware(LoopbackHostOnly, access=access)  # tokenless: loopback Host names only (DNS rebinding)
    # Outermost: no body is read for a token route without the token, and every body is bounded.
    app.add_middleware(BodyGate, token=lambda: controller.token, protected=API_BODY_ROUTES, max_body=MAX_BODY_BYTES)
    dash = mount_dashboard(app, controller, registry, access)

    def _answer(rec_json: dict[str, Any] | None, event_id: str, wait: bool) -> dict[str, Any]:
        if wait:
            out = ops.tracker.wait(event_id, ops.deadline_s + 2.0)
        else:
            out = rec_json
        return out or {"event_id": event_id, "state": "failed", "reason": "forgotten"}

    def _async(rec: Any, wait: bool) -> dict[str, Any]:
        return _answer(ops.tracker.get(rec.event_id), rec.event_id, wait)

    lookup_body = {
        "required": True,
        "content": {
            "application/json": {"schema": LookupRequest.model_json_schema()},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    }

    @app.post("/lookup", dependencies=deps, summary="Longest cached prefix per instance and tier",
              openapi_extra={"requestBody": lookup_body})
    async def lookup(request: Request, cache_salt: Annotated[Optional[str], Query(max_length=4096)] = None,
                     instance: Annotated[Optional[str], Query(min_length=1, max_length=255)] = None) -> Response:
        """JSON body (:class:`LookupRequest`), or the token ids as a binary body of little-endian uint32
        (``Content-Type: application/octet-stream``; ``cache_salt``/``instance`` then as query parameters).

        The body is decoded with msgspec, not through pydantic: validating a 32k-token list
        element by element costs ~3 ms, the whole lookup budget (``kvtier bench controller``).
        """
        t0 = time.perf_counter()
        body = await request.body()
        keys: Optional[list[bytes]] = None
        tokens: Any = None
        if request.headers.get("content-type", "").split(";")[0].strip() == "application/octet-stream":
            if len(body) % 4 or not body:
                raise _invalid_field("body", f"binary token ids must be a non-empty multiple of 4 bytes, got {len(body)}")
            if len(body) // 4 > MAX_TOKENS:
                raise _invalid_field("body", f"at most {MAX_TOKENS} tokens")
            tokens = np.frombuffer(body, dtype="<u4")
            salt, inst = cache_salt, instance
        else:
            req = _decode_lookup(body)
            tokens = req.tokens
            if req.keys is not None:
                keys = [bytes.fromhex(k) for k in req.keys]
            salt = req.cache_salt if req.cache_salt is not None else cache_salt
            inst = req.instance if req.instance is not None else instance
        out = ops.lookup(tokens=tokens, keys=keys, cache_salt=salt, instance=inst)
        dash.observe_lookup(tokens, salt, out)
        lookup_seconds.observe(time.perf_counter() - t0)
        return Response(_JSON.encode(out), media_type="application/json")

    @app.post("/locate", dependencies=deps, summary="Live peer-serving instances holding a run of chunk keys")
    async def locate(req: LocateRequest) -> Response:
        """Every live instance with a peer URL in ``namespace`` (the asker excluded) and the leading
        ``keys`` its CPU/disk tiers hold, longest first (:func:`kvtier.controller.ops_locate.locate`)."""
        out = ops.locate([bytes.fromhex(k) for k in req.keys], bytes.fromhex(req.namespace), req.exclude_instance,
                         req.exclude_host, req.exclude_pid)
        return Response(_JSON.encode(out), media_type="application/json")

    @app.post("/clear", dependencies=deps, summary="Clear an instance/tier/salt scope (async)")
    def clear(req: ClearRequest) -> dict[str, Any]:
        return _async(ops.clear(req.instance, req.tier, req.cache_salt), req.wait)

    @app.post("/pin", dependencies=deps, summary="Pin the cached prefix of tokens (async)")
    def pin(req: PinRequest) -> dict[str, Any]:
        return _async(ops.pin(req.tokens, req.instance, req.ttl_s, req.cache_salt), req.wait)

    @app.post("/unpin", dependencies=deps, summary="Unpin the prefix of tokens (async)")
    def unpin(req: UnpinRequest) -> dict[str, Any]:
        return _async(ops.unpin(req.tokens, req.instance, req.pin_id, req.cache_salt), req.wait)

    @app.post("/move", dependencies=deps, summary="Move or copy a cached prefix between tiers/instances (async)")
    def move(req: MoveRequest) -> dict[str, Any]:
        rec = ops.move(req.tokens, req.from_instance, req.to_tier, req.to_instance, req.from_tier, req.copy_,
                       req.cache_salt)
        return _async(rec, req.wait)

    @app.post("/compress", dependencies=deps, summary="Re-encode a cached prefix with a codec (async)")
    def compress(req: CompressRequest) -> dict[str, Any]:
        return _async(ops.compress(req.tokens, req.codec, req.instance, req.tier, req.cache_salt), req.wait)

    @app.post("/decompress", dependencies=deps, summary="Re-encode a cached prefix raw (async)")
    def decompress(req: DecompressRequest) -> dict[str, Any]:
        return _async(ops.compress(req.tokens, "raw", req.instance, req.tier, req.cache_salt), req.wait)

    @app.get("/health", dependencies=deps, summary="Per-instance tier health")
    def health(instance: Annotated[Optional[str], Query(min_length=1, max_length=255)] = None,
               live: bool = False) -> dict[str, Any]:
        out = ops.health(instance, live)
        out["status"] = "ok"
        return out

    @app.get("/instances", dependencies=deps, summary="Registered instances")
    def instances() -> dict[str, Any]:
        return {"instances": ops.instances()}

    @app.get("/check_finish/{event_id}", dependencies=deps, summary="State of an asynchronous operation")
    def check_finish(event_id: Annotated[str, Path(min_length=1, max_length=64)]) -> dict[str, Any]:
        out = ops.check_finish(event_id)
        if out is None:
            raise HTTPException(404, f"unknown event_id {event_id!r}")
        return out

    @app.get("/metrics", dependencies=deps, summary="Prometheus metrics", response_class=PlainTextResponse)
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    return app
