"""Per-backend load, in prompt tokens, meaningful between paced requests too.

``load_tokens(b) = in-flight prompt tokens the router sent to b
                 + (running + waiting requests in b's /metrics that the router did not send)
                   x mean prompt tokens
                 + KV usage (0..1) x ``kv_usage_tokens``
                 + decayed count of recent assignments x ``recent_tokens````

The last term keeps the load of two idle backends apart: with nothing in flight, the one
assigned more recently carries more, so paced no-reuse requests alternate instead of all
landing on one worker. ``/metrics`` is polled every ``metrics_interval_s``; the router's own
requests that may appear in a sample (in flight when the poll started, or started during
it) are subtracted, so they are not counted twice.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from kvtier.router.config import Weights

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_START = "process_start_time_seconds"


@dataclass(frozen=True)
class VllmMetrics:
    """What the router reads from a vLLM ``/metrics`` page (summed over label sets).

    Attributes:
        running, waiting: requests (``None``: gauge absent).
        kv_usage: engine KV cache usage in [0, 1] (``None``: absent).
        start_time: process start time (seconds since the epoch; ``None``: absent).
    """

    running: float | None
    waiting: float | None
    kv_usage: float | None
    start_time: float | None


def parse_vllm_metrics(text: str) -> VllmMetrics:
    """Read the gauges the router uses from Prometheus text exposition; other lines and
    malformed values are ignored (never raises)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = len(line)
        for sep in ("{", " "):
            i = line.find(sep)
            if 0 <= i < name_end:
                name_end = i
        name = line[:name_end]
        if name not in (_RUNNING, _WAITING, _START) and name not in _KV_USAGE:
            continue
        rest = line[name_end:]
        if rest.startswith("{"):
            close = rest.rfind("}")
            rest = rest[close + 1:] if close >= 0 else ""
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        if name == _START:
            sums[name] = value  # one process
        else:
            sums[name] = sums.get(name, 0.0) + value
    kv = next((sums[n] for n in _KV_USAGE if n in sums), None)
    return VllmMetrics(running=sums.get(_RUNNING), waiting=sums.get(_WAITING),
                       kv_usage=None if kv is None else min(1.0, max(0.0, kv)),
                       start_time=sums.get(_START))


@dataclass
class _Load:
    inflight_tokens: int = 0
    inflight_requests: int = 0
    started: int = 0
    recent: float = 0.0
    recent_at: float = 0.0
    last_assigned: int = -1
    external_requests: float = 0.0
    kv_usage: float = 0.0
    start_time: float | None = None
    metrics_at: float | None = None
    metrics_error: str | None = None


class LoadTracker:
    """Load of each backend (mutated on the event loop only).

    Args:
        names: backend names.
        weights: :class:`kvtier.router.config.Weights` (load terms).
        on_restart: called with a backend's name when its ``process_start_time_seconds``
            changes (a restart the health probes may have missed).
        clock: monotonic seconds (tests inject one).
    """

    def __init__(self, names: Sequence[str], weights: Weights,
                 on_restart: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._w = weights
        self._clock = clock
        self._on_restart = on_restart
        self._loads = {n: _Load() for n in names}
        self._assignments = 0
        self.mean_prompt_tokens = weights.external_request_tokens

    def _decayed(self, ld: _Load, now: float) -> float:
        if ld.recent == 0.0:
            return 0.0
        return ld.recent * 0.5 ** ((now - ld.recent_at) / self._w.recent_half_life_s)

    def begin(self, name: str, prompt_tokens: int) -> None:
        """A request of ``prompt_tokens`` was sent to ``name``."""
        ld = self._loads[name]
        now = self._clock()
        ld.recent = self._decayed(ld, now) + 1.0
        ld.recent_at = now
        ld.inflight_tokens += prompt_tokens
        ld.inflight_requests += 1
        ld.started += 1
        ld.last_assigned = self._assignments
        self._assignments += 1
        if prompt_tokens > 0:
            self.mean_prompt_tokens = 0.9 * self.mean_prompt_tokens + 0.1 * prompt_tokens

    def end(self, name: str, prompt_tokens: int) -> None:
        """That request finished (or failed)."""
        ld = self._loads[name]
        ld.inflight_tokens = max(0, ld.inflight_tokens - prompt_tokens)
        ld.inflight_requests = max(0, ld.inflight_requests - 1)

    def last_assigned(self, name: str) -> int:
        """Assignment number of ``name``'s last request (-1: never): the tie-break."""
        return self._loads[name].last_assigned

    def inflight(self, name: str) -> int:
        return self._loads[name].inflight_requests

    def load_tokens(self, name: str) -> float:
        """The load term of ``name`` in tokens (see the module docstring)."""
        return self.breakdown(name)["load_tokens"]

    def breakdown(self, name: str) -> dict[str, float]:
        """The terms of the load of ``name``."""
        ld = self._loads[name]
        w = self._w
        recent = self._decayed(ld, self._clock())
        external = ld.external_requests * self.mean_prompt_tokens
        total = ld.inflight_tokens + external + ld.kv_usage * w.kv_usage_tokens + recent * w.recent_tokens
        return {"load_tokens": total, "inflight_tokens": float(ld.inflight_tokens),
                "inflight_requests": float(ld.inflight_requests), "external_requests": ld.external_requests,
                "kv_usage": ld.kv_usage, "recent": recent}

    def reset(self, name: str) -> None:
        """Forget the metrics of ``name`` (it left the pool); in-flight counts stay."""
        ld = self._loads[name]
        ld.external_requests = 0.0
        ld.kv_usage = 0.0

    def note_metrics(self, name: str, m: VllmMetrics, router_max_inflight: int) -> None:
        """Record a metrics sample; ``router_max_inflight`` is the most of the router's own
        requests that can appear in it."""
        ld = self._loads[name]
        restarted = m.start_time is not None and ld.start_time is not None and m.start_time != ld.start_time
        if restarted and self._on_restart is not None:
            self._on_restart(name)
        if m.start_time is not None:
            ld.start_time = m.start_time
        seen = (m.running or 0.0) + (m.waiting or 0.0)
        ld.external_requests = max(0.0, seen - router_max_inflight)
        ld.kv_usage = m.kv_usage or 0.0
        ld.metrics_at = self._clock()
        ld.metrics_error = None

    async def poll(self, client: httpx.AsyncClient, name: str, url: str, timeout_s: float) -> None:
        """One ``GET {url}/metrics`` of backend ``name``; a failure resets its metrics terms."""
        ld = self._loads[name]
        before_inflight, before_started = ld.inflight_requests, ld.started
        try:
            r = await client.get(url + "/metrics", timeout=timeout_s)
            r.raise_for_status()
        except httpx.HTTPError as exc:
            ld.metrics_error = f"{type(exc).__name__}: {exc}"
            self.reset(name)
            return
        self.note_metrics(name, parse_vllm_metrics(r.text),
                          before_inflight + (ld.started - before_started))

    async def run(self, client: httpx.AsyncClient, backends: Sequence[tuple[str, str]],
                  interval_s: float, timeout_s: float) -> None:
        """Poll ``(name, url)`` backends every ``interval_s`` seconds until cancelled."""

        async def loop(name: str, url: str) -> None:
            while True:
                t0 = time.monotonic()
                await self.poll(client, name, url, timeout_s)
                await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - t0)))

        await asyncio.gather(*(loop(n, u) for n, u in backends))

    def state(self) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {}
        for n, ld in self._loads.items():
            out[n] = {**self.breakdown(n), "last_assigned": ld.last_assigned, "metrics_error": ld.metrics_error}
        return out
