"""``kvtier bench ...``: benchmarks that print ratios measured side by side in one run.
Each command imports its module lazily, so ``kvtier --help`` does not import vLLM or torch."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kvtier.cli_common import finish as _finish
from kvtier.cli_common import HELP_MARKUP
from kvtier.cli_common import json_target as _json_target

bench_app = typer.Typer(
    help="Benchmarks that print ratios measured side by side in one run. "
    "Exit codes: 0 every target met, 1 a target missed, 2 usage error (bad flag, unreachable target).",
    no_args_is_help=True,
    rich_markup_mode=HELP_MARKUP,
)


@bench_app.command("tiers")
def bench_tiers(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here (- for stdout)."),
    quick: bool = typer.Option(False, help="One prompt size, fewer repetitions, 100,000 indexed chunks (seconds)."),
) -> None:
    """CPU and disk tier bandwidth vs plain copies/file I/O, lookup latency, index memory, hashing speed."""
    from kvtier.bench.tiers import run_tiers

    with _json_target(json_path) as out:
        _finish("bench tiers", lambda: run_tiers(json_path=out, quick=quick, enforce=True))


@bench_app.command("miss-overhead")
def bench_miss_overhead(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here (- for stdout)."),
    quick: bool = typer.Option(False, help="One round of two requests, connector with the CPU tier only."),
    rounds: Optional[int] = typer.Option(None, min=1, help="Rounds (each runs every configuration once)."),
    requests: Optional[int] = typer.Option(None, min=1, help="Timed prompts per engine run."),
) -> None:
    """Throughput through vLLM with and without kvtier on a workload with no reuse (every lookup misses)."""
    from kvtier.bench.miss_overhead import run_miss_overhead

    with _json_target(json_path) as out:
        _finish(
            "bench miss-overhead",
            lambda: run_miss_overhead(json_path=out, quick=quick, rounds=rounds, requests=requests, enforce=True),
        )


@bench_app.command("remote")
def bench_remote(
    url: str = typer.Option(
        ..., "--url",
        help="Store to measure: a Redis URL (redis://127.0.0.1:6379/0) or a Mooncake master (mooncake://127.0.0.1:50051).",
    ),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here (- for stdout)."),
    chunks: int = typer.Option(16, min=1, help="Chunks of 5,898,240 bytes per put/get round."),
    reps: int = typer.Option(5, min=1, help="Timed repetitions of each measurement (interleaved)."),
) -> None:
    """kvtier's remote tier vs the raw client on the same bytes: redis-py SET/GET/EXISTS, or
    Mooncake's zero-copy batch_put_from/batch_get_into (mooncake_put_ratio, mooncake_get_ratio)."""
    from kvtier.bench.remote import run_remote

    with _json_target(json_path) as out:
        _finish("bench remote", lambda: run_remote(url=url, json_path=out, num_chunks=chunks, reps=reps))


@bench_app.command("quality")
def bench_quality(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here (- for stdout)."),
    questions: int = typer.Option(1, min=1, help="Questions per demo document (one prompt each)."),
    max_tokens: int = typer.Option(32, min=1, help="Greedy answer tokens per prompt."),
) -> None:
    """Each remote codec on real SmolLM2 KV through vLLM: ratio, GB/s, and answer agreement with raw KV."""
    from kvtier.bench.quality import run_quality

    with _json_target(json_path) as out:
        _finish("bench quality", lambda: run_quality(json_path=out, questions=questions, max_tokens=max_tokens))


@bench_app.command("server")
def bench_server(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here (- for stdout)."),
    chunks: int = typer.Option(16, min=1, help="Chunks moved per repetition (5.9 MB each)."),
    reps: int = typer.Option(7, min=1, help="Interleaved repetitions per mode."),
    lookups: int = typer.Option(2000, min=10, help="Lookup round trips timed."),
) -> None:
    """Store/load bandwidth through `kvtier server` vs the embedded tiers, and lookup round-trip latency."""
    from kvtier.bench.server import run_bench_server

    with _json_target(json_path) as out:
        _finish("bench server", lambda: run_bench_server(json_path=out, chunks=chunks, reps=reps, lookups=lookups, enforce=True))


@bench_app.command("controller")
def bench_controller(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here (- for stdout)."),
    instances: int = typer.Option(3, min=1, help="Real instances (StorageManager + fleet agent) registered."),
    prompt_tokens: int = typer.Option(32768, min=1, help="Tokens of the looked-up prompt, stored on every instance."),
    lookups: int = typer.Option(2000, min=10, help="Lookups timed (in-process and over HTTP)."),
    event_rate: float = typer.Option(50_000.0, min=1.0, help="Chunk events per second fed to the controller."),
    event_seconds: float = typer.Option(3.0, min=0.1, help="Seconds of paced event ingestion."),
) -> None:
    """Controller lookup latency (32k-token prompt across instances) and KV-event apply latency."""
    from kvtier.bench.controller import run_bench_controller

    with _json_target(json_path) as out:
        _finish("bench controller", lambda: run_bench_controller(
            json_path=out, instances=instances, prompt_tokens=prompt_tokens, lookups=lookups,
            event_rate=event_rate, event_seconds=event_seconds))


@bench_app.command("serve")
def bench_serve(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here (- for stdout); the PNG plot goes next to it."),
    configs: str = typer.Option("vllm,kvtier-cpu,kvtier-cpu-disk,rr-2x,router-2x", help="Configurations, comma-separated, run in this order (also lmcache-mp, with --lmcache-venv)."),
    workload: str = typer.Option("default", "--workload", help="default, or lmbench: LMBenchmark's multi-round QA shape (1,000 shared + 3,000 history tokens per user, 32-token answers)."),
    users: Optional[int] = typer.Option(None, min=1, help="Multi-round QA users (default 10; --quick 6; lmbench 12)."),
    rounds: Optional[int] = typer.Option(None, min=1, help="Questions per user (default 10; --quick 3; lmbench 5)."),
    concurrency: Optional[int] = typer.Option(None, min=1, help="Requests in flight (default 2; --quick 1; lmbench 2)."),
    qps: Optional[float] = typer.Option(None, min=0.001, help="Also pace request starts to this rate."),
    no_reuse_requests: Optional[int] = typer.Option(None, "--no-reuse-requests", min=1, help="Unique prompts of the no-reuse control (default 16; --quick 8; lmbench 8)."),
    url: list[str] = typer.Option([], "--url", help="Target running servers instead: NAME[@fits]=URL[,METRICS_URL...] (repeatable)."),
    vllm_bench: bool = typer.Option(True, "--vllm-bench/--no-vllm-bench", help="Also run vLLM's own benchmark client."),
    fits: Optional[bool] = typer.Option(None, "--fits/--no-fits", help="Run the 'fits' phase (engine KV holds the working set); default on."),
    lmcache_venv: Optional[Path] = typer.Option(None, "--lmcache-venv", help="Virtual environment with LMCache and vLLM, for the lmcache-mp configuration."),
    lmcache_chunk_size: int = typer.Option(128, "--lmcache-chunk-size", min=1, help="LMCache's chunk size in tokens (128: the engine block, kvtier's chunk here)."),
    lmcache_cli: Optional[Path] = typer.Option(None, "--lmcache-cli", help="LMCache's `lmcache` command (package lmcache-cli): also run `lmcache bench engine` against each configuration."),
    lmcache_cli_configs: Optional[str] = typer.Option(None, "--lmcache-cli-configs", help="Configurations LMCache's client runs against (default: all of vllm,kvtier-cpu,kvtier-cpu-disk,lmcache-mp that run)."),
    cpu_cores: Optional[str] = typer.Option(None, "--cpu-cores", help="Engine threads of single-instance configurations (VLLM_CPU_OMP_THREADS_BIND, default 0-1)."),
    quick: bool = typer.Option(False, "--quick", help="Tiny workload (a few minutes on 2 cores)."),
) -> None:
    """Serving benchmark: vLLM alone vs + kvtier vs two instances (round robin, kvtier router) vs LMCache, real streaming clients."""
    from kvtier.bench.serve import parse_target, run_bench_serve

    with _json_target(json_path) as out:
        _finish("bench serve", lambda: run_bench_serve(
            json_path=out, configs=configs, users=users, rounds=rounds, concurrency=concurrency, qps=qps, quick=quick,
            targets=dict(parse_target(u) for u in url) or None, vllm_bench=vllm_bench, enforce=True,
            workload=workload, fits=fits, lmcache_venv=lmcache_venv, lmcache_chunk_size=lmcache_chunk_size,
            lmcache_cli=lmcache_cli, cpu_cores=cpu_cores, lmcache_cli_configs=lmcache_cli_configs,
            no_reuse_requests=no_reuse_requests))


@bench_app.command("soak")
def bench_soak(
    minutes: float = typer.Option(10.0, help="Length of the measured run, minutes (fractions allowed)."),
    clients: int = typer.Option(8, help="Well-behaved client processes (1-64)."),
    rate: float = typer.Option(20.0, help="Requests per second of each well-behaved client."),
    cpu_capacity: str = typer.Option("64MiB", help="The server's CPU pool, e.g. 64MiB."),
    rss_allowance: str = typer.Option("128MiB", help="Server RSS allowed above the pool, e.g. 128MiB."),
    no_tcp: bool = typer.Option(False, "--no-tcp", help="No TCP listener (the wrong-token attack is skipped)."),
    restart_every: float = typer.Option(30.0, help="Seconds between restarts (re-registrations) of each client; 0: none."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write every measured number here ('-': stdout)."),
) -> None:
    """Well-behaved engines and a hostile client against one `kvtier server`: lookup p99, refusals, server RSS."""
    from kvtier.bench.soak import soak_main

    raise typer.Exit(
        soak_main(minutes, clients, rate, cpu_capacity, rss_allowance, not no_tcp, json_path, restart_every)
    )


@bench_app.command("soak-fleet")
def bench_soak_fleet(
    duration: float = typer.Option(600.0, help="Length of the measured run, seconds (10 minutes by default)."),
    clients: int = typer.Option(3, help="Well-behaved client processes (1-32), each using every instance."),
    rate: float = typer.Option(6.0, help="Requests per second of each client."),
    lookup_rate: float = typer.Option(20.0, help="Controller /lookup calls per second."),
    router_rate: float = typer.Option(5.0, help="Requests per second through the router."),
    cpu_capacity: str = typer.Option("48MiB", help="Each instance's CPU pool, e.g. 48MiB."),
    rss_allowance: str = typer.Option("128MiB", help="Controller and router RSS allowed above their warm level."),
    router_model: Optional[str] = typer.Option(
        None, help="Model folder whose tokenizer the router loads (default: the demo's SmolLM2 folder if "
        "prepared; '' for none)."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write every measured number here ('-': stdout)."),
    keep_logs: str = typer.Option("", "--keep-logs", help="Copy every process's log and JSON output to this folder."),
    no_hostile: bool = typer.Option(False, "--no-hostile", help="The same fleet and load without the hostile client "
                                    "(a baseline for the lookup and RSS figures)."),
) -> None:
    """A keyed fleet (3 servers, controller, router, PD proxy) under load while a hostile client runs every
    issue-24 attack: attack successes, drop-offs, audited loads, lookup p99, controller/router RSS."""
    from kvtier.bench.soak_fleet import soak_fleet_main

    raise typer.Exit(soak_fleet_main(duration, clients, rate, lookup_rate, router_rate, cpu_capacity, rss_allowance,
                                     router_model, json_path, keep_logs, not no_hostile))


@bench_app.command("peers")
def bench_peers(
    lmcache_python: Optional[Path] = typer.Option(None, "--lmcache-python", help="Python of LMCache's own venv (default ~/lmc-venv/bin/python); it runs kvtier's LMCache driver."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Interleaved rounds (medians, spread over rounds)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here (- for stdout)."),
    odirect: bool = typer.Option(False, "--odirect", help="Also compare the disk figures with O_DIRECT."),
    redis_url: str = typer.Option("127.0.0.1:6399", "--redis-url", help="HOST:PORT of the Redis both sides use."),
) -> None:
    """kvtier's tiers vs LMCache's backends side by side (CPU, disk, Redis), with physical baselines."""
    from kvtier.bench.peers import run_peers

    with _json_target(json_path) as out:
        _finish("bench peers", lambda: run_peers(lmcache_python=lmcache_python, rounds=rounds, json_path=out,
                                                 odirect=odirect, redis_url=redis_url, enforce=True))


@bench_app.command("transfer")
def bench_transfer(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here (- for stdout)."),
    chunks: int = typer.Option(16, min=1, help="Chunks per transferred batch."),
    chunk_mb: float = typer.Option(5.89824, help="Bytes per chunk / 10^6 (default: one 256-token SmolLM2 chunk)."),
    rounds: int = typer.Option(7, min=1, help="Interleaved timed rounds per channel and baseline."),
) -> None:
    """Transfer channels vs their physical baselines: shared memory vs memcpy, TCP vs a raw loopback socket."""
    from kvtier.bench.transfer import run_bench_transfer

    with _json_target(json_path) as out:
        _finish("bench transfer", lambda: run_bench_transfer(json_path=out, chunks=chunks, chunk_mb=chunk_mb,
                                                             rounds=rounds))


@bench_app.command("hf")
def bench_hf(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here (- for stdout)."),
    reps: int = typer.Option(3, min=1, help="Prompts timed cold and with a hit (medians)."),
    prefix_tokens: int = typer.Option(2048, min=256, help="Shared prefix length, tokens."),
) -> None:
    """Hugging Face transformers on real SmolLM2 (CPU): TTFT cold vs a kvtier hit, and answer identity."""
    from kvtier.bench.hf import run_bench_hf

    with _json_target(json_path) as out:
        _finish("bench hf", lambda: run_bench_hf(json_path=out, reps=reps, prefix_tokens=prefix_tokens))


@bench_app.command("fleet")
def bench_fleet(
    trace: Path = typer.Option(..., "--trace", help="Mooncake-format JSONL trace (timestamp, input_length, output_length, hash_ids)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here (- for stdout)."),
    dynamo_python: Optional[Path] = typer.Option(None, "--dynamo-python", help="Python of a Dynamo 1.6 venv: also run "
        "Dynamo's replay on the same cells (without it the Dynamo columns are null)."),
    workers: str = typer.Option("4,8", help="Worker counts, comma-separated."),
    speeds: str = typer.Option("1,4", help="Arrival speed-ups, comma-separated."),
    capacity_tokens: int = typer.Option(3_000_000, min=1, help="Engine KV cache per worker, tokens."),
    block_size: int = typer.Option(512, min=2, help="Tokens per hash id (and per engine block)."),
    engine: str = typer.Option("mocker-like", help="Engine timing preset: mocker-like or vllm-cpu-smollm2."),
    pool_policy: str = typer.Option("lru", help="Eviction policy of the shared pool."),
    max_requests: Optional[int] = typer.Option(None, min=1, help="Replay only the first N requests (kvtier side)."),
    timing_check: Optional[Path] = typer.Option(None, "--timing-check", help="JSON written by `kvtier bench timing-check`: "
        "fills timing_model_ttft_error and the timing_model section."),
) -> None:
    """A production trace through kvtier's policies, router and tiers, Dynamo's KV router side by side."""
    from kvtier.bench.common import BenchUsageError
    from kvtier.bench.fleet import run_bench_fleet
    from kvtier.bench.fleet_timing import read_timing_check

    def run() -> int:
        try:
            ws = [int(x) for x in workers.split(",") if x.strip()]
            sp = [float(x) for x in speeds.split(",") if x.strip()]
        except ValueError:
            raise BenchUsageError("--workers and --speeds take comma-separated numbers") from None
        if not ws or not sp or min(ws) < 1 or min(sp) <= 0:
            raise BenchUsageError("--workers and --speeds need positive values")
        timing = read_timing_check(timing_check) if timing_check is not None else None
        return run_bench_fleet(trace, out, dynamo_python, ws, sp, capacity_tokens, block_size, engine, pool_policy,
                               max_requests, timing=timing)

    with _json_target(json_path) as out:
        _finish("bench fleet", run)


@bench_app.command("timing-calibrate")
def bench_timing_calibrate(
    json_path: Optional[Path] = typer.Option(..., "--json", help="Write the calibration file here."),
    cores: str = typer.Option("0", help="Engine threads of the one instance (VLLM_CPU_OMP_THREADS_BIND); "
                              "one core: what each instance of rr-2x/router-2x gets."),
    engine_blocks: int = typer.Option(59, min=16, help="Engine KV blocks (128 tokens), as the checked run's instances."),
    max_model_len: int = typer.Option(1792, min=1792, help="vLLM's max_model_len (the longest calibration prompt is 1,650 tokens)."),
    reps: int = typer.Option(3, min=1, help="Cold prompts of each length."),
    neighbour: Optional[str] = typer.Option(None, "--neighbour", help="Cores of a second instance kept busy meanwhile "
                                            "(e.g. 1: the other instance of a two-instance run); only the first is measured."),
) -> None:
    """Measure one vLLM + kvtier instance (cold and cached prefills, a CPU-tier hit, decode steps)
    and fit the fleet timing model's engine parameters from it."""
    from kvtier.bench.fleet_timing import run_timing_calibrate

    with _json_target(json_path) as out:
        _finish("bench timing-calibrate", lambda: run_timing_calibrate(out, cores, engine_blocks, max_model_len, reps,
                                                                          neighbour=neighbour))


def _load_arg(text: Optional[str], flag: str) -> Optional[list[float]]:
    from kvtier.bench.common import BenchUsageError

    if text is None:
        return None
    try:
        vals = [float(x) for x in text.replace(",", " ").split()[:3]]
    except ValueError:
        vals = []
    if len(vals) != 3:
        raise BenchUsageError(f"{flag} {text!r}: expected the three load averages of `uptime`, e.g. '2.1 1.4 0.7'")
    return vals


@bench_app.command("timing-check")
def bench_timing_check(
    run_json: Path = typer.Option(..., "--run", help="JSON of a `kvtier bench serve` run with rr-2x or router-2x."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the check here (input of `bench fleet --timing-check`)."),
    calibration: Optional[Path] = typer.Option(None, "--calibration", help="Calibration file of `kvtier bench timing-calibrate` "
                                               "(default: the --engine preset)."),
    engine: str = typer.Option("vllm-cpu-smollm2", help="Engine preset when no --calibration is given."),
    config: Optional[str] = typer.Option(None, "--config", help="rr-2x or router-2x (default: the one in the run)."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Also write the run's requests as a Mooncake trace here."),
    load_before: Optional[str] = typer.Option(None, "--load-before", help="`uptime` load averages before the run."),
    load_after: Optional[str] = typer.Option(None, "--load-after", help="`uptime` load averages after the run."),
    route_by_policy: bool = typer.Option(False, "--route-by-policy", help="Route by the run's policy instead of "
                                         "replaying each request on the instance that served it."),
) -> None:
    """Replay a real two-instance run through the fleet timing model: predicted vs measured mean TTFT."""
    from kvtier.bench.fleet_timing import run_timing_check

    def run() -> int:
        load = {"loadavg_before": _load_arg(load_before, "--load-before"),
                "loadavg_after": _load_arg(load_after, "--load-after")}
        return run_timing_check(run_json, out, calibration, engine, config, trace,
                                load if any(load.values()) else None, not route_by_policy)

    with _json_target(json_path) as out:
        _finish("bench timing-check", run)


@bench_app.command("policies")
def bench_policies(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here (- for stdout)."),
    chunks: int = typer.Option(1_000_000, min=1000, help="Chunks resident."),
    ops: int = typer.Option(200_000, min=1000, help="Timed touches and evictions."),
) -> None:
    """Each eviction policy's insert / touch / evict cost in us per operation (target: a2q <= 2 us at 1M chunks)."""
    from kvtier.bench.policies import run_bench_policies

    with _json_target(json_path) as out:
        _finish("bench policies", lambda: run_bench_policies(chunks, ops, out))
