"""Run NVIDIA Dynamo's offline trace replay for a list of fleet cells and print one JSON object.

This file runs under *Dynamo's* Python (``kvtier bench fleet --dynamo-python PATH``), so it
imports nothing from kvtier. It calls ``dynamo.replay.run_trace_replay`` (Dynamo 1.6.x: the
engine settings nested under ``"engine"``, simulated vLLM-like "mocker" workers) once per cell::

    python dynamo_driver.py TRACE --cells '[{"workers": 8, "router": "kv_router",
                                             "blocks": 5859, "block_size": 512, "speed": 1.0}]'

Output (stdout): ``{"dynamo_version": ..., "cells": [{"cell": {...}, "reuse": ...,
"mean_ttft_ms": ..., "p99_ttft_ms": ..., "num_requests": ..., "wall_s": ..., "summary": {...}}]}``.
``reuse`` is Dynamo's ``prefix_cache_reused_ratio`` (1 - committed prefill tokens / input tokens).
A cell that fails is reported with ``"error"`` instead (the others still run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Run as a script, this file's folder (kvtier/sim/fleet) is sys.path[0]: its dynamo.py would
# shadow Dynamo's own ``dynamo`` package (and any other sibling a Dynamo dependency's name).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

ROUTERS = ("kv_router", "round_robin")


def _summary(report: object) -> dict:
    data = getattr(report, "summary", report)
    if callable(data):
        data = data()
    try:
        return dict(data)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return {"repr": repr(data)[:2000]}


def run_cell(trace: str, cell: dict) -> dict:
    from dynamo.replay import run_trace_replay

    if cell.get("router") not in ROUTERS:
        return {"cell": cell, "error": f"router must be one of {ROUTERS}"}
    engine = {"block_size": int(cell["block_size"]), "num_gpu_blocks": int(cell["blocks"])}
    t0 = time.time()
    report = run_trace_replay(
        trace, extra_engine_args={"engine": engine}, num_workers=int(cell["workers"]), replay_mode="offline",
        router_mode=cell["router"], arrival_speedup_ratio=float(cell.get("speed", 1.0)),
        trace_block_size=int(cell["block_size"]))
    s = _summary(report)
    return {"cell": cell, "reuse": s.get("prefix_cache_reused_ratio"), "mean_ttft_ms": s.get("mean_ttft_ms"),
            "p99_ttft_ms": s.get("p99_ttft_ms"), "num_requests": s.get("num_requests"),
            "wall_s": round(time.time() - t0, 2), "summary": {k: v for k, v in s.items() if _plain(v)}}


def _plain(v: object) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--cells", required=True, help="JSON list of {workers, router, blocks, block_size, speed}")
    a = ap.parse_args(argv)
    try:
        cells = json.loads(a.cells)
        if not isinstance(cells, list) or not all(isinstance(c, dict) for c in cells):
            raise ValueError("expected a JSON list of objects")
    except ValueError as exc:
        print(f"dynamo_driver: --cells: {exc}", file=sys.stderr)
        return 2
    try:
        from importlib.metadata import version
        dyn_version = version("ai-dynamo")
    except Exception:  # noqa: BLE001 - informational only
        dyn_version = None
    out = []
    for cell in cells:
        try:
            out.append(run_cell(a.trace, cell))
        except Exception as exc:  # noqa: BLE001 - report the cell, run the others
            out.append({"cell": cell, "error": f"{type(exc).__name__}: {exc}"})
    json.dump({"dynamo_version": dyn_version, "cells": out}, sys.stdout, default=str)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
