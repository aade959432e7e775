"""``kvtier bench fleet``: a production trace through kvtier's policies, router and tiers, with
Dynamo's KV router on the same trace side by side in one run.

Parts, all on the trace given (Mooncake format, e.g. the FAST'25 conversation trace):

1. **Single cache** (:mod:`kvtier.sim.trace_replay`, every-block mode): every policy at 1M and
   3M tokens, Belady's MIN as the ceiling.
2. **Fleet cells** (:mod:`kvtier.sim.fleet`): W workers x arrival speeds, each worker an engine
   with ``capacity_tokens`` of block cache (``capacity_tokens // block_size`` blocks), routed
   by kvtier's ``kv-aware`` and ``round-robin`` policies; the same cells through Dynamo's replay
   (``kv_router``, ``round_robin``) when ``--dynamo-python`` is given. Same trace, worker count,
   per-worker capacity (tokens and blocks) and arrival speed on both sides.
3. **Shared pool**: the largest W at 1x, round robin, with one kvtier pool of W x capacity
   behind the engines, against the unbounded cache's reuse.

Reuse everywhere is Dynamo's: 1 - computed prefill tokens / input tokens.

Top-level JSON keys: ``lru_hit_rate_3m``, ``best_policy``, ``best_policy_vs_belady_1m``,
``best_policy_vs_belady_3m``, ``router_reuse_vs_dynamo_min`` (min over cells of kvtier
kv-aware reuse / Dynamo kv_router reuse; None without Dynamo), ``max_request_share_ratio``
(kvtier kv-aware, max over cells of the busiest worker's requests / the mean),
``shared_pool_round_robin_vs_infinite`` and ``timing_model_ttft_error`` (|predicted - measured|
/ measured mean TTFT of a real two-instance ``kvtier bench serve`` run replayed through the
timing model, from the ``kvtier bench timing-check`` file given as ``--timing-check``
(:mod:`kvtier.bench.fleet_timing`); None without one, the reason under ``timing_model``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

from kvtier.bench.common import BenchUsageError
from kvtier.sim.fleet.dynamo import DynamoError, dynamo_cell, run_dynamo
from kvtier.sim.fleet.engine import PRESETS
from kvtier.sim.fleet.fleet import FleetConfig, FleetSim, take, unbounded_reuse
from kvtier.sim.trace_replay import replay_trace
from kvtier.storage.trace_file import iter_trace

#: Targets of issue 28 (ratios; see the module doc).
TARGETS = {"best_policy_vs_belady_1m": 0.5, "best_policy_vs_belady_3m": 0.6, "router_reuse_vs_dynamo_min": 1.0,
           "max_request_share_ratio": 1.5, "shared_pool_round_robin_vs_infinite": 0.9,
           "timing_model_ttft_error": 0.2}
_LOWER_IS_BETTER = {"max_request_share_ratio", "timing_model_ttft_error"}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def run_bench_fleet(trace: Path, json_path: Path | None = None, dynamo_python: Path | None = None,
                    workers: Sequence[int] = (4, 8), speeds: Sequence[float] = (1.0, 4.0),
                    capacity_tokens: int = 3_000_000, block_size: int = 512, engine: str = "mocker-like",
                    pool_policy: str = "lru", max_requests: int | None = None, timing: dict | None = None,
                    enforce: bool = True, console: Any = None) -> int:
    """Run the bench; returns 0 when every target with a figure is met, 1 otherwise.

    Raises:
        BenchUsageError: no such trace, an unknown engine preset, a capacity below one block.
    """
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    if not Path(trace).is_file():
        raise BenchUsageError(f"--trace {trace}: no such file")
    if engine not in PRESETS:
        raise BenchUsageError(f"--engine {engine!r}: choose one of {', '.join(PRESETS)}")
    blocks = capacity_tokens // block_size
    if blocks < 1:
        raise BenchUsageError(f"--capacity-tokens {capacity_tokens} is below one {block_size}-token block")
    t0 = time.perf_counter()
    records = lambda: take(iter_trace(trace, block_size), max_requests)  # noqa: E731

    con.print("single cache: every policy at 1M and 3M tokens, Belady's MIN ...")
    single = replay_trace(trace, (1_000_000, 3_000_000), None, block_size, None, "every-block", True, max_requests)
    best = single.best_policy()
    out: dict[str, Any] = {
        "lru_hit_rate_3m": single.rate("lru", 3_000_000),
        "best_policy": best,
        "best_policy_vs_belady_1m": _ratio(single.rate(best, 1_000_000), single.belady_rate(1_000_000)),
        "best_policy_vs_belady_3m": _ratio(single.rate(best, 3_000_000), single.belady_rate(3_000_000)),
    }

    params = PRESETS[engine]
    cells: list[dict[str, Any]] = []
    for w in workers:
        for sp in speeds:
            row: dict[str, Any] = {"workers": w, "speed": sp, "engine_blocks": blocks, "capacity_tokens": capacity_tokens}
            for routing in ("kv-aware", "round-robin"):
                con.print(f"fleet: {w} workers, {sp:g}x, kvtier {routing} ...")
                res = FleetSim(FleetConfig(w, routing, blocks, block_size, sp, params)).run(records())
                row[f"kvtier_{routing}"] = res.as_dict()
            cells.append(row)

    dyn: dict[str, Any] | None = None
    if dynamo_python is not None:
        if max_requests is not None:
            con.print("[yellow]--max-requests: Dynamo replays the whole trace; its cells are not comparable[/yellow]")
        dcells = [dynamo_cell(c["workers"], r, blocks, block_size, c["speed"]) for c in cells
                  for r in ("kv_router", "round_robin")]
        con.print(f"Dynamo: {len(dcells)} cells ...")
        try:
            dyn = run_dynamo(dynamo_python, trace, dcells)
        except DynamoError as exc:
            raise BenchUsageError(str(exc)) from None
        failed = [d for d in dyn["cells"] if "error" in d]
        if failed and len(failed) == len(dyn["cells"]):  # nothing to compare: say why, not a column of '-'
            raise BenchUsageError(f"Dynamo's replay failed in every cell, e.g. {failed[0]['cell']}: "
                                  f"{failed[0]['error']}")
        for d in failed:
            con.print(f"[yellow]Dynamo cell {d['cell']} failed: {d['error']}[/yellow]")
        by = {(d["cell"]["workers"], float(d["cell"]["speed"]), d["cell"]["router"]): d for d in dyn["cells"]}
        for c in cells:
            for r in ("kv_router", "round_robin"):
                c[f"dynamo_{r}"] = by.get((c["workers"], float(c["speed"]), r))

    kv_ratios = [_ratio(c["kvtier_kv-aware"]["reuse"], (c.get("dynamo_kv_router") or {}).get("reuse"))
                 for c in cells]
    out["router_reuse_vs_dynamo_min"] = None if dyn is None or None in kv_ratios else min(kv_ratios)  # type: ignore[type-var]
    out["max_request_share_ratio"] = max(c["kvtier_kv-aware"]["max_request_share_ratio"] for c in cells)

    wmax = max(workers)
    con.print(f"shared pool: {wmax} workers, 1x, round robin, pool of {wmax} x {capacity_tokens:,} tokens ...")
    pool = FleetSim(FleetConfig(wmax, "round-robin", blocks, block_size, 1.0, params, pool_blocks=wmax * blocks,
                                policy=pool_policy)).run(records())
    inf = unbounded_reuse(records(), block_size)
    out["shared_pool_round_robin_vs_infinite"] = _ratio(pool.reuse, inf)
    out["timing_model_ttft_error"] = None if timing is None else timing.get("ttft_error")
    if timing is not None:
        con.print(f"timing model: {timing.get('n_requests')} requests of {timing.get('source_run')}: mean TTFT measured "
                  f"{timing.get('measured_mean_ttft_ms', 0):.0f} ms, predicted {timing.get('predicted_mean_ttft_ms', 0):.0f} ms")
    else:
        timing = {"status": "not measured: no real two-instance kvtier bench serve run was compared "
                            "(the engine presets' sources are under engine)"}

    out.update({
        "trace": Path(trace).name, "block_size": block_size, "capacity_tokens": capacity_tokens,
        "engine": {"preset": params.name, "source": params.source}, "unbounded_reuse": inf,
        "single_cache": single.as_dict(), "cells": cells, "shared_pool": pool.as_dict(),
        "dynamo_version": None if dyn is None else dyn.get("dynamo_version"), "timing_model": timing,
        "targets": TARGETS, "elapsed_s": time.perf_counter() - t0,
    })
    met = {k: _met(k, out.get(k)) for k in TARGETS}
    out["targets_met"] = met

    t = Table(title=f"Fleet replay of {Path(trace).name}: reuse (1 - computed / input tokens), "
                    f"{capacity_tokens:,} tokens ({blocks} blocks) of engine cache per worker")
    for col in ("workers", "speed", "kvtier kv-aware", "kvtier round robin", "Dynamo kv_router",
                "Dynamo round_robin", "TTFT ms kvtier / Dynamo (KV)", "max share"):
        t.add_column(col, justify="right")
    for c in cells:
        dk, dr = c.get("dynamo_kv_router") or {}, c.get("dynamo_round_robin") or {}
        kv = c["kvtier_kv-aware"]
        t.add_row(str(c["workers"]), f"{c['speed']:g}x", f"{kv['reuse']:.3f}", f"{c['kvtier_round-robin']['reuse']:.3f}",
                  _f(dk.get("reuse")), _f(dr.get("reuse")),
                  f"{kv['ttft_mean_ms']:.0f} / {_f(dk.get('mean_ttft_ms'), '.0f')}", f"{kv['max_request_share_ratio']:.2f}")
    con.print(t)
    con.print(f"single cache: LRU at 3M {out['lru_hit_rate_3m']:.3f}; best {best}: "
              f"{_f(out['best_policy_vs_belady_1m'])}x Belady at 1M, {_f(out['best_policy_vs_belady_3m'])}x at 3M; "
              f"shared pool round robin {pool.reuse:.3f} = {_f(out['shared_pool_round_robin_vs_infinite'])}x the "
              f"unbounded cache's {inf:.3f}")
    con.print("targets: " + ", ".join(f"{k} {'met' if v else ('n/a' if v is None else 'MISSED')}" for k, v in met.items()))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(out, indent=1, default=str))
        con.print(f"wrote {json_path}")
    return 1 if enforce and any(v is False for v in met.values()) else 0


def _met(key: str, value: float | None) -> bool | None:
    if value is None:
        return None
    return value <= TARGETS[key] if key in _LOWER_IS_BETTER else value >= TARGETS[key]


def _f(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)
