"""``kvtier bench timing-calibrate`` and ``kvtier bench timing-check``: the fleet timing model
(:mod:`kvtier.sim.fleet.engine`) measured on one vLLM instance, then checked against a real
two-instance ``kvtier bench serve`` run.

**timing-calibrate** starts one vLLM OpenAI server with kvtier (CPU tier), its engine threads
on ``cores`` (one core: what each instance of ``rr-2x``/``router-2x`` gets), engine KV bounded
to ``engine_blocks``, and measures with prompts of random token ids sent one at a time
(``/v1/completions``, streaming, one output token, so the time to first token is the prefill;
the two-instance run's chat requests also pay the chat template, a few ms):

1. three targets cold, then each twice again at once (engine prefix-cache hits);
2. cold prompts at several lengths, ``reps`` of each (enough tokens to push the targets out of engine KV);
3. the targets again: kvtier CPU-tier hits (``/metrics`` external hits say how many tokens);
4. decode steps: 1, 2, 4 and 8 sequences decoding together, 64 tokens each (``ignore_eos``;
   median gap between streamed tokens once every prefill of the batch is done).

It writes a calibration file (:mod:`kvtier.sim.fleet.calibrate`'s format) with the fit in it.
Nothing from a two-instance run goes into it.

**timing-check** replays a bench serve run's two-instance requests through FleetSim with
the calibrated parameters (``--calibration``) or a preset, and writes the predicted vs measured
TTFTs (:mod:`kvtier.sim.fleet.timing`); ``kvtier bench fleet --timing-check PATH`` reads it.
"""

from __future__ import annotations

import json
import os
import stat
import random
import re
import statistics
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtier.bench.common import BLOCK_SIZE, BenchUsageError
from kvtier.memory.numa_topology import parse_cpulist
from kvtier.protocol.decoding import read_json_file
from kvtier.sim.fleet.numbers import MAX_SECONDS, number
from kvtier.sim.fleet.calibrate import CalibrationError, fit_params, load_calibration, params_dict
from kvtier.sim.fleet.engine import PRESETS
from kvtier.sim.fleet.timing import TimingInputError, breakdown, load_serve_run, replay, ttft_error, write_trace

#: Cold prompt lengths (tokens) of the calibration; below the two-instance run's max_model_len.
COLD_LENGTHS = (200, 500, 900, 1300, 1650)
#: vLLM 0.32's CPU defaults for the OpenAI server (``max_num_batched_tokens``, ``max_num_seqs``).
VLLM_CPU_API_BUDGET, VLLM_CPU_API_MAX_SEQS = 2048, 128


def loadavg() -> list[float] | None:
    """1, 5 and 15 minute load averages (None where /proc/loadavg is absent)."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


async def _timed(client: Any, url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """One streaming ``/v1/completions`` request of token ids, ``ignore_eos`` (exactly
    ``max_tokens`` tokens): time to the first streamed token and the gaps between tokens (s).
    Raises RuntimeError when the server answers with an error."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    sent = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            obj = json.loads(line[5:])
            if obj.get("error"):
                raise RuntimeError(str(obj["error"])[:300])
            if obj.get("choices"):  # one chunk per token (its text may be empty: a partial character)
                stamps.append(time.perf_counter() - sent)
    if not stamps:
        raise RuntimeError("no token streamed")
    return stamps[0], [b - a for a, b in zip(stamps, stamps[1:])]


def run_timing_calibrate(json_path: Path | None, cores: str = "0", engine_blocks: int = 59,
                         max_model_len: int = 2048, reps: int = 3, seed: int = 0, neighbour: str | None = None,
                         console: Any = None) -> int:
    """Measure one instance (see the module doc) and write the calibration file. Returns 0.

    ``neighbour``: cores of a second, identical instance kept busy the whole time (two requests
    in flight, 1,300-token cold prompts, 16 tokens each), as the other instance of a two-instance
    configuration is; only the first instance is measured.

    Raises BenchUsageError when the server does not start or a request fails, or (before any
    work) for an output path that cannot be written or cores this machine lacks.
    """
    check_output_path("--json", json_path)
    mine = _cores("--cores", cores)
    if neighbour is not None and mine & _cores("--neighbour", neighbour):
        raise BenchUsageError(f"--neighbour {neighbour} shares a core with --cores {cores}: the neighbour must "
                              "run on cores of its own (the two-instance layout)")
    import asyncio

    import httpx
    from rich.console import Console

    from kvtier.bench.serve.configs import scrape
    from kvtier.demo.model import prepare_model
    from kvtier.integrations.vllm.serve import ApiServer, ServerSpec, ServerStartError

    con = console or Console()
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(200, 40_000) for _ in range(n)]

    model = str(prepare_model().path)
    work = Path(tempfile.mkdtemp(prefix="kvtier-timing-calibrate-"))
    spec = ServerSpec(model=model, kvtier={"cpu_capacity": "1024MiB", "chunk_size": BLOCK_SIZE}, cpu_cores=cores,
                      num_gpu_blocks_override=engine_blocks, max_model_len=max_model_len)
    srv = ApiServer(spec, log_path=str(work / "server.log"))
    other = None if neighbour is None else ApiServer(replace(spec, cpu_cores=neighbour),
                                                     log_path=str(work / "neighbour.log"))
    load_before = loadavg()
    con.print(f"timing-calibrate: one vLLM + kvtier on cores {cores}, {engine_blocks} engine blocks"
              + (f", a busy neighbour on cores {neighbour}" if neighbour else "") + f"; load {load_before}")
    try:
        srv.start(600)
        if other is not None:
            other.start(600)
    except ServerStartError as exc:
        srv.stop()
        raise BenchUsageError(f"vLLM did not start: {str(exc)[-1500:]}") from None
    stop_bg = threading.Event()
    bg_done = [0]

    def background() -> None:
        async def loop() -> None:
            brng = random.Random(seed + 1)
            async with httpx.AsyncClient(timeout=None) as c:
                async def worker() -> None:
                    while not stop_bg.is_set():
                        p = [brng.randrange(200, 40_000) for _ in range(1300)]
                        try:
                            await _timed(c, other.url, other.served_model_name, p, 16)  # type: ignore[union-attr]
                            bg_done[0] += 1
                        except (RuntimeError, httpx.HTTPError):
                            await asyncio.sleep(0.5)
                await asyncio.gather(worker(), worker())
        asyncio.run(loop())

    bg = threading.Thread(target=background, daemon=True) if other is not None else None
    if bg is not None:
        bg.start()
        time.sleep(3.0)  # the neighbour busy before the first measurement
    doc: dict[str, Any] = {"cold": [], "cached": [], "tier_hit": [], "decode": [], "token_budget": VLLM_CPU_API_BUDGET,
                           "max_seqs": VLLM_CPU_API_MAX_SEQS, "kv_bytes_per_token": 23_040, "block_size": BLOCK_SIZE}
    try:
        url, name = srv.url, srv.served_model_name

        async def many(prompts: list[list[int]], max_tokens: int) -> list[tuple[float, list[float]]]:
            async with httpx.AsyncClient(timeout=None) as c:
                return list(await asyncio.gather(*(_timed(c, url, name, p, max_tokens) for p in prompts)))

        def one(p: list[int]) -> tuple[float, dict[str, float]]:
            before = scrape(url)
            try:
                ((ttft, _),) = asyncio.run(many([p], 1))
            except (RuntimeError, httpx.HTTPError) as exc:
                raise BenchUsageError(f"calibration request failed: {exc}") from None
            after = scrape(url)
            return ttft, {k: after[k] - before[k] for k in ("hits", "external_hits", "queries")}

        for _ in range(2):  # warm-up (first requests pay one-time costs)
            one(ids(300))
        targets = [ids(1500), ids(1000), ids(1200)]
        for p in targets:
            t, m = one(p)
            doc["cold"].append({"input_length": len(p), "ttft_s": t, "metrics": m})
        for p in targets:
            for _ in range(2):
                t, m = one(p)
                doc["cached"].append({"input_length": len(p), "cached_tokens": int(m["hits"]), "ttft_s": t, "metrics": m})
        lengths = [n for n in COLD_LENGTHS for _ in range(reps)]
        rng.shuffle(lengths)
        for n in lengths:  # also pushes the targets out of engine KV (more tokens than its blocks)
            t, m = one(ids(n))
            doc["cold"].append({"input_length": n, "ttft_s": t, "metrics": m})
        for p in targets:
            t, m = one(p)
            row = {"tier": "cpu", "input_length": len(p), "tier_tokens": int(m["external_hits"]), "ttft_s": t,
                   "metrics": m}
            if m["hits"] or not m["external_hits"]:
                row["note"] = "not a pure kvtier hit (engine hits or no external hits): left out of the fit"
                doc.setdefault("tier_hit_excluded", []).append(row)
            else:
                doc["tier_hit"].append(row)
        for k in (1, 2, 4, 8):
            try:
                got = asyncio.run(many([ids(100) for _ in range(k)], 64))
            except (RuntimeError, httpx.HTTPError) as exc:
                raise BenchUsageError(f"calibration request failed: {exc}") from None
            gaps = [g for _, itl in got for g in itl[8:]]  # after every prefill of the batch
            doc["decode"].append({"seqs": k, "itl_s": statistics.median(gaps), "gaps": len(gaps),
                                  "itl_p10_s": sorted(gaps)[len(gaps) // 10], "itl_p90_s": sorted(gaps)[9 * len(gaps) // 10]})
    finally:
        stop_bg.set()
        if bg is not None:
            bg.join(120)
        srv.stop()
        if other is not None:
            other.stop()
    doc["neighbour"] = None if neighbour is None else {"cores": neighbour, "requests_done": bg_done[0]}
    doc["machine"] = {"loadavg_before": load_before, "loadavg_after": loadavg(), "cores": cores,
                      "cpu_count": os.cpu_count(), "engine_blocks": engine_blocks, "server_log": str(work / "server.log"),
                      "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    params, report = fit_params(doc, src="timing-calibrate")
    doc["fit"] = report
    for r in report["prefill_points"]:
        con.print(f"  {r['kind']:6} ctx {r['ctx']:5} new {r['new_tokens']:5}: measured {r['measured_s'] * 1e3:7.1f} ms, "
                  f"fit {r['fitted_s'] * 1e3:7.1f} ms")
    con.print(f"fit: {json.dumps(params_dict(params))}")
    _write_out(json_path, doc, con)
    return 0


def _cores(flag: str, spec: str) -> set[int]:
    """The CPU numbers of a list like ``0``, ``0-1`` or ``0,2``; each must be one this process may run on.

    Raises:
        BenchUsageError: malformed, or a core outside this process's affinity.
    """
    text = str(spec).replace(" ", "")
    if not re.fullmatch(r"\d{1,4}(-\d{1,4})?(,\d{1,4}(-\d{1,4})?)*", text, re.ASCII):  # (bounds the set's size)
        raise BenchUsageError(f"{flag} {spec!r}: expected CPU numbers like 0, 0-1 or 0,2")
    try:
        out = set(parse_cpulist(text))
    except ValueError as exc:
        raise BenchUsageError(f"{flag} {spec!r}: {exc}") from None
    allowed = os.sched_getaffinity(0)
    if not out <= allowed:
        raise BenchUsageError(f"{flag} {spec!r}: core(s) {sorted(out - allowed)} not available "
                              f"(this process may use {sorted(allowed)})")
    return out


def check_output_path(flag: str, path: Path | None) -> None:
    """Refuse an output path that cannot take a file before any work is done: an existing
    directory, FIFO or device, or a parent that is not a directory. ``-`` (stdout) passes.

    Raises:
        BenchUsageError: the path cannot be written as a regular file.
    """
    if path is None or str(path) == "-":
        return
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise BenchUsageError(f"{flag} {p}: {exc.strerror or exc}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise BenchUsageError(f"{flag} {p}: exists and is not a regular file")
    parent = p.parent
    if parent.exists() and not parent.is_dir():
        raise BenchUsageError(f"{flag} {p}: {parent} is not a directory")


def _write_out(json_path: Path | None, doc: dict[str, Any], con: Any) -> None:
    """``doc`` as JSON to ``json_path`` (None: nowhere; the CLI turns ``-`` into a file it copies to
    stdout, :func:`kvtier.cli_common.json_target`); a failed write is a usage error."""
    if json_path is None:
        return
    try:
        text = json.dumps(doc, indent=1, allow_nan=False, default=str)
    except ValueError:  # a NaN or infinity the inputs' bounds did not rule out: still valid JSON out
        text = json.dumps(json.loads(json.dumps(doc, default=str), parse_constant=lambda _: None), indent=1)
    try:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(text + "\n")
    except OSError as exc:
        raise BenchUsageError(f"--json {json_path}: {exc.strerror or exc}") from None
    con.print(f"wrote {json_path}")


def run_timing_check(run_path: Path, json_path: Path | None, calibration: Path | None = None,
                     engine: str = "vllm-cpu-smollm2", config: str | None = None, trace_path: Path | None = None,
                     load: dict[str, Any] | None = None, use_backends: bool = True, console: Any = None) -> int:
    """Replay a bench serve run's two-instance requests; write the check. Returns 0 when the
    error is within :data:`kvtier.bench.fleet.TARGETS`' 20%, 1 otherwise.

    Raises BenchUsageError: a bad run or calibration file (missing, not JSON, fields missing),
    an unknown preset.
    """
    from rich.console import Console

    from kvtier.bench.fleet import TARGETS

    check_output_path("--json", json_path)
    check_output_path("--trace", trace_path)
    if trace_path is not None and str(trace_path) == "-":
        raise BenchUsageError("--trace -: the trace goes to a file (JSON Lines), not to stdout")
    con = console or Console()
    try:
        run = load_serve_run(Path(run_path), config)
        if calibration is not None:
            params, cal = load_calibration(Path(calibration))
            source = {"calibration": str(calibration), "fit": cal}
        else:
            if engine not in PRESETS:
                raise BenchUsageError(f"--engine {engine!r}: choose one of {', '.join(PRESETS)}")
            params, source = PRESETS[engine], {"preset": engine}
        pred, workers, fleet = replay(run, params, use_backends)
    except (TimingInputError, CalibrationError) as exc:
        raise BenchUsageError(str(exc)) from None
    measured = [q.ttft_s for q in run.requests]
    err = ttft_error(measured, pred)
    if trace_path is not None:
        write_trace(run, Path(trace_path))
    out = {
        **err, "target": TARGETS["timing_model_ttft_error"], "source_run": run.source, "config": run.config,
        "routing": run.routing, "workers": run.workers, "engine_blocks": run.engine_blocks,
        "cpu_tier_blocks_per_instance": run.cpu_blocks(params.kv_bytes_per_token), "block_size": run.block_size,
        "workload": run.workload, "params": params_dict(params), "params_source": source, "machine_load": load,
        "trace": None if trace_path is None else str(trace_path), "fleet": fleet,
        "requests": [{"request_id": q.request_id, "start_s": q.start_s, "input_length": q.input_length,
                      "output_length": q.output_length, "worker": q.worker, "sim_worker": w,
                      "measured_ttft_s": q.ttft_s, "predicted_ttft_s": p, **d}
                     for q, p, w, d in zip(run.requests, pred, workers, fleet.pop("per_request"))],
    }
    out["breakdown"] = breakdown(out["requests"])
    for name, groups in out["breakdown"].items():
        con.print(f"  by {name}: " + "; ".join(
            f"{k} n={g['n']} {g['measured_mean_s'] * 1e3:.0f} / {g['predicted_mean_s'] * 1e3:.0f} ms "
            f"(alone {g['predicted_alone_mean_s'] * 1e3:.0f} + wait {g['predicted_wait_mean_s'] * 1e3:.0f})"
            for k, g in groups.items()))
    rel = err["per_request_rel_error"]
    con.print(f"timing check of {run.config} ({run.source}), {err['n_requests']} requests, {params.name}: "
              f"mean TTFT measured {err['measured_mean_ttft_s'] * 1e3:.0f} ms, predicted "
              f"{err['predicted_mean_ttft_s'] * 1e3:.0f} ms, error {err['ttft_error']:.3f} (target <= "
              f"{out['target']}); per request (pred - meas) / meas p10 {rel['p10']:+.2f} p50 {rel['p50']:+.2f} "
              f"p90 {rel['p90']:+.2f}, {rel['within_20pct']:.0%} within 20%")
    _write_out(json_path, out, con)
    return 0 if err["ttft_error"] <= out["target"] else 1


def read_timing_check(path: Path) -> dict[str, Any]:
    """The ``timing`` dict of :func:`kvtier.bench.fleet.run_bench_fleet` from a timing-check file.

    Raises BenchUsageError: missing file, not JSON, fields missing.
    """
    path = Path(path)
    try:
        doc = read_json_file(path)
    except ValueError as exc:
        raise BenchUsageError(f"--timing-check {path}: {exc}") from None
    need = ("ttft_error", "measured_mean_ttft_s", "predicted_mean_ttft_s", "n_requests", "source_run")
    missing = [k for k in need if not isinstance(doc, dict) or k not in doc]
    if missing:
        raise BenchUsageError(f"--timing-check {path}: missing field(s) {', '.join(missing)} "
                              "(write it with `kvtier bench timing-check`)")
    try:
        err = number(doc["ttft_error"], "ttft_error", 0, 1e6)
        measured = number(doc["measured_mean_ttft_s"], "measured_mean_ttft_s", 0, MAX_SECONDS, lo_open=True)
        predicted = number(doc["predicted_mean_ttft_s"], "predicted_mean_ttft_s", 0, MAX_SECONDS)
        n = int(number(doc["n_requests"], "n_requests", 1, 1 << 40, integer=True))
    except ValueError as exc:
        raise BenchUsageError(f"--timing-check {path}: {exc}") from None
    return {"ttft_error": err, "measured_mean_ttft_ms": 1e3 * measured,
            "predicted_mean_ttft_ms": 1e3 * predicted, "n_requests": n,
            "source_run": str(doc["source_run"])[:4096], "config": doc.get("config"), "machine_load": doc.get("machine_load"),
            "per_request_rel_error": doc.get("per_request_rel_error"), "params": doc.get("params"),
            "timing_check_file": str(path)}
