"""The ``kvtier`` command line (typer). Each command lives in its own module and
is imported lazily, so ``kvtier --help`` does not import vLLM or torch."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="kvtier: tiered KV-cache storage for LLM inference engines.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks that print ratios measured side by side in one run.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("tiers")
def bench_tiers(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here."),
    quick: bool = typer.Option(False, help="One prompt size, fewer repetitions, 100,000 indexed chunks (seconds)."),
) -> None:
    """CPU and disk tier bandwidth vs plain copies/file I/O, lookup latency, index memory, hashing speed."""
    from kvtier.bench.tiers import run_tiers

    raise typer.Exit(run_tiers(json_path=json_path, quick=quick))


@bench_app.command("miss-overhead")
def bench_miss_overhead(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here."),
    quick: bool = typer.Option(False, help="One round of two requests, connector with the CPU tier only."),
    rounds: Optional[int] = typer.Option(None, min=1, help="Rounds (each runs every configuration once)."),
    requests: Optional[int] = typer.Option(None, min=1, help="Timed prompts per engine run."),
) -> None:
    """Throughput through vLLM with and without kvtier on a workload with no reuse (every lookup misses)."""
    from kvtier.bench.miss_overhead import run_miss_overhead

    raise typer.Exit(run_miss_overhead(json_path=json_path, quick=quick, rounds=rounds, requests=requests))


@bench_app.command("remote")
def bench_remote(
    url: str = typer.Option(..., "--url", help="Redis URL of the store to measure, e.g. redis://127.0.0.1:6379/0."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here."),
    chunks: int = typer.Option(16, min=1, help="Chunks of 5,898,240 bytes per put/get round."),
    reps: int = typer.Option(5, min=1, help="Timed repetitions of each measurement (interleaved)."),
) -> None:
    """kvtier's remote tier vs raw redis-py SET/GET/pipelined EXISTS of the same bytes, and round trips."""
    from kvtier.bench.remote import run_remote

    raise typer.Exit(run_remote(url=url, json_path=json_path, num_chunks=chunks, reps=reps))


@bench_app.command("quality")
def bench_quality(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here."),
    questions: int = typer.Option(1, min=1, help="Questions per demo document (one prompt each)."),
    max_tokens: int = typer.Option(32, min=1, help="Greedy answer tokens per prompt."),
) -> None:
    """Each remote codec on real SmolLM2 KV through vLLM: ratio, GB/s, and answer agreement with raw KV."""
    from kvtier.bench.quality import run_quality

    raise typer.Exit(run_quality(json_path=json_path, questions=questions, max_tokens=max_tokens))


@app.command()
def demo(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the per-request numbers and summary here."),
    cache_dir: Optional[Path] = typer.Option(
        None, help="Where the converted model and the demo's disk tier live (default ~/.cache/kvtier)."
    ),
    quick: bool = typer.Option(False, help="Fewer documents and questions (for smoke tests)."),
) -> None:
    """Long-document QA on SmolLM2-135M through vLLM: kvtier off, on, and after a restart."""
    from kvtier.demo.run import run_demo

    raise typer.Exit(run_demo(json_path=json_path, cache_dir=cache_dir, quick=quick))


@app.command()
def simulate(
    trace: str = typer.Option("mixed", help="Synthetic trace: multi-turn, long-doc, mixed, or all."),
    capacities: Optional[str] = typer.Option(
        None, help="Comma-separated tier capacities in chunks (default: 2,5,10,25,50% of the trace's distinct chunks)."
    ),
    policies: Optional[str] = typer.Option(None, help="Comma-separated eviction policies (default: all)."),
    requests: int = typer.Option(2000, min=1, help="Prompts in the trace."),
    seed: int = typer.Option(0, help="Trace seed (same seed, same trace)."),
    chunk_size: int = typer.Option(256, help="Tokens per chunk."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here."),
) -> None:
    """Token hit rate of each eviction policy at several tier capacities, on a seeded synthetic trace."""
    from kvtier.sim.run import run_simulate

    raise typer.Exit(
        run_simulate(
            trace=trace,
            capacities=capacities,
            policies=policies,
            seed=seed,
            num_requests=requests,
            chunk_size=chunk_size,
            json_path=json_path,
        )
    )


@app.command("demo-server")
def demo_server(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the runs, hit tokens and answer checks here."),
) -> None:
    """Two vLLM engine processes sharing one ``kvtier server``: cross-engine and cross-restart hits."""
    import os

    from kvtier.integrations.vllm_engine import engine_env
    from kvtier.demo.two_engines import main as two_engines

    os.environ.update(engine_env(os.environ))

    raise typer.Exit(two_engines(["--json", str(json_path)] if json_path else []))


@app.command()
def server(
    socket: Optional[str] = typer.Option(
        None, help="Unix socket path (default $XDG_RUNTIME_DIR/kvtier.sock or /tmp/kvtier-<uid>/kvtier.sock); created 0600."
    ),
    cpu_capacity: Optional[str] = typer.Option(None, help="Bytes of shared-memory CPU pool, e.g. 4GiB (split across namespaces)."),
    disk_path: Optional[Path] = typer.Option(None, help="Disk tier directory (the server is its single owner)."),
    disk_capacity: Optional[str] = typer.Option(None, help="Byte bound of the disk tier, e.g. 64GiB."),
    config_file: Optional[Path] = typer.Option(None, "--config", help="kvtier config file (TOML/JSON) for the tier settings."),
    tcp_host: Optional[str] = typer.Option(None, help="Also listen on TCP at this address (opt-in; needs --token-file)."),
    tcp_port: int = typer.Option(0, help="TCP port (0: any free port)."),
    token_file: Optional[Path] = typer.Option(None, help="File holding the token TCP clients must present."),
    metrics_host: str = typer.Option("127.0.0.1", help="Address of the Prometheus /metrics and /health endpoint."),
    metrics_port: int = typer.Option(9477, help="Port of the metrics endpoint (0: any free port)."),
    no_metrics: bool = typer.Option(False, "--no-metrics", help="Do not serve metrics over HTTP."),
    max_clients: int = typer.Option(256, min=1, help="Concurrent client connections."),
    max_namespaces: int = typer.Option(1, min=1, help="Key namespaces (model/layout/rank) hosted at once."),
) -> None:
    """Run the cache service that every engine process on this machine shares."""
    from kvtier.service.main import run_server

    raise typer.Exit(
        run_server(
            socket,
            {"cpu_capacity": cpu_capacity, "disk_path": disk_path, "disk_capacity": disk_capacity, "config_file": config_file},
            tcp_host=tcp_host,
            tcp_port=tcp_port,
            token_file=token_file,
            metrics_host=metrics_host,
            metrics_port=None if no_metrics else metrics_port,
            max_clients=max_clients,
            max_namespaces=max_namespaces,
        )
    )


@bench_app.command("server")
def bench_server(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here."),
    chunks: int = typer.Option(16, min=1, help="Chunks moved per repetition (5.9 MB each)."),
    reps: int = typer.Option(7, min=1, help="Interleaved repetitions per mode."),
    lookups: int = typer.Option(2000, min=10, help="Lookup round trips timed."),
) -> None:
    """Store/load bandwidth through ``kvtier server`` vs the embedded tiers, and lookup round-trip latency."""
    from kvtier.bench.server import run_bench_server

    raise typer.Exit(run_bench_server(json_path=json_path, chunks=chunks, reps=reps, lookups=lookups))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
