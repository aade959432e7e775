"""The dashboard's data: one snapshot per tick, read from the registry ``/metrics`` renders.

:class:`DashboardSource` samples its registry every ``step_s`` seconds on a daemon
thread into a :class:`~kvtier.dashboard.history.CounterHistory` (so the last hour
exists even while nobody watches) and answers :meth:`~DashboardSource.snapshot`:
a JSON-ready dict whose every displayed number names the series it came from
(``metrics`` holds those series' values from one ``collect()`` pass). Subclasses
say which series are tiers, which counters feed the charts, and add instances.
Cost of a snapshot: one registry collect plus O(top-k) hot prefixes; never a
scan of the cached chunks beyond what ``/metrics`` itself does.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvtier.dashboard.history import CounterHistory, rate_series
from kvtier.dashboard.hot import HotChain, HotPrefixes
from kvtier.dashboard.samples import collect_samples

log = logging.getLogger(__name__)

#: Environment variable naming a Hugging Face tokenizer (folder or id) used to show hot prefixes as text.
TOKENIZER_ENV = "KVTIER_DASHBOARD_TOKENIZER"
#: Hot prefixes shown.
HOT_ROWS = 20
#: Token ids decoded at each end of a hot prefix.
TEXT_TOKENS = 24

Decode = Callable[[list[int]], str]


def tokenizer_from_env() -> Decode | None:
    """A decoder from ``$KVTIER_DASHBOARD_TOKENIZER`` (transformers), or None when unset or unloadable."""
    name = os.environ.get(TOKENIZER_ENV)
    if not name:
        return None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(name)
    except Exception:
        log.warning("kvtier dashboard: cannot load tokenizer %r; hot prefixes shown as keys", name)
        return None
    return lambda ids: str(tok.decode(ids, skip_special_tokens=False))


class DashboardSource:
    """Base of the server and controller dashboards.

    Args:
        kind: ``"server"`` or ``"controller"`` (shown on the page).
        registry: the ``prometheus_client`` registry ``/metrics`` renders.
        hot: the hot-prefix counter fed by lookups.
        step_s: sampling period (seconds, > 0); also the SSE period.
        decode: token ids -> text for hot prefixes (None: key prefixes only).
        sample: False to start without the sampler thread (tests call :meth:`tick`).
        alive: False once the service behind the dashboard stopped (the sampler then ends).
    """

    kind = "server"

    def __init__(self, registry: Any, hot: HotPrefixes, step_s: float = 1.0, decode: Decode | None = None,
                 sample: bool = True, alive: Callable[[], bool] | None = None):
        if not step_s > 0:
            raise ValueError(f"step_s must be > 0, got {step_s}")
        self.registry = registry
        self.hot = hot
        self.step_s = step_s
        self.decode = decode
        self.history = CounterHistory()
        self.stopped = threading.Event()
        self._alive = alive
        self._thread: threading.Thread | None = None
        if sample:
            self._thread = threading.Thread(target=self._run, name=f"kvtier-dashboard-{self.kind}", daemon=True)
            self._thread.start()

    # -- subclass hooks --------------------------------------------------------------------
    def tiers(self, m: dict[str, float]) -> list[dict[str, Any]]:
        """Tier rows: ``{"tier", "instance"?, "series": {field: series name}}``."""
        raise NotImplementedError

    def counters(self, m: dict[str, float]) -> dict[str, float]:
        """Cumulative counters for the charts: ``lookups``, ``lookup_tokens``, ``hit:<tier>``,
        ``load_bytes``, ``store_bytes`` (absent: not known here)."""
        raise NotImplementedError

    def extra(self, m: dict[str, float]) -> dict[str, Any]:
        """More top-level snapshot fields (instances, operations)."""
        return {}

    # -- sampling ----------------------------------------------------------------------------
    def samples(self) -> dict[str, float]:
        """One ``collect()`` pass of the registry (the ``kvtier_*`` series)."""
        return collect_samples(self.registry)

    def counter_samples(self) -> dict[str, float]:
        """The samples :meth:`counters` needs (default: :meth:`samples`); the sampler thread reads
        these every ``step_s``, so a subclass narrows them to cheap series."""
        return self.samples()

    def tick(self, now: float | None = None) -> dict[str, float]:
        """Sample the counters into the history; returns the samples."""
        m = self.counter_samples()
        self.history.add(time.time() if now is None else now, _with_total(self.counters(m)))
        return m

    def _run(self) -> None:
        while not self.stopped.is_set() and (self._alive is None or self._alive()):
            try:
                self.tick()
            except Exception:  # a failing collector must not end the history
                log.debug("kvtier dashboard: sample failed", exc_info=True)
            self.stopped.wait(self.step_s)

    def close(self) -> None:
        """Stop sampling and end every event stream (idempotent)."""
        self.stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)

    # -- the snapshot ------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The page's data (JSON-ready); see the module docstring."""
        m = self.samples()
        counters = self.counters(m)
        tiers = self.tiers(m)
        hit_tiers = sorted(k[4:] for k in counters if k.startswith("hit:"))
        ratios = {f"hit_rate:{t}": (f"hit:{t}", "lookup_tokens") for t in hit_tiers}
        ratios["hit_rate"] = ("hit:*", "lookup_tokens")
        history = {}
        for ring in ("short", "long"):
            pts = self.history.samples(ring)
            last = self.history.latest()
            if ring == "long" and last is not None and pts and last[0] > pts[-1][0]:
                pts.append(last)  # the minute in progress
            history[ring] = rate_series(pts, ("lookups", "load_bytes", "store_bytes"), ratios,
                                        {"load_bytes": 1e-9, "store_bytes": 1e-9})
        asked = counters.get("lookup_tokens", 0.0)
        found = sum(v for k, v in counters.items() if k.startswith("hit:"))
        out: dict[str, Any] = {
            "kind": self.kind,
            "time": time.time(),
            "step_s": self.step_s,
            "metrics": m,
            "tiers": tiers,
            "hit_tiers": hit_tiers,
            "hit_rate": found / asked if asked > 0 else None,
            "rates": _last_rates(history["short"]),
            "history": history,
            "hot": [self._hot_row(c) for c in self.hot.top(HOT_ROWS)],
            "hot_observed": self.hot.observed,
        }
        out.update(self.extra(m))
        return out

    def _hot_row(self, c: HotChain) -> dict[str, Any]:
        text = None
        if self.decode is not None and c.tokens:
            import numpy as np

            ids = np.frombuffer(c.tokens, dtype="<u4").tolist()
            try:
                if len(ids) <= 2 * TEXT_TOKENS:
                    text = self.decode(ids)
                else:  # the start and the end of the chain: chat prompts share their start
                    text = self.decode(ids[:TEXT_TOKENS]) + " … " + self.decode(ids[-TEXT_TOKENS:])
            except Exception:
                text = None
        return {"head": c.head.hex(), "key": c.head.hex()[:16], "text": text, "count": c.count, "error": c.error,
                "hit_tokens": c.hit_tokens, "bytes": c.nbytes, "tiers": c.tiers, "pinned_tokens": c.pinned_tokens,
                "last_s": c.last_s, "instance": c.instance, "has_tokens": bool(c.tokens)}

    def events(self, max_s: float = 300.0, ended: threading.Event | None = None) -> Iterator[bytes]:
        """Server-sent events: one ``snapshot`` event now and then every ``step_s`` seconds, for at
        most ``max_s`` seconds (the browser reconnects), until :meth:`close`, or until ``ended``
        is set (the stream's slot was given to a newer one)."""
        end = time.monotonic() + max_s
        yield f"retry: {int(self.step_s * 1000)}\n\n".encode()
        while not self.stopped.is_set() and time.monotonic() < end and not (ended and ended.is_set()):
            yield sse_event(self.snapshot())
            wake = time.monotonic() + self.step_s
            while not self.stopped.is_set() and not (ended and ended.is_set()) and time.monotonic() < wake:
                self.stopped.wait(min(0.1, max(0.0, wake - time.monotonic())))


def sse_event(data: dict[str, Any], event: str = "snapshot") -> bytes:
    """One SSE frame carrying ``data`` as JSON (https://html.spec.whatwg.org/multipage/server-sent-events.html)."""
    import json

    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _with_total(counters: dict[str, float]) -> dict[str, float]:
    counters["hit:*"] = sum(v for k, v in counters.items() if k.startswith("hit:"))
    return counters


def _last_rates(series: dict[str, list[float | None]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, values in series.items():
        if name != "t":
            out[name] = values[-1] if values else None
    return out
