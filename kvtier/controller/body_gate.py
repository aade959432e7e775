"""ASGI middleware: the controller's request bodies are bounded, and a body meant for a
token-protected route is never read from a client that does not present the token.

Why (hostile trial, December 7): FastAPI reads and validates a request's body before a route's
``Depends(auth)`` runs, and the controller had no body limit. A stranger without the token
declared 64 MiB bodies on ``POST /locate`` and left them unfinished (each held ~64 MB of the
controller's memory: 75 -> 269 MB with 3 connections), got a 422 for a junk body instead of a
401, and two such loops of 97 MB bodies raised a member's ``/lookup`` p99 from 1.3 to 247 ms.

What this does, before the app sees the request:

- on a route in ``protected`` while the controller has a token, a request whose ``Authorization``
  is not ``Bearer <token>`` (constant-time compare) is answered 401 at once, its body unread;
- every request's body is bounded: ``Content-Length`` over the route's limit is answered 413 at
  once; a body without one (chunked) is counted as it arrives and cut with a 413 at the limit.

Limits (bytes): ``max_body`` for the protected API routes (the largest legal ``/lookup``:
:data:`kvtier.controller.api.MAX_TOKENS` token ids, as uint32 or as JSON numbers), ``small_body``
for every other route (dashboard sign-in and operations carry a few hundred bytes).
"""

from __future__ import annotations

import hmac
from typing import Any, Callable, Collection

#: Bytes any route other than the protected API may receive (dashboard sign-in, operations).
SMALL_BODY = 64 << 10


async def _answer(send: Any, status: int, detail: str, extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    body = b'{"detail":"' + detail.encode() + b'"}'
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *extra]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BodyGate:
    """See the module docstring.

    Args:
        app: the ASGI app behind it.
        token: the controller's operator token now (None or "" = tokenless: no 401 here).
        protected: paths whose requests need the token before their body is read.
        max_body: body limit of the protected paths, bytes.
        small_body: body limit of every other path, bytes.
    """

    def __init__(self, app: Any, token: Callable[[], str | None], protected: Collection[str], max_body: int,
                 small_body: int = SMALL_BODY) -> None:
        self.app = app
        self.token = token
        self.protected = frozenset(protected)
        self.max_body = max_body
        self.small_body = small_body

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        headers = scope.get("headers", ())
        guarded = path in self.protected
        token = self.token() if guarded else None
        if token:
            scheme, _, given = next((v for k, v in headers if k == b"authorization"), b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), token.encode()):
                await _answer(send, 401, "missing or wrong bearer token", ((b"www-authenticate", b"Bearer"),))
                return
        limit = self.max_body if guarded else self.small_body
        declared = next((v for k, v in headers if k == b"content-length"), None)
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                await _answer(send, 400, "Content-Length is not a number")
                return
            if n > limit:
                await _answer(send, 413, f"request body over {limit} bytes")
                return
        seen = 0
        started = answered = False

        async def counted_receive() -> Any:
            nonlocal seen, answered
            if answered:
                return {"type": "http.disconnect"}
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # answer now; the app sees the client gone (its own answer is dropped)
                    if not started:
                        await _answer(send, 413, f"request body over {limit} bytes")
                    answered = True
                    return {"type": "http.disconnect"}
            return message

        async def tracked_send(message: Any) -> None:
            nonlocal started
            if answered:
                return
            if message.get("type") == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, counted_receive, tracked_send)
