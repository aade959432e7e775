"""``kvtier top``: the dashboard as a live terminal table (rich), for hosts without a browser.

Reads ``GET <url>/dashboard/snapshot`` of a ``kvtier server`` (its metrics port) or a
``kvtier controller`` (its HTTP port) every ``interval_s`` seconds and redraws: tiers
(used/capacity, chunks, stores, evictions, errors, queue), hit rate and throughput,
hot prefixes, and (controller) instances. An unreachable endpoint is shown as such and
retried; Ctrl-C ends the view (exit code 0).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

#: Default endpoint: ``kvtier server``'s metrics port.
DEFAULT_URL = "http://127.0.0.1:9477"


class TopError(RuntimeError):
    """The endpoint could not be read (unreachable, not a kvtier dashboard, bad JSON)."""


def fetch(url: str, token: str | None = None, timeout_s: float = 5.0) -> dict[str, Any]:
    """The snapshot at ``url`` (a base URL; ``/dashboard/snapshot`` is appended). The URLs a
    server prints are accepted too: one ending in ``/metrics``, ``/dashboard`` or ``/``.

    Raises:
        TopError: unreachable, an HTTP error, or a body that is not a dashboard snapshot.
    """
    base = url.rstrip("/")
    for suffix in ("/metrics", "/dashboard/snapshot", "/dashboard"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    req = urllib.request.Request(base + "/dashboard/snapshot",
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            snap = json.loads(r.read())
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise TopError(f"{url}: {exc}") from None
    if not isinstance(snap, dict) or "metrics" not in snap or "tiers" not in snap:
        raise TopError(f"{url}: not a kvtier dashboard snapshot")
    return snap


def _bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return "-"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _rate(gbps: float | None) -> str:
    return "-" if gbps is None else f"{gbps * 1e3:.3f} MB/s"


def render(snap: dict[str, Any], url: str) -> Group:
    """The tables of one snapshot."""
    m, r = snap["metrics"], snap.get("rates") or {}
    ctl = snap.get("kind") == "controller"
    head = Text.assemble(("kvtier top ", "bold"), f"{snap.get('kind', '?')} {url}  ",
                         ("hit rate ", "dim"), _pct(snap.get("hit_rate")),
                         ("  last interval ", "dim"), _pct(r.get("hit_rate")),
                         ("  lookups/s ", "dim"), "-" if r.get("lookups") is None else f"{r['lookups']:.1f}",
                         ("  load ", "dim"), _rate(r.get("load_bytes")), ("  store ", "dim"), _rate(r.get("store_bytes")))
    tiers = Table(title="tiers", title_justify="left", expand=True)
    cols = ["tier"] + (["instance"] if ctl else []) + ["used", "capacity", "chunks"] + \
        ([] if ctl else ["stores", "evictions", "read err", "write err", "queue", "hit rate"])
    for c in cols:
        tiers.add_column(c, justify="left" if c in ("tier", "instance") else "right", no_wrap=True)
    asked = m.get("kvtier_lookup_tokens_total") or 0
    for row in snap["tiers"]:
        def v(f: str, row: dict[str, Any] = row) -> float | None:
            return m.get(row["series"][f]) if f in row["series"] else (row.get("values") or {}).get(f)

        cells = [row["tier"]] + ([row.get("instance", "")] if ctl else [])
        cells += [_bytes(v("used_bytes")), _bytes(v("capacity_bytes")), _num(v("chunks"))]
        if not ctl:
            hit = v("hit_tokens")
            cells += [_num(v("stores")), _num(v("evictions")), _num(v("read_errors")), _num(v("write_errors")),
                      _num(v("queue")), _pct(hit / asked if hit is not None and asked else None)]
        tiers.add_row(*cells)
    parts: list[Any] = [head, tiers]
    hot = Table(title="hot prefixes", title_justify="left", expand=True)
    for c in ("prefix", "reuses", "hit tokens", "tiers", "pinned"):
        hot.add_column(c, justify="left" if c in ("prefix", "tiers") else "right", overflow="ellipsis", no_wrap=True)
    for h in snap.get("hot", [])[:8]:
        label = h["text"] if h.get("text") else h["key"] + "…"
        pinned = "-" if h["pinned_tokens"] < 0 else ("yes" if h["pinned_tokens"] else "no")
        hot.add_row(label.replace("\n", " ")[:60], _num(h["count"]), _num(h["hit_tokens"]),
                    ", ".join(f"{k} {n}" for k, n in h["tiers"].items()), pinned)
    if not snap.get("hot"):
        hot.add_row("none yet (no prefix reused since start)", "", "", "", "")
    parts.append(hot)
    if snap.get("instances"):
        inst = Table(title="instances", title_justify="left", expand=True)
        for c in ("instance", "role", "health", "last heartbeat", "hit rate"):
            inst.add_column(c, justify="right" if c in ("last heartbeat", "hit rate") else "left", no_wrap=True)
        for i in snap["instances"]:
            bad = [k for k, t in (i.get("health") or {}).items() if isinstance(t, dict) and t.get("ok") is False]
            inst.add_row(i["instance"], i["role"], "failing: " + ", ".join(bad) if bad else "ok",
                         f"{i['last_seen_age_s']:.1f} s ago", _pct(i.get("hit_rate")))
        parts.append(inst)
    return Group(*parts)


#: Width of batch-mode output (a pipe has no width of its own).
BATCH_WIDTH = 160


def _default_console() -> Console:
    probe = Console()
    if probe.is_terminal or os.environ.get("COLUMNS"):
        return probe
    return Console(width=BATCH_WIDTH)


def _frames(url: str, interval_s: float, count: int | None, token: str | None,
            show: Callable[[Any], None]) -> int:
    """Fetch and ``show`` one frame per interval, ``count`` times (None: until Ctrl-C); the exit
    code of :func:`run_top`."""
    answered, n = False, 0
    try:
        while count is None or n < count:
            try:
                show(render(fetch(url, token), url))
                answered = True
            except TopError as exc:
                last = count is not None and n + 1 >= count
                show(Text(f"kvtier top: {exc}" + ("" if last else f" (retrying every {interval_s:g} s)"), style="red"))
            n += 1
            if count is None or n < count:
                time.sleep(interval_s)
    except KeyboardInterrupt:
        return 0
    return 0 if answered or count is None else 2


def run_top(url: str = DEFAULT_URL, interval_s: float = 1.0, count: int | None = None, token: str | None = None,
            console: Console | None = None) -> int:
    """Redraw every ``interval_s`` seconds, ``count`` times (None: until Ctrl-C); returns 0, or 2 when
    ``count`` is given and the endpoint never answered.

    On a terminal the frame is redrawn in place; otherwise (a pipe, a file: batch mode, as
    ``top -b``) every frame is printed one after the other, ``BATCH_WIDTH`` columns wide
    unless ``COLUMNS`` says otherwise, so no column is cut to a pipe's default 80.

    Raises:
        ValueError: ``interval_s`` <= 0 or ``count`` < 1.
    """
    from rich.live import Live

    if not interval_s > 0 or (count is not None and count < 1):
        raise ValueError(f"interval must be > 0 and count >= 1, got {interval_s}, {count}")
    console = console or _default_console()
    if not console.is_terminal:  # batch mode: every frame printed
        return _frames(url, interval_s, count, token, console.print)
    try:
        with Live(Text("connecting…"), console=console, refresh_per_second=4, screen=False) as live:
            return _frames(url, interval_s, count, token, live.update)
    except KeyboardInterrupt:
        return 0
