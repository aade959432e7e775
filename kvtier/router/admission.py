"""What one request may cost the router before it is forwarded: body bytes, parse and tokenize work.

A client chooses how big its body is and how long its prompt; the router's event loop must
stay free for everyone else, and a few huge prompts must not make ordinary ones wait.

* The body is read with a bound (:attr:`Admission.max_body_bytes`): a ``Content-Length``
  beyond it, or a chunked upload that grows beyond it, is answered 413 before more is read.
  Bodies still arriving may hold at most :attr:`Admission.max_reading_bytes` together (bodies
  over ``small_bytes`` count; beyond it: 503 with ``Retry-After``), and a body must arrive
  within :attr:`Admission.body_timeout_s` (else 408). Hostile trial, December 7: connections
  that declared 16 MB and stalled before the last bytes held ~15.6 MB each, without end
  (60 of them: router RSS 79 -> 1,022 MB; the PD proxy the same).
* Parsing the JSON (msgspec) and tokenizing run off the event loop, on the router's own
  threads, in two lanes: bodies up to :attr:`Admission.small_bytes` (an 8 KiB chat turn) on
  one pool, larger ones on another, so small prompts never queue behind large ones.
* Per client (its address), at most ``per_client`` jobs of a lane run at once; at most
  ``large_queue`` more large jobs wait (each holds a body of up to ``max_body_bytes``) and
  ``small_queue`` small ones (a burst of a benchmark's concurrent requests fits); beyond that
  the request is answered 429 (``Retry-After``).

The tokenization itself is bounded by the model's context (:mod:`.tokenize`): a prompt
longer than it costs about what the longest allowed prompt costs, then a 400.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

T = TypeVar("T")

#: Largest request body by default (bytes).
DEFAULT_MAX_BODY_BYTES = 16 << 20
#: Bodies up to this size (bytes) take the small lane (their parse and tokenization: ~10 ms at most).
SMALL_BYTES = 64 << 10
#: Bytes of large bodies still arriving, all clients together, by default (4 largest bodies).
DEFAULT_MAX_READING_BYTES = 4 * DEFAULT_MAX_BODY_BYTES
#: Seconds a request's body may take to arrive, by default.
DEFAULT_BODY_TIMEOUT_S = 30.0


class Refused(Exception):
    """The request is refused before any work: ``status`` (413, 429), ``message``, ``headers``."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


@dataclass
class _Client:
    sem: asyncio.Semaphore
    users: int = 0  # jobs running or waiting


class _Lane:
    """One thread pool and the per-client bounds of the jobs on it (event loop only: no await
    between a check and its update)."""

    def __init__(self, name: str, threads: int, per_client: int, per_client_queue: int) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"kvtier-router-{name}")
        self.per_client = per_client
        self.per_client_queue = per_client_queue
        self.clients: dict[str, _Client] = {}  # only clients with a job running or waiting
        self.refused = 0

    async def run(self, client: str, fn: Callable[[], T]) -> T:
        c = self.clients.get(client)
        if c is None:
            c = self.clients[client] = _Client(asyncio.Semaphore(self.per_client))
        if c.users >= self.per_client + self.per_client_queue:
            self.refused += 1
            raise Refused(429, f"too many requests in progress from {client}; retry shortly", {"Retry-After": "1"})
        c.users += 1
        try:
            await c.sem.acquire()
        except BaseException:
            self._leave(client, c, release=False)
            raise
        loop = asyncio.get_running_loop()
        job = self.pool.submit(fn)
        # the slot is free only when the job ended (a client that hangs up does not get a new slot
        # while its abandoned job still runs)
        def done(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nothing left to free
                loop.call_soon_threadsafe(self._leave, client, c, True)

        job.add_done_callback(done)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            job.cancel()  # never runs if it had not started
            raise

    def _leave(self, client: str, c: _Client, release: bool) -> None:
        if release:
            c.sem.release()
        c.users -= 1
        if c.users == 0 and self.clients.get(client) is c:
            del self.clients[client]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Admission:
    """Bounds on the work a request makes the router do (see the module docstring).

    Args:
        max_body_bytes: largest body (bytes, > 0).
        small_bytes: bodies up to this go to the small lane.
        per_client: jobs one client runs at once per lane (>= 1).
        small_queue / large_queue: jobs of one client waiting in the small / large lane before 429
            (>= 0).
        threads: threads of each lane (>= 1).
        max_reading_bytes: bytes of bodies over ``small_bytes`` still arriving, all clients
            together (default: 4 x the default ``max_body_bytes``, at least ``max_body_bytes``).
        body_timeout_s: seconds one body may take to arrive (> 0).

    Raises:
        ValueError: a bound that cannot work.
    """

    def __init__(self, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, small_bytes: int = SMALL_BYTES,
                 per_client: int = 2, small_queue: int = 1024, large_queue: int = 64, threads: int = 2,
                 max_reading_bytes: int | None = None, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        if (max_body_bytes < 1 or small_bytes < 0 or per_client < 1 or small_queue < 0 or large_queue < 0
                or threads < 1 or not body_timeout_s > 0 or (max_reading_bytes is not None and max_reading_bytes < 1)):
            raise ValueError("admission bounds must be positive")
        self.max_reading_bytes = max(max_body_bytes, DEFAULT_MAX_READING_BYTES) if max_reading_bytes is None \
            else max_reading_bytes
        self.body_timeout_s = body_timeout_s
        self.reading_bytes = 0  # large bodies' bytes received so far, of bodies still arriving
        self.max_body_bytes = max_body_bytes
        self.small_bytes = small_bytes
        self._small = _Lane("small", threads, per_client, small_queue)
        self._large = _Lane("large", threads, per_client, large_queue)

    async def read_body(self, request: Request) -> bytes:
        """The request body, at most :attr:`max_body_bytes`.

        Raises:
            Refused: 413 when the body (declared or received) is larger.
        """
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        too_big = Refused(413, f"request body larger than the router's limit of {limit} bytes (--max-body-bytes)")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        parts: list[bytes] = []
        n = held = 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                async for chunk in request.stream():
                    n += len(chunk)
                    if n > limit:
                        raise too_big
                    if n > self.small_bytes:  # event loop only: no await between check and update
                        grow = n - held
                        if self.reading_bytes + grow > self.max_reading_bytes:
                            raise Refused(503, "too many large request bodies arriving at once; retry",
                                          {"Retry-After": "1"})
                        self.reading_bytes += grow
                        held += grow
                    parts.append(chunk)
        except TimeoutError:
            raise Refused(408, f"request body not received within {self.body_timeout_s:g} s") from None
        finally:
            self.reading_bytes -= held
        return b"".join(parts)

    async def run(self, request: Request, nbytes: int, fn: Callable[[], T]) -> T:
        """``fn()`` on the lane for a body of ``nbytes``, within the client's bounds.

        Raises:
            Refused: 429 when the client already has its jobs running and queued.
        """
        client = request.client.host if request.client else "?"
        lane = self._small if nbytes <= self.small_bytes else self._large
        return await lane.run(client, fn)

    def stats(self) -> dict[str, Any]:
        return {"max_body_bytes": self.max_body_bytes, "reading_bytes": self.reading_bytes, "refused_429": self._small.refused + self._large.refused,
                "clients_working": len(self._small.clients) + len(self._large.clients)}

    def close(self) -> None:
        self._small.close()
        self._large.close()
