"""The ``kvtier`` command line (typer). Each command lives in its own module and
is imported lazily, so ``kvtier --help`` does not import vLLM or torch."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator, NoReturn, Optional

import typer

app = typer.Typer(help="kvtier: tiered KV-cache storage for LLM inference engines.", no_args_is_help=True)
bench_app = typer.Typer(
    help="Benchmarks that print ratios measured side by side in one run. "
    "Exit codes: 0 every target met, 1 a target missed, 2 usage error (bad flag, unreachable target).",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")

#: ``--json -`` writes the JSON to stdout (the tables then go to stderr).
STDOUT = "-"


def _version(value: bool) -> None:
    if value:
        from kvtier import __version__

        typer.echo(f"kvtier {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the kvtier version and exit."
    ),
) -> None:
    """kvtier: tiered KV-cache storage for LLM inference engines."""


@contextlib.contextmanager
def _json_target(json_path: Optional[Path]) -> Iterator[Optional[Path]]:
    """The path a command writes its JSON to; for ``-`` a temporary file copied to stdout at the end,
    with everything the command prints meanwhile sent to stderr (so stdout is pure JSON)."""
    if json_path is None or str(json_path) != STDOUT:
        yield json_path
        return
    with tempfile.TemporaryDirectory(prefix="kvtier-json-") as tmp:
        path = Path(tmp) / "out.json"
        try:
            with contextlib.redirect_stdout(sys.stderr):
                yield path
        finally:  # also when the command ends by typer.Exit
            if path.exists():
                with path.open() as f:
                    shutil.copyfileobj(f, sys.stdout)
                sys.stdout.flush()


def _finish(command: str, run: Callable[[], int]) -> NoReturn:
    """Run a command and exit with its code; a usage error (bad flag or setting, unreachable
    target, missing extra) is one line on stderr and exit code 2, never a traceback."""
    from kvtier.bench.common import BenchUsageError
    from kvtier.config import ConfigError

    try:
        code = run()
    except (BenchUsageError, ConfigError) as exc:
        typer.echo(f"kvtier {command}: {exc}", err=True)
        raise typer.Exit(2) from None
    except ModuleNotFoundError as exc:
        typer.echo(
            f"kvtier {command}: needs the Python module {exc.name!r}, not installed "
            "(see README, Install: pip install 'kvtier[...]' with the extra this command needs)",
            err=True,
        )
        raise typer.Exit(2) from None
    raise typer.Exit(code)


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
    url: str = typer.Option(..., "--url", help="Redis URL of the store to measure, e.g. redis://127.0.0.1:6379/0."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here (- for stdout)."),
    chunks: int = typer.Option(16, min=1, help="Chunks of 5,898,240 bytes per put/get round."),
    reps: int = typer.Option(5, min=1, help="Timed repetitions of each measurement (interleaved)."),
) -> None:
    """kvtier's remote tier vs raw redis-py SET/GET/pipelined EXISTS of the same bytes, and round trips."""
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


@app.command()
def demo(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the per-request numbers and summary here (- for stdout)."),
    cache_dir: Optional[Path] = typer.Option(
        None, help="Where the converted model and the demo's disk tier live (default ~/.cache/kvtier)."
    ),
    quick: bool = typer.Option(False, help="Fewer documents and questions (for smoke tests)."),
) -> None:
    """Long-document QA on SmolLM2-135M through vLLM: kvtier off, on, and after a restart."""
    from kvtier.demo.run import run_demo

    with _json_target(json_path) as out:
        _finish("demo", lambda: run_demo(json_path=out, cache_dir=cache_dir, quick=quick))


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
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here (- for stdout)."),
) -> None:
    """Token hit rate of each eviction policy at several tier capacities, on a seeded synthetic trace."""
    from kvtier.sim.run import run_simulate

    with _json_target(json_path) as out:
        _finish(
            "simulate",
            lambda: run_simulate(
                trace=trace,
                capacities=capacities,
                policies=policies,
                seed=seed,
                num_requests=requests,
                chunk_size=chunk_size,
                json_path=out,
            ),
        )


@app.command("demo-server")
def demo_server(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the runs, hit tokens and answer checks here (- for stdout)."),
) -> None:
    """Two vLLM engine processes sharing one ``kvtier server``: cross-engine and cross-restart hits."""
    import os

    from kvtier.integrations.vllm_engine import engine_env
    from kvtier.demo.two_engines import main as two_engines

    os.environ.update(engine_env(os.environ))

    with _json_target(json_path) as out:
        _finish("demo-server", lambda: two_engines(["--json", str(out)] if out else []))


@app.command()
def server(
    socket: Optional[str] = typer.Option(
        None, help="Unix socket path (default $XDG_RUNTIME_DIR/kvtier.sock or /tmp/kvtier-<uid>/kvtier.sock); created 0600."
    ),
    cpu_capacity: Optional[str] = typer.Option(None, help="Bytes of shared-memory CPU pool, e.g. 4GiB (split across namespaces)."),
    disk_path: Optional[Path] = typer.Option(None, help="Disk tier directory (the server is its single owner)."),
    disk_capacity: Optional[str] = typer.Option(None, help="Byte bound of the disk tier, e.g. 64GiB."),
    config_file: Optional[Path] = typer.Option(None, "--config", help="kvtier config file (TOML/JSON, or an LMCache YAML) for the tier settings."),
    tcp_host: Optional[str] = typer.Option(None, help="Also listen on TCP at this address (opt-in; needs --token-file or server_token; "
        "a non-loopback address also needs --allow-remote)."),
    tcp_port: int = typer.Option(0, help="TCP port (0: any free port)."),
    token_file: Optional[Path] = typer.Option(None, help="File holding the token TCP clients must present."),
    metrics_host: str = typer.Option("127.0.0.1", help="Address of the Prometheus /metrics and /health endpoint."),
    metrics_port: int = typer.Option(9477, help="Port of the metrics endpoint (0: any free port)."),
    no_metrics: bool = typer.Option(False, "--no-metrics", help="Do not serve metrics over HTTP."),
    max_clients: int = typer.Option(256, min=1, help="Concurrent client connections."),
    max_namespaces: int = typer.Option(8, min=1, help="Key namespaces (model/layout/rank) hosted at once; they share --cpu-capacity dynamically."),
    allow_remote: bool = typer.Option(
        False, "--allow-remote", help="Allow a --tcp-host that is not loopback (other machines can connect)."
    ),
    log_level: Optional[str] = typer.Option(None, help="Log level: DEBUG, INFO, WARNING, ERROR (setting log_level)."),
    allow_model: list[str] = typer.Option(
        [], "--allow-model", help="Model id pattern (shell-style) that may register; repeat; default: any."
    ),
    max_namespaces_per_client: int = typer.Option(4, min=1, help="Namespaces one client id may bring in."),
    namespace_idle_s: float = typer.Option(300.0, min=0.001, help="Seconds an unused namespace is kept before release."),
    client_hold_share: float = typer.Option(
        0.5, min=0.001, max=1.0, help="Fraction of the pool one client id may hold reserved or being read."
    ),
    client_lease_share: float = typer.Option(0.5, min=0.001, max=1.0, help="Fraction of the pool one client id may pin by leases."),
    reservation_timeout_s: float = typer.Option(30.0, min=0.001, help="Seconds before an uncommitted reservation is aborted."),
    verify_loads: bool = typer.Option(
        True, "--verify-loads/--no-verify-loads", help="Check each CPU chunk's commit checksum before serving it."
    ),
    handshake_timeout_s: float = typer.Option(5.0, min=0.001, help="Seconds a new connection has to register."),
    idle_timeout_s: float = typer.Option(
        600.0, min=0.0, help="Seconds a registered connection may stay silent before it is closed (0: never)."
    ),
    frame_timeout_s: float = typer.Option(10.0, min=0.001, help="Seconds to receive a started request and send its reply."),
    max_unauthenticated: int = typer.Option(
        16, min=1, help="Connections waiting to register at once; beyond, the oldest is closed."
    ),
    auth_backoff_max_s: float = typer.Option(30.0, min=0.5, help="Longest wait imposed on an address after failed TCP tokens."),
    http_max_connections: int = typer.Option(32, min=1, help="Open connections to the metrics endpoint."),
    controller: Optional[str] = typer.Option(
        None, help="Fleet controller to register with, e.g. tcp://10.0.0.5:7600 (setting controller)."
    ),
    instance_id: Optional[str] = typer.Option(
        None, help="Instance id at the controller (default host:port-or-server:pid; setting instance_id)."
    ),
    kv_events_endpoint: Optional[str] = typer.Option(
        None, help="Publish KV events (vLLM's schema) on this ZMQ PUB address, e.g. tcp://*:5557."
    ),
    kv_events_replay_endpoint: Optional[str] = typer.Option(
        None, help="ZMQ ROUTER address answering replay requests for missed KV event batches."
    ),
) -> None:
    """Run the cache service that every engine process on this machine shares."""
    from kvtier.service.main import run_server

    raise typer.Exit(
        run_server(
            socket,
            {
                "cpu_capacity": cpu_capacity,
                "disk_path": disk_path,
                "disk_capacity": disk_capacity,
                "config_file": config_file,
                "log_level": log_level,
                "controller": controller,
                "instance_id": instance_id,
                "kv_events_endpoint": kv_events_endpoint,
                "kv_events_replay_endpoint": kv_events_replay_endpoint,
            },
            tcp_host=tcp_host,
            tcp_port=tcp_port,
            token_file=token_file,
            metrics_host=metrics_host,
            metrics_port=None if no_metrics else metrics_port,
            max_clients=max_clients,
            max_namespaces=max_namespaces,
            allow_remote=allow_remote,
            extra_options=dict(
                allowed_models=tuple(allow_model),
                max_namespaces_per_client=max_namespaces_per_client,
                namespace_idle_s=namespace_idle_s,
                client_hold_share=client_hold_share,
                client_lease_share=client_lease_share,
                reservation_timeout_s=reservation_timeout_s,
                verify_loads=verify_loads,
                handshake_timeout_s=handshake_timeout_s,
                idle_timeout_s=idle_timeout_s or None,
                frame_timeout_s=frame_timeout_s,
                max_unauthenticated=max_unauthenticated,
                auth_backoff_max_s=auth_backoff_max_s,
                http_max_connections=http_max_connections,
            ),
        )
    )


@bench_app.command("server")
def bench_server(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here (- for stdout)."),
    chunks: int = typer.Option(16, min=1, help="Chunks moved per repetition (5.9 MB each)."),
    reps: int = typer.Option(7, min=1, help="Interleaved repetitions per mode."),
    lookups: int = typer.Option(2000, min=10, help="Lookup round trips timed."),
) -> None:
    """Store/load bandwidth through ``kvtier server`` vs the embedded tiers, and lookup round-trip latency."""
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
    configs: str = typer.Option("vllm,kvtier-cpu,kvtier-cpu-disk,rr-2x,router-2x", help="Configurations, comma-separated."),
    users: Optional[int] = typer.Option(None, min=1, help="Multi-round QA users (default 10; --quick 6)."),
    rounds: Optional[int] = typer.Option(None, min=1, help="Questions per user (default 10; --quick 3)."),
    concurrency: Optional[int] = typer.Option(None, min=1, help="Requests in flight (default 2; --quick 1)."),
    qps: Optional[float] = typer.Option(None, min=0.001, help="Also pace request starts to this rate."),
    url: list[str] = typer.Option([], "--url", help="Target running servers instead: NAME[@fits]=URL[,METRICS_URL...] (repeatable)."),
    vllm_bench: bool = typer.Option(True, "--vllm-bench/--no-vllm-bench", help="Also run vLLM's own benchmark client."),
    quick: bool = typer.Option(False, "--quick", help="Tiny workload (a few minutes on 2 cores)."),
) -> None:
    """Serving benchmark: vLLM alone vs + kvtier vs two instances (round robin, kvtier router), real streaming clients."""
    from kvtier.bench.serve import parse_target, run_bench_serve

    with _json_target(json_path) as out:
        _finish("bench serve", lambda: run_bench_serve(
            json_path=out, configs=configs, users=users, rounds=rounds, concurrency=concurrency, qps=qps, quick=quick,
            targets=dict(parse_target(u) for u in url) or None, vllm_bench=vllm_bench, enforce=True))


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
    """Well-behaved engines and a hostile client against one ``kvtier server``: lookup p99, refusals, server RSS."""
    from kvtier.bench.soak import soak_main

    raise typer.Exit(
        soak_main(minutes, clients, rate, cpu_capacity, rss_allowance, not no_tcp, json_path, restart_every)
    )


ctl_app = typer.Typer(
    help="Talk to a running `kvtier controller` over HTTP. Exit codes: 0 done, 1 the operation failed, "
    "2 usage error or controller unreachable/refusing.",
    no_args_is_help=True,
)
app.add_typer(ctl_app, name="ctl")

_CTL_URL = typer.Option("http://127.0.0.1:7601", "--url", help="Controller HTTP URL.")
_CTL_TOKEN = typer.Option(None, "--token", help="Bearer token (default $KVTIER_CONTROLLER_TOKEN).")
_CTL_JSON = typer.Option(False, "--json", help="Print the JSON answer instead of a table.")
_CTL_TOKENS = typer.Option(None, "--tokens", help="Token ids, comma separated: 1,2,3.")
_CTL_TOKENS_FILE = typer.Option(None, "--tokens-file", help="File of token ids (JSON list or comma/space separated).")
_CTL_INSTANCE = typer.Option(None, "--instance", help="Only this instance (default: every instance).")
_CTL_TIER = typer.Option(None, "--tier", help="Only this tier: cpu, disk, remote.")
_CTL_SALT = typer.Option(None, "--cache-salt", help="Tenant cache salt the keys were made with.")
_CTL_WAIT = typer.Option(True, "--wait/--no-wait", help="Wait for the operation's terminal state.")


@app.command()
def controller(
    host: str = typer.Option("127.0.0.1", "--host", help="HTTP API address (beyond loopback needs --token)."),
    port: int = typer.Option(7601, "--port", help="HTTP API port (0: any free port)."),
    zmq: str = typer.Option("tcp://127.0.0.1:7600", "--zmq", help="Where instance agents connect, e.g. tcp://0.0.0.0:7600."),
    token: Optional[str] = typer.Option(
        None, "--token", help="Bearer token for HTTP and agents (default $KVTIER_CONTROLLER_TOKEN); "
        "required when an address is beyond loopback."),
    op_deadline: float = typer.Option(10.0, "--op-deadline", min=0.01, help="Seconds an operation may take before it fails."),
) -> None:
    """Run the fleet controller: one HTTP API over every registered kvtier instance's cache."""
    from kvtier.controller.server import Controller, ControllerConfigError

    try:
        ctl = Controller(http_host=host, http_port=port, zmq_endpoint=zmq, token=token, op_deadline_s=op_deadline)
        typer.echo(f"kvtier controller: HTTP on {host}:{port}, agents on {zmq}", err=True)
        ctl.serve_forever()
    except (ControllerConfigError, OSError) as exc:
        typer.echo(f"kvtier controller: {exc}", err=True)
        raise typer.Exit(2) from None
    except ModuleNotFoundError as exc:
        typer.echo(f"kvtier controller: needs the Python module {exc.name!r}: pip install 'kvtier[controller]'", err=True)
        raise typer.Exit(2) from None


def _ctl(kind: str, url: str, token: Optional[str], as_json: bool, call: Callable[..., dict]) -> NoReturn:
    from kvtier.controller.client import ControllerClient
    from kvtier.controller.ctl import run

    with ControllerClient(url, token) as client:
        raise typer.Exit(run(kind, lambda: call(client), as_json))


def _ctl_tokens(tokens: Optional[str], tokens_file: Optional[Path]) -> list[int]:
    from kvtier.controller.ctl import CtlUsageError, parse_tokens

    try:
        return parse_tokens(tokens, tokens_file)
    except CtlUsageError as exc:
        typer.echo(f"kvtier ctl: {exc}", err=True)
        raise typer.Exit(2) from None


@ctl_app.command("lookup")
def ctl_lookup(
    tokens: Optional[str] = _CTL_TOKENS, tokens_file: Optional[Path] = _CTL_TOKENS_FILE,
    keys: Optional[str] = typer.Option(None, "--keys", help="Chunk keys (hex, comma separated) instead of tokens."),
    cache_salt: Optional[str] = _CTL_SALT, instance: Optional[str] = _CTL_INSTANCE,
    url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON,
) -> None:
    """Longest cached prefix of a prompt per instance and tier."""
    ids = None if keys is not None else _ctl_tokens(tokens, tokens_file)
    key_list = [k for k in keys.split(",") if k] if keys is not None else None
    _ctl("lookup", url, token, as_json, lambda c: c.lookup(ids, key_list, cache_salt, instance))


@ctl_app.command("clear")
def ctl_clear(
    instance: Optional[str] = _CTL_INSTANCE, tier: Optional[str] = _CTL_TIER,
    cache_salt: Optional[str] = _CTL_SALT, wait: bool = _CTL_WAIT,
    url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON,
) -> None:
    """Clear the cache of the fleet, one instance, one tier or one tenant salt."""
    _ctl("clear", url, token, as_json, lambda c: c.clear(instance, tier, cache_salt, wait))


@ctl_app.command("pin")
def ctl_pin(
    tokens: Optional[str] = _CTL_TOKENS, tokens_file: Optional[Path] = _CTL_TOKENS_FILE,
    instance: Optional[str] = _CTL_INSTANCE,
    ttl: Optional[float] = typer.Option(None, "--ttl", min=0.001, help="Seconds the pin lasts (default: until unpinned)."),
    cache_salt: Optional[str] = _CTL_SALT, wait: bool = _CTL_WAIT,
    url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON,
) -> None:
    """Pin the cached prefix of a prompt (it survives eviction)."""
    ids = _ctl_tokens(tokens, tokens_file)
    _ctl("pin", url, token, as_json, lambda c: c.pin(ids, instance, ttl, cache_salt, wait))


@ctl_app.command("unpin")
def ctl_unpin(
    tokens: Optional[str] = _CTL_TOKENS, tokens_file: Optional[Path] = _CTL_TOKENS_FILE,
    instance: Optional[str] = _CTL_INSTANCE, pin_id: Optional[str] = typer.Option(None, "--pin-id"),
    cache_salt: Optional[str] = _CTL_SALT, wait: bool = _CTL_WAIT,
    url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON,
) -> None:
    """Release pins: the one named --pin-id, or every pin covering the prompt's chunks (evictable again)."""
    ids = None if (tokens is None and tokens_file is None and pin_id) else _ctl_tokens(tokens, tokens_file)
    _ctl("unpin", url, token, as_json, lambda c: c.unpin(ids, instance, pin_id, cache_salt, wait))


@ctl_app.command("move")
def ctl_move(
    from_instance: str = typer.Option(..., "--from", help="Source instance."),
    to_tier: str = typer.Option(..., "--to-tier", help="Target tier: cpu, disk, remote."),
    to_instance: Optional[str] = typer.Option(None, "--to", help="Target instance (default: the source)."),
    from_tier: Optional[str] = typer.Option(None, "--from-tier", help="Source tier (default: the one holding most)."),
    copy: bool = typer.Option(False, "--copy", help="Keep the source copy."),
    tokens: Optional[str] = _CTL_TOKENS, tokens_file: Optional[Path] = _CTL_TOKENS_FILE,
    cache_salt: Optional[str] = _CTL_SALT, wait: bool = _CTL_WAIT,
    url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON,
) -> None:
    """Move (or copy) a prompt's cached prefix between tiers or instances, verified on the target."""
    ids = _ctl_tokens(tokens, tokens_file)
    _ctl("move", url, token, as_json,
         lambda c: c.move(ids, from_instance, to_tier, to_instance, from_tier, copy, cache_salt, wait))


@ctl_app.command("compress")
def ctl_compress(
    codec: str = typer.Option(..., "--codec", help="raw, shuffle-zstd, int8, cachegen."),
    tokens: Optional[str] = _CTL_TOKENS, tokens_file: Optional[Path] = _CTL_TOKENS_FILE,
    instance: Optional[str] = _CTL_INSTANCE, tier: Optional[str] = _CTL_TIER,
    cache_salt: Optional[str] = _CTL_SALT, wait: bool = _CTL_WAIT,
    url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON,
) -> None:
    """Re-encode a prompt's stored chunks with a codec, in place."""
    ids = _ctl_tokens(tokens, tokens_file)
    _ctl("compress", url, token, as_json, lambda c: c.compress(ids, codec, instance, tier, cache_salt, wait))


@ctl_app.command("decompress")
def ctl_decompress(
    tokens: Optional[str] = _CTL_TOKENS, tokens_file: Optional[Path] = _CTL_TOKENS_FILE,
    instance: Optional[str] = _CTL_INSTANCE, tier: Optional[str] = _CTL_TIER,
    cache_salt: Optional[str] = _CTL_SALT, wait: bool = _CTL_WAIT,
    url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON,
) -> None:
    """Re-encode a prompt's stored chunks raw, in place."""
    ids = _ctl_tokens(tokens, tokens_file)
    _ctl("decompress", url, token, as_json, lambda c: c.decompress(ids, instance, tier, cache_salt, wait))


@ctl_app.command("health")
def ctl_health(
    instance: Optional[str] = _CTL_INSTANCE,
    live: bool = typer.Option(False, "--live", help="Ask each instance now instead of its last heartbeat."),
    url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON,
) -> None:
    """Per-instance, per-tier health."""
    _ctl("health", url, token, as_json, lambda c: c.health(instance, live))


@ctl_app.command("instances")
def ctl_instances(url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON) -> None:
    """Registered instances, their tiers, namespaces and last heartbeat."""
    _ctl("instances", url, token, as_json, lambda c: c.instances())


@ctl_app.command("check-finish")
def ctl_check_finish(
    event_id: str = typer.Argument(..., help="The event_id an operation returned."),
    url: str = _CTL_URL, token: Optional[str] = _CTL_TOKEN, as_json: bool = _CTL_JSON,
) -> None:
    """State of an asynchronous operation (pending, running, done, failed with a reason)."""
    _ctl("check-finish", url, token, as_json, lambda c: c.check_finish(event_id))


@app.command("config-check")
def config_check(
    config_file: Optional[Path] = typer.Option(
        None, "--config", help="kvtier file (TOML/JSON) or LMCache YAML config; default: the KVTIER_* / LMCACHE_CONFIG_FILE environment."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Load the config and print the effective settings; for an LMCache YAML, what was mapped, refused and ignored."""
    from kvtier.config_report import config_check as run

    _finish("config-check", lambda: run(config_file, as_json))


@app.command()
def router(
    backend: list[str] = typer.Option(..., "--backend", help="URL[=INSTANCE_ID][@EVENTS_ENDPOINT[,REPLAY]] of a vLLM "
                                      "server (repeat): its kvtier instance id at the controller, its KV events."),
    model: Optional[str] = typer.Option(None, "--model", help="Model folder (tokenizer, chat template)."),
    policy: str = typer.Option("kv-aware", "--policy", help="kv-aware, round-robin or least-loaded."),
    controller_url: Optional[str] = typer.Option(None, "--controller", help="Fleet controller URL for /lookup."),
    controller_token: Optional[str] = typer.Option(None, "--controller-token", help="Its bearer token."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8100, "--port", help="Port of the OpenAI-compatible API (0: any free port)."),
    load_weight: float = typer.Option(0.5, "--load-weight", min=0.0, help="Score penalty per token of load."),
) -> None:
    """OpenAI-compatible KV-aware proxy in front of N vLLM servers (routes each prompt to the best cached prefix net of load)."""
    from kvtier.router.app import RouterServer
    from kvtier.router.config import RouterConfig, RouterConfigError, Weights, parse_backend
    from kvtier.router.tokenize import TokenizeError

    try:
        cfg = RouterConfig(backends=tuple(parse_backend(b) for b in backend), policy=policy, model=model,
                           controller_url=controller_url, controller_token=controller_token,
                           weights=Weights(load=load_weight)).validate()
        server = RouterServer(cfg, host=host, port=port)
    except (RouterConfigError, TokenizeError, OSError) as exc:
        typer.echo(f"kvtier router: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"kvtier router: {server.url} -> {', '.join(b.url for b in cfg.backends)} (policy {policy})", err=True)
    server.serve_forever()


@bench_app.command("peers")
def bench_peers(
    lmcache_python: Optional[Path] = typer.Option(None, "--lmcache-python", help="Python of the LMCache venv (default ../lmc-venv/bin/python)."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Interleaved rounds (medians, spread over rounds)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here (- for stdout)."),
    odirect: bool = typer.Option(False, "--odirect", help="Also compare the disk figures with O_DIRECT."),
    redis_url: str = typer.Option("127.0.0.1:6399", "--redis-url", help="HOST:PORT of the Redis both sides use."),
    lmcache_script: Optional[Path] = typer.Option(None, "--lmcache-script", help="LMCache peer script (default ../shared/tools/lmcache-peer/)."),
) -> None:
    """kvtier's tiers vs LMCache's backends side by side (CPU, disk, Redis), with physical baselines."""
    from kvtier.bench.peers import run_peers

    with _json_target(json_path) as out:
        _finish("bench peers", lambda: run_peers(lmcache_python=lmcache_python, rounds=rounds, json_path=out,
                                                 odirect=odirect, redis_url=redis_url,
                                                 lmcache_script=lmcache_script, enforce=True))


@app.command("top")
def top(
    url: str = typer.Argument("http://127.0.0.1:9477", help="A kvtier server's metrics URL or a controller's HTTP URL."),
    interval: float = typer.Option(1.0, "--interval", min=0.1, help="Seconds between redraws."),
    count: Optional[int] = typer.Option(None, "--count", min=1, help="Redraw this many times, then exit (default: until Ctrl-C)."),
    token: Optional[str] = typer.Option(None, "--token", envvar="KVTIER_CONTROLLER_TOKEN", help="Bearer token (not needed to read)."),
) -> None:
    """Live terminal view of a server or controller: tiers, hit rate, throughput, hot prefixes, instances.
    Exit codes: 0, or 2 when --count is given and the endpoint never answered."""
    from kvtier.dashboard.top import run_top

    raise typer.Exit(run_top(url, interval, count, token))


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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
