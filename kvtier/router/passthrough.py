"""Passing a backend's answer through to the client as it arrives, cuts included.

The router and the PD proxy never hold an answer whole: each chunk the backend sends goes on
to the client (memory per request: one chunk, whatever the answer's size). When the backend
cuts the answer mid-way (a reset, a read timeout, the backend leaving the pool), the client
must not see a clean finish:

* a server-sent-event stream (``text/event-stream``, OpenAI streaming) gets one last
  ``data: {"error": {...}}`` event, OpenAI's error shape, which OpenAI clients raise as an
  error, and never ``data: [DONE]``;
* then the response is left incomplete: the final (empty) body message is not sent, so the
  server closes the connection without the terminating chunk (chunked encoding) or short
  of ``Content-Length``, which an HTTP client reports as an incomplete body.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping

from starlette.responses import StreamingResponse
from starlette.types import Send


class StreamCut(Exception):
    """Raised by a pass-through body iterator when the backend cut the answer (message: why)."""


def sse_error(message: str, code: int = 502) -> bytes:
    """One SSE event carrying an OpenAI-style error object."""
    body = {"error": {"message": message, "type": "BackendStreamCut", "code": code}}
    return f"data: {json.dumps(body)}\n\n".encode()


class PassThrough(StreamingResponse):
    """A streaming response whose body iterator may raise :class:`StreamCut`.

    Args:
        chunks: the backend's raw body chunks; raises :class:`StreamCut` when the backend cut it.
        status_code, headers, media_type: as :class:`starlette.responses.StreamingResponse`
            (a ``content-length`` header in ``headers`` is kept: a cut then falls short of it).

    Attributes:
        cut: the reason, once the backend cut the answer (``None``: complete so far).
    """

    def __init__(self, chunks: AsyncIterator[bytes], status_code: int, headers: Mapping[str, str],
                 media_type: str | None) -> None:
        super().__init__(chunks, status_code=status_code, headers=headers, media_type=media_type)
        self.cut: str | None = None

    @property
    def is_sse(self) -> bool:
        return (self.media_type or "").split(";")[0].strip().lower() == "text/event-stream"

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        chunks = self.body_iterator
        try:
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except StreamCut as exc:
            self.cut = str(exc)
            if self.is_sse:
                await send({"type": "http.response.body", "body": sse_error(self.cut), "more_body": True})
            return  # incomplete on purpose: the server closes the connection mid-body
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
