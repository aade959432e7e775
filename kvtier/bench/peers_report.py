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
#: Plain physical baselines (in the baseline child's result) behind each figure group; per round
#: the fastest counts. Information: kvtier does work these do not (checksums, crash-safe renames).
BASELINE_OF = {"cpu": ("memcpy",), "disk": ("file", "file_steps"), "disk_direct": ("file_direct",),
               "redis": ("redis",)}
#: The same-work baseline of each figure group (the judged one, :data:`VS_SAME_WORK_TARGET`): the
#: plain calls plus the xxh3-64 of every chunk that kvtier stores and verifies (disk and Redis
#: records carry one; the CPU tier keeps none, so memcpy is its same work). See :mod:`.peers_baseline`.
SAME_WORK_BASELINE_OF: dict[str, tuple[str, ...]] = {"cpu": ("memcpy",), "disk": ("file_xxh3",), "disk_direct": ("file_direct_xxh3",),
                         "redis": ("redis_xxh3",)}
#: What each side does per figure group (in the JSON and under the table).
SIDES = {
    "cpu": {"kvtier": "hash tokens, StorageManager open_write + copy out of the KV tensor + commit; "
                      "lookup_keys (lease) + open_read + copy back + release",
            "lmcache": "LMCacheEngine.store() / retrieve() (token hashing, pool allocation, copy)",
            "baseline": "numpy copyto of the same chunks (memcpy)"},
    "disk": {"kvtier": "DiskTier.put_many: xxh3-64 of each payload, .tmp file + rename, 4 I/O threads; "
                       "get_many_into: one preadv per chunk straight into the caller's buffer, xxh3-64 verified "
                       "(unverified: disk_verify_reads=false, no hash on read)",
             "lmcache": "LocalDiskBackend batched_submit_put_task until every write completed (one write "
                        "per file, 4 threads, no checksum) / batched_get_blocking (readinto a pool buffer, "
                        "4 threads, no checksum); no CPU copy kept (local_cpu=False)",
             "baseline": "plain open/pwrite/close and open/preadv/close on 4 threads (faster of whole files "
                         "and steps); same work: xxh3-64 of each chunk + 1 MiB writes / one read + xxh3-64 "
                         "(file_xxh3)"},
    "disk_direct": {"kvtier": "as disk, O_DIRECT", "lmcache": "as disk, use_odirect",
                    "baseline": "plain O_DIRECT files on 4 threads; same work: plus xxh3-64 of each chunk "
                                "(file_direct_xxh3)"},
    "redis": {"kvtier": "RedisTier.put_many / get_many_into (checksummed envelope, verified)",
              "lmcache": "RemoteBackend (redis://, naive serde)",
              "baseline": "redis-py pipelined SET / GET; same work: plus xxh3-64 of each chunk (redis_xxh3)"},
}
#: Both sides time the get right after their own put of the same bytes, after the same os.sync and
#: freed memory before the put: same page-cache state (files just written), same kind of destination
#: (a pre-touched pool).
TIMING = ("each side: os.sync + free the same fresh memory, timed put, then at once the timed get of "
          "the same chunks (page cache and CPU caches as the put left them), 1 warm-up + reps")
#: Figure groups whose kvtier side also runs with read verification off (``disk_verify_reads = false``).
UNVERIFIED_GROUPS = ("disk", "disk_direct")
#: Judged: kvtier (reads verified, the default) / the same-work baseline of the same round.
VS_SAME_WORK_TARGET = 0.9
#: Judged: kvtier with read verification off (``disk_verify_reads = false``; figures without that
#: setting: kvtier as it is) / LMCache, which verifies nothing.
VS_LMCACHE_UNVERIFIED_TARGET = 1.0


def _gbps(nbytes: int, seconds: list[float]) -> float | None:
    if not seconds:
        return None
    s = statistics.median(seconds)
    return nbytes / s / 1e9 if s > 0 else None


def _best(base: dict[str, Any] | None, group: str, op: str, of: dict[str, tuple[str, ...]] = BASELINE_OF) -> float | None:
    """GB/s of the fastest baseline (of ``of[group]``) for ``op`` in one round (None: none measured)."""
    if not base or group not in of:
        return None
    got = [_gbps(base["bytes"], base.get(f"{name}_{op}_s", [])) for name in of[group]]
    vals = [v for v in got if v is not None]
    return max(vals) if vals else None


def _med(xs: list[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def _spread(xs: list[float]) -> list[float] | None:
    return [min(xs), max(xs)] if xs else None


def _ratios(rounds: list[dict[str, Any]], g: str, op: str, level_ok: bool) -> dict[str, list[float]]:
    """Per-round GB/s of each side and the ratios of one figure (lists over rounds where measured)."""
    per: dict[str, list[float]] = {k: [] for k in (
        "kvtier", "kvtier_unverified", "lmcache", "baseline", "same_work", "ratio", "unverified_ratio",
        "kvtier_base", "lmcache_base", "kvtier_same_work")}
    for rd in rounds:
        kv, lm = rd["kvtier"].get(g), rd["lmcache"].get(g)
        kvu = rd.get("kvtier_unverified", {}).get(g) or kv  # no such setting for this figure: kvtier as it is
        base = rd.get("baseline")
        k = _gbps(kv["bytes"], kv[f"{op}_s"]) if kv else None
        ku = _gbps(kvu["bytes"], kvu[f"{op}_s"]) if kvu else None
        m = _gbps(lm["bytes"], lm[f"{op}_s"]) if lm and level_ok else None
        b = _best(base, g, op)
        sw = _best(base, g, op, SAME_WORK_BASELINE_OF)
        for name, v in (("kvtier", k), ("kvtier_unverified", ku), ("lmcache", m), ("baseline", b), ("same_work", sw)):
            if v is not None:
                per[name].append(v)
        for name, x, y in (("ratio", k, m), ("unverified_ratio", ku, m), ("kvtier_base", k, b),
                           ("lmcache_base", m, b), ("kvtier_same_work", k, sw)):
            if x and y:
                per[name].append(x / y)
    return per


def build_report(rounds: list[dict[str, Any]], groups: list[str], lmc_child: dict[str, tuple[str, str, bool]]) -> dict[str, Any]:
    """The JSON document from the raw rounds (``kvtier``, ``kvtier_unverified``, ``lmcache``, ``baseline``).

    Per figure (medians over rounds, ``_spread`` = [min, max] over rounds):
    ``<figure>_{kvtier,kvtier_unverified,lmcache,baseline,same_work_baseline}_gbps``,
    ``<figure>_ratio_vs_lmcache`` (kvtier as configured by default, reads verified),
    ``<figure>_unverified_ratio_vs_lmcache`` (read verification off; judged >= 1.0),
    ``<figure>_kvtier_vs_same_work`` (judged >= 0.9), ``<figure>_{kvtier,lmcache}_vs_baseline`` (plain).
    Summary: ``min_ratio_vs_lmcache``, ``min_ratio_vs_lmcache_unverified``, ``min_ratio_vs_same_work``,
    ``min_kvtier_vs_baseline``; ``sides``, ``timing``, ``checks`` (the judged ones) and ``all_targets_met``."""
    doc: dict[str, Any] = {}
    mins: dict[str, list[float]] = {"ratio": [], "unverified_ratio": [], "kvtier_same_work": [], "kvtier_base": []}
    checks: list[Check] = []
    for g in groups:
        for op in ("put", "get"):
            fig = f"{g}_{op}"
            per = _ratios(rounds, g, op, bool(lmc_child.get(g)))
            for name, key in (("kvtier", "kvtier_gbps"), ("kvtier_unverified", "kvtier_unverified_gbps"),
                              ("lmcache", "lmcache_gbps"), ("baseline", "baseline_gbps"),
                              ("same_work", "same_work_baseline_gbps"), ("ratio", "ratio_vs_lmcache"),
                              ("unverified_ratio", "unverified_ratio_vs_lmcache"), ("kvtier_base", "kvtier_vs_baseline"),
                              ("lmcache_base", "lmcache_vs_baseline"), ("kvtier_same_work", "kvtier_vs_same_work")):
                doc[f"{fig}_{key}"] = _med(per[name])
                doc[f"{fig}_{key}_spread"] = _spread(per[name])
            for name in mins:
                if per[name]:
                    mins[name].append(float(statistics.median(per[name])))
            sw = doc[f"{fig}_kvtier_vs_same_work"]
            if sw is not None:
                sp = doc[f"{fig}_kvtier_vs_same_work_spread"]
                checks.append(Check(
                    f"{fig} vs {'/'.join(SAME_WORK_BASELINE_OF[g])} (same work)", sw, VS_SAME_WORK_TARGET, True, "x",
                    f"rounds {sp[0]:.2f}-{sp[1]:.2f}; kvtier {_f(doc[f'{fig}_kvtier_gbps'])} / same work "
                    f"{_f(doc[f'{fig}_same_work_baseline_gbps'])} GB/s; vs plain {_f(doc[f'{fig}_kvtier_vs_baseline'])}x"))
            ur = doc[f"{fig}_unverified_ratio_vs_lmcache"]
            if ur is not None:
                sp = doc[f"{fig}_unverified_ratio_vs_lmcache_spread"]
                off = "verification off" if g in UNVERIFIED_GROUPS else "no read verification to turn off"
                checks.append(Check(
                    f"{fig} ({off}) vs LMCache", ur, VS_LMCACHE_UNVERIFIED_TARGET, True, "x",
                    f"rounds {sp[0]:.2f}-{sp[1]:.2f}; {_f(doc[f'{fig}_kvtier_unverified_gbps'])} vs LMCache "
                    f"{_f(doc[f'{fig}_lmcache_gbps'])} GB/s; verified {_f(doc[f'{fig}_ratio_vs_lmcache'])}x"))
    doc["min_ratio_vs_lmcache"] = min(mins["ratio"]) if mins["ratio"] else None
    doc["min_ratio_vs_lmcache_unverified"] = min(mins["unverified_ratio"]) if mins["unverified_ratio"] else None
    doc["min_ratio_vs_same_work"] = min(mins["kvtier_same_work"]) if mins["kvtier_same_work"] else None
    doc["min_kvtier_vs_baseline"] = min(mins["kvtier_base"]) if mins["kvtier_base"] else None
    doc["sides"] = {g: SIDES[g] for g in groups if g in SIDES}
    doc["timing"] = TIMING
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
    for col in ("figure", "kvtier", "kvtier unverified", "LMCache", "kvtier/LMCache", "unverified/LMCache", "rounds",
                "same work", "kvtier/same work", "kvtier/plain", "LMCache/plain"):
        t.add_column(col, justify="left" if col == "figure" else "right")
    for fig in FIGURES:
        if f"{fig}_kvtier_gbps" not in doc:
            continue
        sp = doc.get(f"{fig}_unverified_ratio_vs_lmcache_spread")
        t.add_row(fig, _f(doc[f"{fig}_kvtier_gbps"]), _f(doc[f"{fig}_kvtier_unverified_gbps"]),
                  _f(doc[f"{fig}_lmcache_gbps"]), _f(doc[f"{fig}_ratio_vs_lmcache"]),
                  _f(doc[f"{fig}_unverified_ratio_vs_lmcache"]), "-" if not sp else f"{sp[0]:.2f}-{sp[1]:.2f}",
                  _f(doc[f"{fig}_same_work_baseline_gbps"]), _f(doc[f"{fig}_kvtier_vs_same_work"]),
                  _f(doc[f"{fig}_kvtier_vs_baseline"]), _f(doc[f"{fig}_lmcache_vs_baseline"]))
    console = Console()
    wide = Console(width=max(console.width, 140))
    wide.print(t)
    for g, what in doc.get("sides", {}).items():
        wide.print(f"[dim]{g}: kvtier = {what['kvtier']}; LMCache = {what['lmcache']}; baseline = {what['baseline']}[/dim]")
    if doc.get("timing"):
        wide.print(f"[dim]timing: {doc['timing']}[/dim]")
    if doc.get("lmcache_skipped"):
        console.print(f"LMCache skipped: {doc['lmcache_skipped']}")
    for e in doc.get("errors", []):
        console.print(f"[red]error[/red] {e}")
    checks = [Check(c["name"], c["measured"], c["target"], True, "x", c["note"]) for c in doc["checks"]]
    if checks:
        print_checks("targets", checks)
