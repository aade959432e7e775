"""One configuration's measured run (:class:`Phase`), its latency statistics, and the
comparison of its answers with vLLM's."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.bench.serve.client import RequestRecord
from kvtier.bench.serve.configs import hit_rate


@dataclass
class Phase:
    """One configuration's run of one workload."""

    config: str
    records: list[RequestRecord]
    wall_s: float
    metrics: list[dict[str, float]]
    engine_blocks: int | None
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.records if r.ok]
        total = {k: sum(m.get(k, 0.0) for m in self.metrics) for k in (self.metrics[0] if self.metrics else {})}
        return {
            "config": self.config,
            "requests": len(self.records),
            "errors": len(self.records) - len(ok),
            "error_samples": [f"{r.request_id}: {r.error}" for r in self.records if not r.ok][:5],
            "wall_s": self.wall_s,
            "request_throughput": len(ok) / self.wall_s if self.wall_s > 0 else 0.0,
            "output_token_throughput": sum(r.output_tokens for r in ok) / self.wall_s if self.wall_s > 0 else 0.0,
            "ttft_s": stats([r.ttft for r in ok]),
            "ttft_later_rounds_s": stats([r.ttft for r in ok if _round_of(r.request_id) > 0]),
            "tpot_s": stats([r.tpot for r in ok if r.output_tokens > 1]),
            "itl_s": stats([x for r in ok for x in r.itl]),
            "latency_s": stats([r.latency for r in ok]),
            "hit_rate": hit_rate(total) if total else None,
            "metrics_delta_per_instance": self.metrics,
            "requests_per_instance": [m.get("requests", 0.0) for m in self.metrics],
            "engine_blocks": self.engine_blocks,
            **self.extra,
            "records": [_record(r) for r in self.records],
        }


def _round_of(request_id: str) -> int:
    """Round of a multi-round QA id (``u3-r1`` -> 1); -1 for other ids (``nr-7``)."""
    _, sep, rnd = request_id.rpartition("-r")
    return int(rnd) if sep and rnd.isdigit() else -1


def _record(r: RequestRecord) -> dict[str, Any]:
    d = r.as_dict()
    d["itl"] = [round(x, 6) for x in d["itl"]]
    return d


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in 0-100) of a non-empty sequence."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats(xs: Sequence[float]) -> dict[str, float] | None:
    """mean, p50, p95, p99, min, max (seconds); None for no samples."""
    if not xs:
        return None
    return {
        "mean": statistics.fmean(xs), "p50": percentile(xs, 50), "p95": percentile(xs, 95),
        "p99": percentile(xs, 99), "min": min(xs), "max": max(xs), "n": float(len(xs)),
    }


def answer_mismatches(phases: dict[str, Phase], baseline: str = "vllm") -> list[dict[str, str]]:
    """Every (config, request id) whose answer differs from ``baseline``'s for the same id.

    Phases named ``X@fits`` compare with ``vllm@fits``. Failed requests count as mismatches
    (their answer is unknown).
    """
    out = []
    for name, ph in phases.items():
        base_name = baseline + ("@fits" if name.endswith("@fits") else "")
        if name == base_name or base_name not in phases or name.endswith("@noreuse"):
            continue
        ref = {r.request_id: r for r in phases[base_name].records}
        for r in ph.records:
            b = ref.get(r.request_id)
            if b is None:
                continue
            if not (r.ok and b.ok) or r.answer != b.answer:
                out.append({"config": name, "request_id": r.request_id, "vllm": b.answer, "got": r.answer,
                            "error": r.error or b.error})
    return out
