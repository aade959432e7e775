"""Phase 4 of ``kvtier bench serve`` interleaved: vLLM alone and vLLM + kvtier, both up with
the whole working set fitting in engine KV, take turns in ABBA order on fresh users.

Why: the two phases used to run minutes apart on a shared machine, and a neighbour's burst
or a slower first run after a lock changes hands moved ``fits_throughput_ratio`` by
+-25% between runs (0.78 and 1.06 measured), far more than the 2% the target allows.
Taking turns (rep ``k`` runs the same fresh users on both servers, the order flipping each
rep) puts drift and neighbours on both sides alike; the per-rep ratios show the spread.

Each rep is the full multi-round workload of :func:`.measure.measure_sessions` on users
``rep * users ...`` (rep 0: the users of the other phases), so every rep starts with
nothing of its own cached and the engine then holds its whole working set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from kvtier.bench.common import BenchUsageError
from kvtier.bench.serve.answer_check import CHECKED, run_check
from kvtier.bench.serve.client import OnDone, RequestRecord
from kvtier.bench.serve.configs import CONFIGS
from kvtier.bench.serve.measure import measure_sessions
from kvtier.bench.serve.options import ServeBenchOptions, Target
from kvtier.bench.serve.phase import Phase
from kvtier.bench.serve.servers import served_model, start_config
from kvtier.bench.serve.workload import Session, Tokenizer, WorkloadSpec, build_sessions


def rep_spec(spec: WorkloadSpec, rep: int) -> WorkloadSpec:
    """The workload of rep ``rep`` (>= 0): the same shape on users ``rep * spec.users`` on."""
    if rep < 0:
        raise ValueError(f"rep must be >= 0, got {rep}")
    return dataclasses.replace(spec, user_offset=spec.user_offset + rep * spec.users)


def abba_order(labels: Sequence[str], reps: int) -> list[list[str]]:
    """Turn order per rep: ``labels`` on even reps, reversed on odd ones (A B, B A, A B, ...).

    Raises ValueError for reps < 1."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    return [list(labels) if k % 2 == 0 else list(labels)[::-1] for k in range(reps)]


def merge_phases(name: str, parts: Sequence[Phase]) -> Phase:
    """One phase from consecutive runs of one configuration: records in run order, wall
    times (seconds) and per-instance metric deltas summed; ``extra`` counts summed, the
    measured working set the largest. Raises ValueError for no parts."""
    if not parts:
        raise ValueError("no phases to merge")
    metrics: list[dict[str, float]] = []
    for p in parts:
        for i, m in enumerate(p.metrics):
            if i == len(metrics):
                metrics.append({})
            for k, v in m.items():
                metrics[i][k] = metrics[i].get(k, 0.0) + v
    extra: dict[str, Any] = {
        "working_set_blocks_measured": max(int(p.extra.get("working_set_blocks_measured", 0)) for p in parts),
        "prompt_tokens_local_vs_server_mismatches": sum(
            int(p.extra.get("prompt_tokens_local_vs_server_mismatches", 0)) for p in parts),
    }
    return Phase(name, [r for p in parts for r in p.records], sum(p.wall_s for p in parts), metrics,
                 parts[0].engine_blocks, extra)


def _throughput(p: Phase) -> float:
    ok = sum(1 for r in p.records if r.ok)
    return ok / p.wall_s if p.wall_s > 0 else 0.0


def measure_fits_interleaved(
    endpoints: Mapping[str, tuple[str, str, Sequence[str]]], baseline: str, blocks: int | None,
    spec: WorkloadSpec, tokenizer: Tokenizer, opts: ServeBenchOptions, on_done: OnDone, reps: int,
) -> tuple[dict[str, Phase], dict[str, Any]]:
    """Run ``reps`` reps of the multi-round workload on each endpoint, turns in ABBA order.

    Args:
        endpoints: label (``vllm@fits``, ``kvtier-cpu@fits``) -> (url, served model, instance
            URLs), all up; two labels, ``baseline`` one of them.
        blocks: the engine KV bound of the servers (None: not ours).
        reps: reps per endpoint (>= 1; even values balance the order).

    Returns:
        (merged phase per label, ``info``): ``info`` has ``order`` (labels per rep),
        ``rep_throughput`` (label -> requests/s per rep), ``pair_ratios`` (other / baseline
        per rep), their ``median``, ``min`` and ``max``.

    Raises:
        ValueError: not two endpoints, ``baseline`` missing, reps < 1.
        httpx.HTTPError: as :func:`.measure.measure_sessions`.
    """
    if len(endpoints) != 2 or baseline not in endpoints:
        raise ValueError(f"expected two endpoints including {baseline!r}, got {list(endpoints)}")
    other = next(k for k in endpoints if k != baseline)
    order = abba_order([baseline, other], reps)
    parts: dict[str, list[Phase]] = {k: [] for k in endpoints}
    for rep, turn in enumerate(order):
        rs = rep_spec(spec, rep)
        for label in turn:
            sessions: list[Session] = build_sessions(rs, tokenizer)  # fresh objects: answers are filled in
            url, model, instances = endpoints[label]
            parts[label].append(measure_sessions(label, url, model, instances, blocks, sessions, rs, tokenizer,
                                                 opts, on_done))
    ratios = [(_throughput(o) / _throughput(b)) if _throughput(b) > 0 else 0.0
              for b, o in zip(parts[baseline], parts[other])]
    info = {
        "order": order,
        "rep_throughput": {k: [_throughput(p) for p in v] for k, v in parts.items()},
        "pair_ratios": ratios,
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
    }
    return {k: merge_phases(k, v) for k, v in parts.items()}, info


def fits_working_set(spec: WorkloadSpec, tokenizer: Tokenizer, reps: int, block_size: int) -> tuple[int, int]:
    """(most distinct blocks, longest prompt in tokens) over the reps' workloads, with
    ``max_tokens`` placeholder answers: what engine KV must hold for every rep to fit."""
    from kvtier.bench.serve.workload import (
        placeholder_answers,
        working_set,
        workload_prompts,
    )

    sets = [working_set(workload_prompts(build_sessions(rep_spec(spec, k), tokenizer), tokenizer,
                                         placeholder_answers(spec)), block_size) for k in range(max(1, reps))]
    return max(w.blocks for w in sets), max(w.max_prompt_tokens for w in sets)


def run_fits_interleaved(targets: dict[str, Target] | None, model_path: str | None, fits_blocks: int, max_model_len: int,
                      cpu_bytes: int, workdir: Path, spec: WorkloadSpec, tokenizer: Tokenizer, opts: ServeBenchOptions,
                      on_done: Any, check_users: Any, phases: dict[str, Phase], check_runs: dict[str, list[RequestRecord]],
                      errors: dict[str, str], progress: Any, task: Any, console: Any) -> dict[str, Any] | None:
    """Phase 4 with both servers up, turns in ABBA order (:mod:`.fits_ab`), then its answer checks.
    Fills ``phases``/``check_runs``; a failure goes to ``errors`` (BenchUsageError with targets propagates)."""
    labels = ["vllm@fits", "kvtier-cpu@fits"]
    progress.update(task, description="vllm@fits, kvtier-cpu@fits: starting")
    try:
        with contextlib.ExitStack() as stack:
            eps: dict[str, tuple[str, str, list[str]]] = {}
            for label in labels:
                if targets is not None:
                    t = targets[label]
                    eps[label] = (t.url, served_model(t.url), list(t.instances))
                else:
                    run = stack.enter_context(start_config(CONFIGS[label.split("@")[0]], str(model_path), fits_blocks,
                                                           max_model_len, cpu_bytes, workdir, label.replace("@", "-")))
                    eps[label] = (run.url, run.model, run.instances)
            progress.update(task, description=f"fits: {opts.fits_reps} reps each, turns ABBA")
            got, info = measure_fits_interleaved(eps, "vllm@fits", None if targets is not None else fits_blocks, spec,
                                                 tokenizer, opts, on_done, opts.fits_reps)
            phases.update(got)
            for label in labels:
                if label in CHECKED:
                    progress.update(task, description=f"{label}: answer check (serial)")
                    check_runs[label] = run_check(eps[label][0], eps[label][1], check_users, opts.max_tokens, on_done)
            return info
    except (BenchUsageError, httpx.HTTPError, OSError, RuntimeError) as exc:
        if targets is not None and isinstance(exc, BenchUsageError):
            raise
        errors["fits"] = str(exc)[-2000:]
        console.print(f"[red]fits: {str(exc)[:500]}[/red]")
        return None
