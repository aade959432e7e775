"""The figures, ratios and table of ``kvtier bench peers`` (from the children's raw seconds).

GB/s = 1e9 bytes/s. Per round each side's figure is ``bytes / median(seconds)``;
reported values are medians over rounds, spreads the min and max over rounds.
"""

from __future__ import annotations

import statistics
from typing import Any

from kvtier.bench.common import Check, print_checks

#: Every figure both sides can measure: (figure group, operation).
FIGURES = tuple(f"{g}_{op}" for g in ("cpu", "disk", "disk_direct", "redis") for op in ("put", "get"))
#: Baselines (in the baseline child's result) behind each figure group; per round the fastest counts.
BASELINE_OF = {"cpu": ("memcpy",), "disk": ("file", "file_steps"), "disk_direct": ("file_direct",),
               "redis": ("redis",)}
#: kvtier / LMCache targets: at least this on every figure, and more on disk figures.
VS_LMCACHE_TARGET = 1.0
VS_LMCACHE_DISK_TARGET = 1.1
#: kvtier / physical baseline of the same round.
VS_BASELINE_TARGET = 0.9


def _gbps(nbytes: int, seconds: list[float]) -> float | None:
    if not seconds:
        return None
    s = statistics.median(seconds)
    return nbytes / s / 1e9 if s > 0 else None


def _best(base: dict[str, Any] | None, group: str, op: str) -> float | None:
    """GB/s of the fastest baseline of ``group`` for ``op`` in one round (None: none measured)."""
    if not base:
        return None
    got = [_gbps(base["bytes"], base.get(f"{name}_{op}_s", [])) for name in BASELINE_OF[group]]
    vals = [v for v in got if v is not None]
    return max(vals) if vals else None


def _med(xs: list[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def _spread(xs: list[float]) -> list[float] | None:
    return [min(xs), max(xs)] if xs else None


def build_report(rounds: list[dict[str, Any]], groups: list[str], lmc_child: dict[str, tuple[str, str, bool]]) -> dict[str, Any]:
    """The JSON document: per figure ``<figure>_{kvtier,lmcache,baseline}_gbps``,
    ``<figure>_ratio_vs_lmcache`` (+ ``_spread``), ``<figure>_{kvtier,lmcache}_vs_baseline`` (+ ``_spread``),
    ``min_ratio_vs_lmcache``, ``min_kvtier_vs_baseline``, ``checks`` and ``all_targets_met``."""
    doc: dict[str, Any] = {}
    vs_lmc: list[float] = []
    vs_base: list[float] = []
    checks: list[Check] = []
    for g in groups:
        level = lmc_child[g][1]
        for op in ("put", "get"):
            fig = f"{g}_{op}"
            per: dict[str, list[float]] = {"kvtier": [], "lmcache": [], "baseline": [], "ratio": [],
                                           "kvtier_base": [], "lmcache_base": []}
            for rd in rounds:
                kv = rd["kvtier"].get(g)
                lm = rd["lmcache"].get(g)
                base = rd.get("baseline")
                k = _gbps(kv["bytes"], kv[f"{op}_s"]) if kv else None
                m = _gbps(lm["bytes"], lm[level][f"{op}_s"]) if lm else None
                b = _best(base, g, op)
                for name, v in (("kvtier", k), ("lmcache", m), ("baseline", b)):
                    if v is not None:
                        per[name].append(v)
                if k and m:
                    per["ratio"].append(k / m)
                if k and b:
                    per["kvtier_base"].append(k / b)
                if m and b:
                    per["lmcache_base"].append(m / b)
            doc[f"{fig}_kvtier_gbps"] = _med(per["kvtier"])
            doc[f"{fig}_lmcache_gbps"] = _med(per["lmcache"])
            doc[f"{fig}_baseline_gbps"] = _med(per["baseline"])
            doc[f"{fig}_kvtier_gbps_spread"] = _spread(per["kvtier"])
            doc[f"{fig}_lmcache_gbps_spread"] = _spread(per["lmcache"])
            doc[f"{fig}_ratio_vs_lmcache"] = r = _med(per["ratio"])
            doc[f"{fig}_ratio_vs_lmcache_spread"] = _spread(per["ratio"])
            doc[f"{fig}_kvtier_vs_baseline"] = kb = _med(per["kvtier_base"])
            doc[f"{fig}_kvtier_vs_baseline_spread"] = _spread(per["kvtier_base"])
            doc[f"{fig}_lmcache_vs_baseline"] = _med(per["lmcache_base"])
            note = (f"kvtier {_f(doc[f'{fig}_kvtier_gbps'])} / LMCache {_f(doc[f'{fig}_lmcache_gbps'])} / "
                    f"baseline {_f(doc[f'{fig}_baseline_gbps'])} GB/s")
            if r is not None:
                vs_lmc.append(r)
                sp = doc[f"{fig}_ratio_vs_lmcache_spread"]
                target = VS_LMCACHE_DISK_TARGET if g.startswith("disk") else VS_LMCACHE_TARGET
                checks.append(Check(f"{fig} vs LMCache", r, target, True, "x",
                                    f"rounds {sp[0]:.2f}-{sp[1]:.2f}; {note}"))
            if kb is not None:
                vs_base.append(kb)
                sp = doc[f"{fig}_kvtier_vs_baseline_spread"]
                lb = doc[f"{fig}_lmcache_vs_baseline"]
                checks.append(Check(f"{fig} vs {'/'.join(BASELINE_OF[g])} baseline", kb, VS_BASELINE_TARGET, True, "x",
                                    f"rounds {sp[0]:.2f}-{sp[1]:.2f}; LMCache {_f(lb)}x"))
    doc["min_ratio_vs_lmcache"] = min(vs_lmc) if vs_lmc else None
    doc["min_kvtier_vs_baseline"] = min(vs_base) if vs_base else None
    doc["checks"] = [{"name": c.name, "measured": c.measured, "target": c.target, "passed": c.passed, "note": c.note}
                     for c in checks]
    doc["all_targets_met"] = bool(checks) and all(c.passed for c in checks)
    return doc


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def print_report(doc: dict[str, Any]) -> None:
    """One table: each figure for both sides, the ratio, each one's ratio to its baseline; then the checks."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title="kvtier bench peers (GB/s = 1e9 B/s; medians over rounds, ratio spread min-max)")
    for col in ("figure", "kvtier", "LMCache", "kvtier/LMCache", "rounds", "baseline", "kvtier/base", "LMCache/base"):
        t.add_column(col, justify="left" if col == "figure" else "right")
    for fig in FIGURES:
        if f"{fig}_kvtier_gbps" not in doc:
            continue
        sp = doc.get(f"{fig}_ratio_vs_lmcache_spread")
        t.add_row(fig, _f(doc[f"{fig}_kvtier_gbps"]), _f(doc[f"{fig}_lmcache_gbps"]), _f(doc[f"{fig}_ratio_vs_lmcache"]),
                  "-" if not sp else f"{sp[0]:.2f}-{sp[1]:.2f}", _f(doc[f"{fig}_baseline_gbps"]),
                  _f(doc[f"{fig}_kvtier_vs_baseline"]), _f(doc[f"{fig}_lmcache_vs_baseline"]))
    console = Console()
    Console(width=max(console.width, 130)).print(t)
    if doc.get("lmcache_skipped"):
        console.print(f"LMCache skipped: {doc['lmcache_skipped']}")
    for e in doc.get("errors", []):
        console.print(f"[red]error[/red] {e}")
    checks = [Check(c["name"], c["measured"], c["target"], True, "x", c["note"]) for c in doc["checks"]]
    if checks:
        print_checks("targets", checks)
