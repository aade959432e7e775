"""Backend health: periodic ``GET /health`` probes plus passive failures from real requests.

A backend leaves the pool when a probe or a request cannot connect to it (at once), or after
``down_after_timeouts`` consecutive probe timeouts / error answers; it returns on the first
successful probe. Every transition to down fires the ``on_down`` callbacks (the router drops
that backend's prefix index: a backend that comes back is a new process with an empty cache)
and sets the backend's :attr:`BackendState.down_event`, which wakes requests still waiting on
it so they can retry elsewhere instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from kvtier.router.config import BackendSpec
from kvtier.urls import mask_url

log = logging.getLogger("kvtier.router")


@dataclass
class BackendState:
    """One backend's health (mutated on the event loop only).

    Attributes:
        spec: the backend.
        index: its position in the configured order (the final tie-break).
        healthy: in the pool now.
        failures: consecutive failed probes/requests.
        downs: times it left the pool.
        last_error: the last failure, for ``/router/state``.
        since: monotonic time of the last transition.
        down_event: set while the backend is down (replaced when it comes back).
    """

    spec: BackendSpec
    index: int
    healthy: bool = True
    failures: int = 0
    downs: int = 0
    last_error: str | None = None
    since: float = field(default_factory=time.monotonic)
    down_event: asyncio.Event | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def event(self) -> asyncio.Event:
        """The down event (created lazily on the running loop)."""
        if self.down_event is None:
            self.down_event = asyncio.Event()
            if not self.healthy:
                self.down_event.set()
        return self.down_event

    def state(self) -> dict[str, object]:
        return {"url": mask_url(self.spec.url), "instance_id": self.spec.instance_id, "events": self.spec.events,
                "healthy": self.healthy, "failures": self.failures, "downs": self.downs,
                "last_error": self.last_error, "for_s": round(time.monotonic() - self.since, 3)}


class BackendPool:
    """The backends and their health.

    Args:
        specs: the backends, in configured order.
        down_after_timeouts: consecutive timeouts/error answers before a backend leaves.
        on_down: callbacks ``f(name)`` run when a backend leaves the pool.
        on_up: callbacks ``f(name)`` run when it comes back.
    """

    def __init__(self, specs: Sequence[BackendSpec], down_after_timeouts: int = 2,
                 on_down: Sequence[Callable[[str], None]] = (),
                 on_up: Sequence[Callable[[str], None]] = ()) -> None:
        self.backends = [BackendState(spec=s, index=i) for i, s in enumerate(specs)]
        self.by_name = {b.name: b for b in self.backends}
        self._down_after = down_after_timeouts
        self._on_down = list(on_down)
        self._on_up = list(on_up)

    def healthy(self) -> list[BackendState]:
        """The backends in the pool now (configured order)."""
        return [b for b in self.backends if b.healthy]

    def failure(self, backend: BackendState, error: str, definitive: bool) -> None:
        """Record a failure; ``definitive`` (connection refused/reset before any byte) takes
        the backend out at once, otherwise after ``down_after_timeouts`` in a row."""
        backend.failures += 1
        backend.last_error = error
        if backend.healthy and (definitive or backend.failures >= self._down_after):
            backend.healthy = False
            backend.downs += 1
            backend.since = time.monotonic()
            backend.event().set()
            log.warning("kvtier router: backend %s left the pool: %s", backend.name, error)
            for cb in self._on_down:
                cb(backend.name)

    def success(self, backend: BackendState) -> None:
        """Record a successful probe; a down backend comes back."""
        backend.failures = 0
        if not backend.healthy:
            backend.healthy = True
            backend.since = time.monotonic()
            backend.down_event = asyncio.Event()
            log.warning("kvtier router: backend %s is back", backend.name)
            for cb in self._on_up:
                cb(backend.name)

    async def probe(self, client: httpx.AsyncClient, backend: BackendState, timeout_s: float) -> bool:
        """One ``GET /health``; records the outcome. Returns True if healthy."""
        try:
            r = await client.get(backend.spec.url + "/health", timeout=timeout_s)
        except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
            cause = f" ({exc.__cause__!r})" if exc.__cause__ is not None else ""
            self.failure(backend, f"health: {type(exc).__name__}: {exc}{cause}", definitive=True)
            return False
        except httpx.HTTPError as exc:
            self.failure(backend, f"health: {type(exc).__name__}: {exc}", definitive=False)
            return False
        if r.status_code != 200:
            self.failure(backend, f"health: HTTP {r.status_code}", definitive=False)
            return False
        self.success(backend)
        return True

    async def run(self, client: httpx.AsyncClient, interval_s: float, timeout_s: float) -> None:
        """Probe every backend every ``interval_s`` seconds (one loop each, so a hung backend
        does not delay the others), until cancelled."""

        async def loop(b: BackendState) -> None:
            while True:
                t0 = time.monotonic()
                await self.probe(client, b, timeout_s)
                await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - t0)))

        await asyncio.gather(*(loop(b) for b in self.backends))

    def state(self) -> dict[str, dict[str, object]]:
        return {b.name: b.state() for b in self.backends}
