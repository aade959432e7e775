"""kvtier's hit accounting on vLLM's ``/metrics``: connector stats and Prometheus series.

vLLM 0.32 asks the scheduler-side connector for :class:`KVConnectorStats` after
every step (``get_kv_connector_stats``), ships their ``data`` dict to the
front-end process, and hands it to the connector class's
``build_prom_metrics`` object and to its log line ("KV Transfer metrics: ...").
kvtier reports the deltas of its :class:`~kvtier.integrations.vllm.accounting.RequestLedger`
since the previous step, so the series are counters:

- ``kvtier:external_hit_tokens_total{tier}``: prompt tokens kvtier told vLLM it
  would load (planned loads, by tier). The counterpart of vLLM's own
  ``vllm:external_prefix_cache_hits_total`` (which counts the same tokens on the
  scheduler side) and of ``vllm:prompt_tokens_cached_by_source_total{source="host"|"disk"|...}``.
- ``kvtier:load_failed_tokens_total{tier}``: of those, tokens the worker
  reported unfilled (vLLM recomputed them). Tokens kvtier really served =
  hit minus failed (``RequestLedger.totals()``).
- ``kvtier:load_failures_total``: loads that reported failed blocks.

Each series carries vLLM's labels (``model_name``, ``engine``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

if TYPE_CHECKING:
    from prometheus_client import Counter

#: Prometheus names (prometheus_client appends ``_total`` to counters).
HIT_TOKENS = "kvtier:external_hit_tokens"
FAILED_TOKENS = "kvtier:load_failed_tokens"
LOAD_FAILURES = "kvtier:load_failures"


def ledger_counters(planned: dict[str, int], failed: dict[str, int], load_failures: int) -> dict[str, Any]:
    """The stats ``data`` layout: ``{"hit_tokens": {tier: n}, "failed_tokens": {tier: n}, "load_failures": n}``."""
    return {"hit_tokens": dict(planned), "failed_tokens": dict(failed), "load_failures": int(load_failures)}


def counter_delta(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """``now - before`` of two :func:`ledger_counters` dicts (monotonic counters: never negative)."""
    def sub(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
        return {t: n - b.get(t, 0) for t, n in a.items() if n - b.get(t, 0) > 0}

    return {
        "hit_tokens": sub(now["hit_tokens"], before["hit_tokens"]),
        "failed_tokens": sub(now["failed_tokens"], before["failed_tokens"]),
        "load_failures": max(0, now["load_failures"] - before["load_failures"]),
    }


@dataclass
class KVTierConnectorStats(KVConnectorStats):
    """Deltas of kvtier's hit accounting over one or more engine steps (``data``: see :func:`ledger_counters`)."""

    data: dict[str, Any] = field(default_factory=lambda: ledger_counters({}, {}, 0))

    def __post_init__(self) -> None:
        base = ledger_counters({}, {}, 0)
        base.update(self.data or {})
        self.data = base

    def reset(self) -> None:
        self.data = ledger_counters({}, {}, 0)

    def aggregate(self, other: KVConnectorStats) -> "KVTierConnectorStats":
        """Sum of both (``other``'s keys that are not kvtier's are ignored)."""
        o = other.data if other is not None else {}
        for key in ("hit_tokens", "failed_tokens"):
            for tier, n in (o.get(key) or {}).items():
                self.data[key][tier] = self.data[key].get(tier, 0) + int(n)
        self.data["load_failures"] += int(o.get("load_failures", 0) or 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        """Flat ``{"kvtier_hit_tokens_<tier>": n, "kvtier_load_failed_tokens_<tier>": n, "kvtier_load_failures": n}``."""
        out: dict[str, int | float] = {f"kvtier_hit_tokens_{t}": n for t, n in self.data["hit_tokens"].items()}
        out.update({f"kvtier_load_failed_tokens_{t}": n for t, n in self.data["failed_tokens"].items()})
        out["kvtier_load_failures"] = self.data["load_failures"]
        return out

    def is_empty(self) -> bool:
        d = self.data
        return not any(d["hit_tokens"].values()) and not any(d["failed_tokens"].values()) and not d["load_failures"]


class KVTierPromMetrics(KVConnectorPromMetrics):
    """Registers the ``kvtier:*`` counters (module docstring) and adds each stats delta to them."""

    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister(HIT_TOKENS, FAILED_TOKENS, LOAD_FAILURES)  # a second logger in one process
        # vLLM types each value of metric_types as any metric class; the one under Counter is a Counter.
        counter_cls = cast("type[Counter]", self._counter_cls)
        self._hits = counter_cls(
            name=HIT_TOKENS,
            documentation="Prompt tokens kvtier reported to vLLM as external prefix-cache hits (planned loads), by tier.",
            labelnames=labelnames + ["tier"],
        )
        self._failed = counter_cls(
            name=FAILED_TOKENS,
            documentation="Tokens of planned kvtier loads reported unfilled (recomputed by vLLM), by tier.",
            labelnames=labelnames + ["tier"],
        )
        failures = counter_cls(
            name=LOAD_FAILURES, documentation="kvtier loads that reported failed blocks.", labelnames=labelnames
        )
        self._failures = {i: failures.labels(*lv) for i, lv in per_engine_labelvalues.items()}
        for lv in per_engine_labelvalues.values():  # the cpu series exists from the start (reads as 0)
            self._hits.labels(*lv, "cpu")
            self._failed.labels(*lv, "cpu")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        lv = self.per_engine_labelvalues.get(engine_idx)
        if lv is None:
            return
        for tier, n in (transfer_stats_data.get("hit_tokens") or {}).items():
            if n > 0:
                self._hits.labels(*lv, str(tier)).inc(n)
        for tier, n in (transfer_stats_data.get("failed_tokens") or {}).items():
            if n > 0:
                self._failed.labels(*lv, str(tier)).inc(n)
        n = int(transfer_stats_data.get("load_failures", 0) or 0)
        if n > 0:
            self._failures[engine_idx].inc(n)


def _unregister(*names: str) -> None:
    """Remove earlier ``names`` collectors from the default registry (no-op if absent)."""
    from prometheus_client import REGISTRY

    for collector in list(getattr(REGISTRY, "_collector_to_names", {})):
        got = REGISTRY._collector_to_names.get(collector, ())
        if any(n == name or n.startswith(name + "_") for name in names for n in got):
            try:
                REGISTRY.unregister(collector)
            except KeyError:
                pass


__all__ = ["KVTierConnectorStats", "KVTierPromMetrics", "counter_delta", "ledger_counters"]
