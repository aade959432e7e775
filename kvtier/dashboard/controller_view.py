"""The dashboard of ``kvtier controller``: every instance's tiers, health and lookups, plus operations.

Lookups through the controller's ``POST /lookup`` feed :meth:`ControllerDashboard.observe_lookup`:
per-instance and fleet token hit counters (exported on the controller's ``/metrics`` by
:class:`LookupCollector`, so page and scrape agree) and the hot-prefix counter. A hot
prefix (the longest match of a lookup) is identified by a BLAKE2b digest of its cache salt,
length and first/last 16 token ids; its
token ids stay on the controller (the page names chains by digest, and operations on a
chain are resolved server-side), so a viewer without the token never sees prompt tokens.
Decoded text is shown only when the operator configured a tokenizer.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, Metric

from kvtier.dashboard.hot import HotChain, HotPrefixes
from kvtier.dashboard.samples import labelled
from kvtier.dashboard.source import DashboardSource, Decode

#: Token ids of a hit prefix kept per hot chain (for pin/move/compress from the page).
MAX_CHAIN_TOKENS = 8192
#: Headline counters: (label, series).
CONTROLLER_COUNTERS = (
    ("Instances", "kvtier_controller_instances"),
    ("Lookups seen", "kvtier_controller_lookups_observed_total"),
    ("Tokens asked", "kvtier_controller_lookup_asked_tokens_total"),
    ("Ops running", 'kvtier_controller_operations{state="running"}'),
    ("Ops done", 'kvtier_controller_operations{state="done"}'),
    ("Ops failed", 'kvtier_controller_operations{state="failed"}'),
    ("Changes applied", "kvtier_controller_changes_applied_total"),
    ("Expirations", "kvtier_controller_expirations_total"),
)


def chain_head(tokens: Any, hit_tokens: int, cache_salt: str | None) -> bytes:
    """16-byte id of the hit prefix ``tokens[:hit_tokens]``: BLAKE2b of the salt, its length, and its
    first and last 16 token ids (uint32 LE): O(1) per lookup, whatever the prompt length."""
    ends = np.asarray(list(tokens[:16]) + list(tokens[max(0, hit_tokens - 16):hit_tokens]), dtype="<u4").tobytes()
    salt = (cache_salt or "").encode()
    return hashlib.blake2b(len(salt).to_bytes(4, "little") + salt + hit_tokens.to_bytes(8, "little") + ends,
                           digest_size=16).digest()


class LookupCounters:
    """Token counters of the lookups the controller answered (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lookups = 0
        self.asked = 0
        self.found: dict[str, int] = {}
        self.inst_asked: dict[str, int] = {}
        self.inst_found: dict[str, int] = {}


class LookupCollector:
    """Exports :class:`LookupCounters` (``kvtier_controller_lookup_*``, ``..._instance_*``)."""

    def __init__(self, c: LookupCounters):
        self._c = c

    def collect(self) -> Iterator[Metric]:
        c = self._c
        with c.lock:
            yield CounterMetricFamily("kvtier_controller_lookups_observed", "Token lookups answered", value=c.lookups)
            yield CounterMetricFamily("kvtier_controller_lookup_asked_tokens", "Tokens token lookups asked about",
                                      value=c.asked)
            f = CounterMetricFamily("kvtier_controller_lookup_found_tokens",
                                    "Tokens of the best instance's match, by its fastest tier", labels=["tier"])
            for tier, n in sorted(c.found.items()):
                f.add_metric([tier], n)
            yield f
            a = CounterMetricFamily("kvtier_controller_instance_asked_tokens", "Tokens asked, per instance",
                                    labels=["instance"])
            h = CounterMetricFamily("kvtier_controller_instance_found_tokens", "Tokens matched, per instance",
                                    labels=["instance"])
            for inst in sorted(c.inst_asked):
                a.add_metric([inst], c.inst_asked[inst])
                h.add_metric([inst], c.inst_found.get(inst, 0))
            yield a
            yield h


class ControllerDashboard(DashboardSource):
    """Dashboard of a controller.

    Args:
        controller: the :class:`~kvtier.controller.server.Controller` (its ``ops`` and ``token``).
        registry: the registry its ``/metrics`` renders (a :class:`LookupCollector` is added to it).
        step_s / decode / sample / alive: as :class:`~kvtier.dashboard.source.DashboardSource`.
    """

    kind = "controller"

    def __init__(self, controller: Any, registry: Any, step_s: float = 1.0, decode: Decode | None = None,
                 sample: bool = True, alive: Callable[[], bool] | None = None):
        self.controller = controller
        self.lookup_counters = LookupCounters()
        self._local = threading.local()
        registry.register(LookupCollector(self.lookup_counters))
        super().__init__(registry, HotPrefixes(), step_s, decode, sample, alive)

    def observe_lookup(self, tokens: Sequence[int] | np.ndarray | None, cache_salt: str | None,
                       out: dict[str, Any]) -> None:
        """Count one answered lookup (``out``: the lookup reply); key-only lookups are not counted."""
        if tokens is None or len(tokens) == 0:
            return
        n = len(tokens)
        rows: dict[str, dict[str, int]] = out.get("instances", {})
        best_inst, best = None, 0
        c = self.lookup_counters
        with c.lock:
            c.lookups += 1
            c.asked += n
            for inst, row in rows.items():
                got = int(row.get("longest_matched", 0))
                c.inst_asked[inst] = c.inst_asked.get(inst, 0) + n
                c.inst_found[inst] = c.inst_found.get(inst, 0) + got
                if got > best:
                    best_inst, best = inst, got
            if best_inst is not None:
                loc = str(out.get("layout_info", {}).get(best_inst, ["CPU"])[0]).lower()
                c.found[loc] = c.found.get(loc, 0) + best
        if best_inst is None:
            return
        row = rows[best_inst]
        tiers = {k.lower(): int(v) for k, v in row.items() if k.isupper() and v}
        keep = min(best, MAX_CHAIN_TOKENS)
        self.hot.observe(chain_head(tokens, best, cache_salt), best, 0, tiers, int(row.get("pinned", -1)),
                         lambda: np.asarray(tokens[:keep], dtype="<u4").tobytes(), instance=best_inst,
                         salt=cache_salt)

    # -- views ---------------------------------------------------------------------------------
    def tiers(self, m: dict[str, float]) -> list[dict[str, Any]]:
        rows = []
        for inst in self._instances:
            for t in inst["tiers"]:
                lab = f'instance="{inst["instance"]}",tier="{t["kind"]}"'
                rows.append({"tier": t["kind"], "instance": inst["instance"], "shared": t["shared"],
                             "series": {"chunks": f"kvtier_controller_tier_chunks{{{lab}}}",
                                        "used_bytes": f"kvtier_controller_tier_bytes{{{lab}}}"},
                             "values": {"capacity_bytes": t["capacity_bytes"]}})
        return rows

    def counters(self, m: dict[str, float]) -> dict[str, float]:
        out = {"lookups": m.get("kvtier_controller_lookups_observed_total", 0.0),
               "lookup_tokens": m.get("kvtier_controller_lookup_asked_tokens_total", 0.0)}
        for tier, v in labelled(m, "kvtier_controller_lookup_found_tokens_total", "tier").items():
            out[f"hit:{tier}"] = v
        out.setdefault("hit:cpu", 0.0)
        return out

    @property
    def _instances(self) -> list[dict[str, Any]]:
        return getattr(self._local, "instances", [])

    def samples(self) -> dict[str, float]:
        # read before the collect (rows name its series); per thread: the sampler and a request may overlap
        self._local.instances = self.controller.ops.instances()
        return super().samples()

    def _hot_row(self, c: HotChain) -> dict[str, Any]:
        """The chain's row, its tiers and pin state read now from the index (one lookup of its
        kept tokens on its instance; the counts stay those of the lookups seen)."""
        row = super()._hot_row(c)
        if not c.tokens or c.instance is None:
            return row
        try:
            live = self.controller.ops.lookup(tokens=np.frombuffer(c.tokens, dtype="<u4"), cache_salt=c.salt,
                                              instance=c.instance)["instances"].get(c.instance)
        except Exception:  # the instance left: keep what the lookups saw
            return row
        if live is not None:
            row["tiers"] = {k.lower(): int(v) for k, v in live.items() if k.isupper() and v}
            row["pinned_tokens"] = int(live.get("pinned", 0))
            row["held_tokens"] = int(live.get("longest_matched", 0))
        for i in self._instances:
            if i["instance"] == c.instance and len(i["namespaces"]) == 1:
                ns = i["namespaces"][0]
                row["bytes"] = c.hit_tokens // max(1, ns["chunk_size"]) * ns["chunk_bytes"]
        return row

    def extra(self, m: dict[str, float]) -> dict[str, Any]:
        health = self.controller.ops.health().get("instances", {})
        asked = labelled(m, "kvtier_controller_instance_asked_tokens_total", "instance")
        found = labelled(m, "kvtier_controller_instance_found_tokens_total", "instance")
        insts = []
        for i in self._instances:
            name = i["instance"]
            tiers_health = health.get(name, {}).get("tiers", {})
            insts.append({
                "instance": name, "role": i["role"], "host": i["host"], "pid": i["pid"],
                "last_seen_age_s": i["last_seen_age_s"], "last_heartbeat": i["last_heartbeat"],
                "health": tiers_health,
                "hit_rate": (found.get(name, 0.0) / asked[name]) if asked.get(name) else None,
                "namespaces": [n["model"] for n in i["namespaces"]],
            })
        from kvtier.serde.registry import CODECS

        return {
            "counters": [[label, s] for label, s in CONTROLLER_COUNTERS],
            "instances": insts,
            "ops": {"token_required": bool(self.controller.token), "codecs": sorted(CODECS)},
        }
