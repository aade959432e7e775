"""Checking the fleet timing model against a real run: its requests replayed through
:class:`kvtier.sim.fleet.fleet.FleetSim`, predicted vs measured time to first token.

A run is a ``kvtier bench serve`` JSON (``configs.<NAME>`` of a two-instance configuration,
``rr-2x`` or ``router-2x``): per request its send time (``start``), measured ``ttft``,
``output_tokens``, the instance that served it (``backend``, the router's
``x-kvtier-backend``), and under ``prompt_blocks`` its prompt length and Mooncake-format
``hash_ids`` (blocks of ``block_size`` tokens). :func:`load_serve_run` reads it;
:func:`trace_records` makes the Mooncake trace (timestamps in ms from the first send);
:func:`replay` runs it on a fleet of the run's shape (workers, engine blocks, kvtier CPU tier
per instance, each request on the instance that served it); :func:`ttft_error` compares.

``timing_model_ttft_error`` = |mean predicted TTFT - mean measured TTFT| / mean measured.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from kvtier.protocol.decoding import read_json_file
from kvtier.sim.fleet.engine import EngineParams
from kvtier.sim.fleet.fleet import FleetConfig, FleetSim
from kvtier.sim.fleet.numbers import MAX_SECONDS, MAX_TOKENS, MAX_WORKERS, number
from kvtier.storage.trace_file import TraceRecord

#: Two-instance configurations of ``kvtier bench serve`` and the routing each used.
TWO_INSTANCE = {"rr-2x": "round-robin", "router-2x": "kv-aware"}


class TimingInputError(ValueError):
    """A run file that cannot be replayed; the message names the file and what is wrong."""


@dataclass(frozen=True)
class RunRequest:
    """One measured request (seconds)."""

    request_id: str
    start_s: float
    ttft_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    worker: int | None


@dataclass(frozen=True)
class ServeRun:
    """What a replay needs of a real run."""

    source: str
    config: str
    routing: str
    workers: int
    block_size: int
    engine_blocks: int
    cpu_tier_bytes: int
    requests: tuple[RunRequest, ...]
    workload: dict[str, Any]

    def cpu_blocks(self, kv_bytes_per_token: int) -> int:
        """kvtier's CPU tier per instance in blocks (the server got ``cpu_tier_bytes`` rounded
        down to MiB, as ``kvtier bench serve`` passes it)."""
        mib = max(64, self.cpu_tier_bytes >> 20) << 20
        return mib // (self.block_size * kv_bytes_per_token)


def _num(obj: Any, key: str, where: str, lo: float, hi: float, integer: bool = False) -> float:
    """``obj[key]`` as a bounded number (:func:`kvtier.sim.fleet.numbers.number`)."""
    if not isinstance(obj, dict) or key not in obj:
        raise TimingInputError(f"{where}: missing field {key!r}")
    try:
        return number(obj[key], f"{where}: field {key!r}", lo, hi, integer)
    except ValueError as exc:
        raise TimingInputError(str(exc)) from None


def _need(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise TimingInputError(f"{where}: missing field {key!r}")
    v = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        raise TimingInputError(f"{where}: field {key!r} has the wrong type ({type(v).__name__})")
    return v


def load_serve_run(path: Path, config: str | None = None) -> ServeRun:
    """Read a ``kvtier bench serve`` JSON; ``config``: the two-instance configuration to take
    (default: the one present, ``router-2x`` first). Failed requests are left out.

    Raises TimingInputError: no such file, not JSON, no two-instance configuration, a
    configuration without ``prompt_blocks`` (a run from before they were exported), or a
    record missing a field.
    """
    path = Path(path)
    src = str(path)
    try:
        doc = read_json_file(path)
    except ValueError as exc:
        raise TimingInputError(f"{src}: {exc}") from None
    configs = _need(doc, "configs", dict, src)
    names = [n for n in TWO_INSTANCE if n in configs] if config is None else [config]
    if not names:
        raise TimingInputError(f"{src}: no two-instance configuration ({', '.join(TWO_INSTANCE)}) in 'configs' "
                               f"(has {', '.join(configs) or 'none'})")
    name = names[-1] if config is None else names[0]
    if name not in TWO_INSTANCE:
        raise TimingInputError(f"--config {name!r}: choose one of {', '.join(TWO_INSTANCE)}")
    if name not in configs:
        raise TimingInputError(f"{src}: configuration {name!r} is not in the run (has {', '.join(configs)})")
    ph = configs[name]
    where = f"{src} configs.{name}"
    blocks = _need(ph, "prompt_blocks", dict, where)
    _need(blocks, "block_size", int, where + ".prompt_blocks")
    bs = int(_num(blocks, "block_size", where + ".prompt_blocks", 1, 1 << 16, integer=True))
    by_id = _need(blocks, "requests", dict, where + ".prompt_blocks")
    _need(ph, "engine_blocks", int, where)
    engine_blocks = int(_num(ph, "engine_blocks", where, 1, 1 << 24, integer=True))
    cpu_doc = _need(doc, "kvtier_cpu_bytes", dict, src)
    _need(cpu_doc, "per_instance_of_two", int, src + " kvtier_cpu_bytes")
    cpu = int(_num(cpu_doc, "per_instance_of_two", src + " kvtier_cpu_bytes", 0, 1 << 50, integer=True))
    recs = _need(ph, "records", list, where)
    backends = sorted({r["backend"] for r in recs if isinstance(r, dict) and isinstance(r.get("backend"), str)
                       and r["backend"]})
    workers = len(_need(ph, "metrics_delta_per_instance", list, where)) or 2
    if not 1 <= max(workers, len(backends)) <= MAX_WORKERS:
        raise TimingInputError(f"{where}: {max(workers, len(backends))} instances; a replay takes 1-{MAX_WORKERS}")
    seen: set[str] = set()
    out = []
    for i, r in enumerate(recs):
        w = f"{where}.records[{i}]"
        if not _need(r, "ok", bool, w):
            continue
        rid = _need(r, "request_id", str, w)
        if rid in seen:
            raise TimingInputError(f"{w}: request id {rid[:64]!r} appears twice")
        seen.add(rid)
        pb = by_id.get(rid)
        if not isinstance(pb, dict):
            raise TimingInputError(f"{w}: request {rid[:64]!r} has no entry under prompt_blocks.requests")
        pw = f"{where}.prompt_blocks.requests.{rid[:64]}"
        hids = _need(pb, "hash_ids", list, pw)
        if len(hids) > MAX_TOKENS // bs + 1:
            raise TimingInputError(f"{pw}: {len(hids)} hash ids, more blocks than {MAX_TOKENS} tokens hold")
        ids: tuple[int, ...] = tuple(hids) if _ids_ok(hids) else _bad_ids(hids, pw)
        _need(pb, "input_length", int, pw)
        n_in = int(_num(pb, "input_length", pw, 0, MAX_TOKENS, integer=True))
        _need(r, "prompt_tokens", int, w)
        n_prompt = int(_num(r, "prompt_tokens", w, 0, MAX_TOKENS, integer=True)) or n_in
        if n_prompt < 1:
            raise TimingInputError(f"{w}: a request of 0 prompt tokens")
        _need(r, "output_tokens", int, w)
        be = r.get("backend")
        out.append(RunRequest(
            request_id=rid, start_s=_num(r, "start", w, -MAX_SECONDS, MAX_SECONDS),
            ttft_s=_num(r, "ttft", w, 0, MAX_SECONDS),
            input_length=n_prompt, output_length=int(_num(r, "output_tokens", w, 0, MAX_TOKENS, integer=True)),
            hash_ids=ids, worker=backends.index(be) if isinstance(be, str) and be in backends else None))
    if not out:
        raise TimingInputError(f"{where}: no successful request to replay")
    out.sort(key=lambda q: q.start_s)
    return ServeRun(source=src, config=name, routing=TWO_INSTANCE[name], workers=max(workers, len(backends)),
                    block_size=bs, engine_blocks=engine_blocks, cpu_tier_bytes=cpu, requests=tuple(out),
                    workload=doc.get("workload") or {})


def _ids_ok(hids: list[Any]) -> bool:
    return all(isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 63 for h in hids)


def _bad_ids(hids: list[Any], where: str) -> tuple[int, ...]:
    j, h = next((j, h) for j, h in enumerate(hids) if not _ids_ok([h]))
    shown = repr(h) if len(repr(h)) <= 40 else repr(h)[:40] + "..."
    raise TimingInputError(f"{where}: hash_ids[{j}] must be an integer in [0, 2**63), got {shown}")


def trace_records(run: ServeRun) -> list[TraceRecord]:
    """The run's requests as a Mooncake trace (send order; timestamps ms from the first send)."""
    t0 = run.requests[0].start_s
    fresh = 1 + max((i for q in run.requests for i in q.hash_ids), default=-1)
    out = []
    for q in run.requests:
        ids = q.hash_ids
        need = math.ceil(q.input_length / run.block_size)
        if len(ids) > need:  # the server counted fewer prompt tokens than the local tokenization
            ids = ids[:need]
        elif len(ids) < need:  # more: the extra blocks are this request's own
            extra = need - len(ids)
            ids = ids + tuple(range(fresh, fresh + extra))
            fresh += extra
        out.append(TraceRecord((q.start_s - t0) * 1e3, q.input_length, q.output_length, ids))
    return out


def write_trace(run: ServeRun, path: Path) -> None:
    """The Mooncake trace of :func:`trace_records` as JSON Lines (integer ms timestamps, rounded down)."""
    with open(path, "w") as f:
        for r in trace_records(run):
            f.write(json.dumps({"timestamp": int(r.timestamp_ms), "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")


def replay(run: ServeRun, params: EngineParams, use_backends: bool = True) -> tuple[list[float], list[int], dict[str, Any]]:
    """Replay ``run`` on its fleet shape; per request (send order) predicted TTFT and worker,
    and the fleet result (with ``per_request``: each request's simulated hits and its TTFT
    split into its own step alone, ``alone_s``, and the rest, ``wait_s``: waiting for the
    running step, other requests' prefills and decodes in its step). ``use_backends``: each
    request on the instance that served it (when every record names one), else the run's
    routing policy decides."""
    assign = None
    if use_backends and all(q.worker is not None for q in run.requests):
        assign = tuple(int(q.worker) for q in run.requests)  # type: ignore[arg-type]
    cfg = FleetConfig(workers=run.workers, routing=run.routing, engine_blocks=run.engine_blocks,
                      block_size=run.block_size, speed=1.0, params=params,
                      cpu_blocks=run.cpu_blocks(params.kv_bytes_per_token), assign=assign)
    sim = FleetSim(cfg)
    res = sim.run(trace_records(run))
    if any(p is None for p in sim.per_request):
        raise TimingInputError(f"{run.source}: {sim.rejected} request(s) larger than an engine's "
                               f"{run.engine_blocks} blocks (refused in the replay)")
    pred = [sim.ttft_of[i] for i in range(len(sim.per_request))]
    workers = [r.worker for r in sim.per_request]  # type: ignore[union-attr]
    detail = []
    for r, t in zip(sim.per_request, pred):
        assert r is not None
        load = sum(n * params.kv_bytes_per_token / (params.load_gbps.get(k, 1.0) * 1e9) for k, n in r.hit_tiers.items())
        alone = (params.first_token_overhead_s + params.step_overhead_s + load
                 + params.prefill_s(r.input_length - r.hit_tokens, r.hit_tokens))
        detail.append({"hit_engine": r.hit_engine, "hit_tiers": dict(r.hit_tiers), "load_s": load, "alone_s": alone,
                       "wait_s": t - alone})
    out = res.as_dict()
    out["assigned_from_run"] = assign is not None
    out["per_request"] = detail
    return pred, workers, out


def _q(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ttft_error(measured: Sequence[float], predicted: Sequence[float]) -> dict[str, Any]:
    """``ttft_error`` = |mean predicted - mean measured| / mean measured, with the per-request
    relative errors ((predicted - measured) / measured) summarized. Raises ValueError on
    empty or unequal inputs or a non-positive measured mean."""
    if not measured or len(measured) != len(predicted):
        raise ValueError("measured and predicted TTFTs must be non-empty and of equal length")
    mm, pm = statistics.fmean(measured), statistics.fmean(predicted)
    if mm <= 0:
        raise ValueError("mean measured TTFT must be positive")
    rel = [(p - m) / m for m, p in zip(measured, predicted)]
    return {
        "n_requests": len(measured), "measured_mean_ttft_s": mm, "predicted_mean_ttft_s": pm,
        "ttft_error": abs(pm - mm) / mm, "signed_error": (pm - mm) / mm,
        "measured_p50_ttft_s": _q(measured, 0.5), "predicted_p50_ttft_s": _q(predicted, 0.5),
        "per_request_rel_error": {"mean": statistics.fmean(rel), "mean_abs": statistics.fmean(abs(x) for x in rel),
                                  "p10": _q(rel, 0.1), "p50": _q(rel, 0.5), "p90": _q(rel, 0.9),
                                  "min": min(rel), "max": max(rel),
                                  "within_20pct": sum(1 for x in rel if abs(x) <= 0.2) / len(rel)},
    }


def breakdown(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Mean measured vs predicted TTFT by group (of the check's ``requests`` rows): ``round``
    (``u3-r1`` -> r1), ``worker``, and ``hit`` (the replay's view of the prompt: ``cold``,
    ``engine`` or ``tier`` for the larger part of the hit), each with n, the means (s) and the
    predicted mean's own step alone vs waiting (see :func:`replay`)."""
    def key_hit(r: dict[str, Any]) -> str:
        e, t = r.get("hit_engine", 0), sum((r.get("hit_tiers") or {}).values())
        return "cold" if e + t == 0 else ("engine" if e >= t else "tier")

    keys = {"round": lambda r: "r" + r["request_id"].rpartition("-r")[2], "worker": lambda r: f"w{r['worker']}",
            "hit": key_hit}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, f in keys.items():
        g: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            g.setdefault(str(f(r)), []).append(r)
        out[name] = {k: {"n": len(v), "measured_mean_s": statistics.fmean(x["measured_ttft_s"] for x in v),
                         "predicted_mean_s": statistics.fmean(x["predicted_ttft_s"] for x in v),
                         "predicted_alone_mean_s": statistics.fmean(x.get("alone_s", 0.0) for x in v),
                         "predicted_wait_mean_s": statistics.fmean(x.get("wait_s", 0.0) for x in v)}
                     for k, v in sorted(g.items())}
    return out
