"""The ``kvtier`` command line (typer). Each command lives in its own module and
is imported lazily, so ``kvtier --help`` does not import vLLM or torch."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, NoReturn, Optional

import typer

from kvtier.cli_bench import bench_app
from kvtier.cli_fleet import ctl_app, keys_app
from kvtier.cli_common import HELP_MARKUP, STDOUT  # noqa: F401
from kvtier.cli_common import finish as _finish
from kvtier.cli_common import json_target as _json_target

app = typer.Typer(
    help="kvtier: tiered KV-cache storage for LLM inference engines.", no_args_is_help=True, rich_markup_mode=HELP_MARKUP
)
app.add_typer(bench_app, name="bench")
app.add_typer(ctl_app, name="ctl")
app.add_typer(keys_app, name="keys")


def _version(value: bool) -> None:
    if value:
        from kvtier.version import __version__

        typer.echo(f"kvtier {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the kvtier version and exit."
    ),
) -> None:
    """kvtier: tiered KV-cache storage for LLM inference engines."""


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
    chunk_size: Optional[int] = typer.Option(None, help="Tokens per chunk (default 256; a trace file: its block size)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every measured number here (- for stdout)."),
    trace_file: Optional[Path] = typer.Option(None, "--trace-file", help="Replay a Mooncake-format JSONL trace instead "
        "(timestamp, input_length, output_length, hash_ids), with Belady's MIN and the unbounded cache."),
    block_size: int = typer.Option(512, help="--trace-file: tokens per hash id."),
    capacity_tokens: Optional[str] = typer.Option(None, help="--trace-file: comma-separated capacities in tokens "
        "(default 100k,1M,3M,10M)."),
    mode: str = typer.Option("every-block", help="--trace-file: every-block (every block referenced and cached, "
        "the Mooncake figures) or engine (full chunks only, the last token always computed)."),
    belady: bool = typer.Option(True, "--belady/--no-belady", help="--trace-file: also Belady's MIN (12 bytes a reference)."),
    max_requests: Optional[int] = typer.Option(None, min=1, help="--trace-file: replay only the first N requests."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="--trace-file: write a PNG plot here (needs the bench extra)."),
) -> None:
    """Hit rate of each eviction policy at several tier capacities: a seeded synthetic trace, or a production
    trace file (--trace-file)."""
    from kvtier.sim.run import run_simulate, run_trace_file

    if trace_file is not None and capacities is not None:
        raise typer.BadParameter("applies to the synthetic traces; with --trace-file give --capacity-tokens",
                                 param_hint="--capacities")
    with _json_target(json_path) as out:
        if trace_file is not None:
            _finish("simulate", lambda: run_trace_file(
                trace_file, capacity_tokens, policies, block_size, chunk_size, mode, belady, max_requests, out, plot))
        _finish(
            "simulate",
            lambda: run_simulate(
                trace=trace,
                capacities=capacities,
                policies=policies,
                seed=seed,
                num_requests=requests,
                chunk_size=chunk_size or 256,
                json_path=out,
            ),
        )


@app.command("demo-mooncake")
def demo_mooncake(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the runs, hit tokens and answer checks here (- for stdout)."),
    documents: int = typer.Option(4, "--documents", min=1, max=4, help="How many of the 4 documents the engines ask about (fewer: a shorter run)."),
) -> None:
    """Two `kvtier server`s over one Mooncake Store pool: a prefix stored through one is a hit through the other."""
    import os

    from kvtier.demo.mooncake_pool import main as mooncake_pool
    from kvtier.integrations.vllm_engine import engine_env

    os.environ.update(engine_env(os.environ))

    with _json_target(json_path) as out:
        _finish("demo-mooncake", lambda: mooncake_pool(["--documents", str(documents)] + (["--json", str(out)] if out else [])))


@app.command("demo-server")
def demo_server(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the runs, hit tokens and answer checks here (- for stdout)."),
    documents: int = typer.Option(4, "--documents", min=1, max=4, help="How many of the 4 documents the engines ask about (fewer: a shorter run)."),
) -> None:
    """Two vLLM engine processes sharing one `kvtier server`: cross-engine and cross-restart hits."""
    import os

    from kvtier.demo.two_engines import main as two_engines
    from kvtier.integrations.vllm_engine import engine_env

    os.environ.update(engine_env(os.environ))

    with _json_target(json_path) as out:
        _finish("demo-server", lambda: two_engines(["--documents", str(documents)] + (["--json", str(out)] if out else [])))


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
    max_clients: int = typer.Option(256, min=1, help="Registered client connections at once; a register beyond them is refused (busy)."),
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
    handshake_timeout_s: float = typer.Option(5.0, min=0.001, help="Seconds a new connection has to register (the whole handshake)."),
    idle_timeout_s: float = typer.Option(
        600.0, min=0.0, help="Seconds a registered connection may stay silent before it is closed (0: never)."
    ),
    frame_timeout_s: float = typer.Option(10.0, min=0.001, help="Seconds to receive a whole started request (not per read) and to send its reply."),
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
    controller_token: Optional[str] = typer.Option(
        None, help="Token the controller requires (setting controller_token; $KVTIER_CONTROLLER_TOKEN keeps it out of ps)."
    ),
    kv_events_endpoint: Optional[str] = typer.Option(
        None, help="Publish KV events (vLLM's schema) on this ZMQ PUB address, e.g. tcp://*:5557."
    ),
    kv_events_replay_endpoint: Optional[str] = typer.Option(
        None, help="ZMQ ROUTER address answering replay requests for missed KV event batches."
    ),
    peer_listen: Optional[str] = typer.Option(
        None, help="Serve every hosted namespace's chunks to peers here: tcp://HOST:PORT, shm:///PATH (setting peer_listen)."
    ),
    peer: list[str] = typer.Option(
        [], "--peer", metavar="URL", help="A peer instance to pull missed chunks from (repeat for several; setting peers)."
    ),
    peer_discovery: Optional[str] = typer.Option(
        None, help="Fleet controller's HTTP URL to ask which peer holds a missed prefix (setting peer_discovery)."
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
                "controller_token": controller_token,
                "kv_events_endpoint": kv_events_endpoint,
                "kv_events_replay_endpoint": kv_events_replay_endpoint,
                "peer_listen": peer_listen,
                "peers": list(peer) or None,
                "peer_discovery": peer_discovery,
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


@app.command()
def controller(
    host: str = typer.Option("127.0.0.1", "--host", help="HTTP API address (beyond loopback needs --token)."),
    port: int = typer.Option(7601, "--port", help="HTTP API port (0: any free port)."),
    zmq: str = typer.Option("tcp://127.0.0.1:7600", "--zmq", help="Where instance agents connect, e.g. tcp://0.0.0.0:7600."),
    token: Optional[str] = typer.Option(
        None, "--token", help="Bearer token for HTTP and agents (default $KVTIER_CONTROLLER_TOKEN); "
        "required when an address is beyond loopback."),
    op_deadline: float = typer.Option(10.0, "--op-deadline", min=0.01, help="Seconds an operation may take before it fails."),
    key: Optional[Path] = typer.Option(
        None, "--key", help="The controller's fleet key file (created 0600 if missing); with --members the agent "
        "endpoint is CURVE-authenticated. Required beyond loopback."),
    members: Optional[Path] = typer.Option(
        None, "--members", help="Authorized-members file or directory: the instances' public keys that may register."),
) -> None:
    """Run the fleet controller: one HTTP API over every registered kvtier instance's cache."""
    from kvtier.controller.server import Controller, ControllerConfigError
    from kvtier.protocol.trust import Credentials, TrustError

    try:
        if (key is None) != (members is None):
            raise ControllerConfigError("--key and --members go together (the controller's key, and who may register)")
        creds = Credentials.from_paths(key, members) if key is not None and members is not None else None
        ctl = Controller(http_host=host, http_port=port, zmq_endpoint=zmq, token=token, op_deadline_s=op_deadline,
                         credentials=creds)
        typer.echo(f"kvtier controller: HTTP on {host}:{port}, agents on {zmq}"
                   + (f" (CURVE; controller key {creds.key.public}, {len(creds.members)} members)" if creds
                      else " (open: loopback agents, no member keys)"), err=True)
        ctl.serve_forever()
    except (ControllerConfigError, TrustError, OSError) as exc:
        typer.echo(f"kvtier controller: {exc}", err=True)
        raise typer.Exit(2) from None
    except ModuleNotFoundError as exc:
        typer.echo(f"kvtier controller: needs the Python module {exc.name!r}: pip install 'kvtier[controller]'", err=True)
        raise typer.Exit(2) from None


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
    controller_token: Optional[str] = typer.Option(
        None, "--controller-token", help="Its bearer token (visible in ps: prefer the file or $KVTIER_CONTROLLER_TOKEN)."),
    controller_token_file: Optional[Path] = typer.Option(
        None, "--controller-token-file", help="File whose first line is the controller's bearer token."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8100, "--port", help="Port of the OpenAI-compatible API (0: any free port)."),
    load_weight: float = typer.Option(0.5, "--load-weight", min=0.0, help="Score penalty per token of load."),
    max_body_bytes: int = typer.Option(16 << 20, "--max-body-bytes", min=1, help="Largest request body (larger: 413)."),
    max_prompt_tokens: Optional[int] = typer.Option(
        None, "--max-prompt-tokens", min=1, help="Longest prompt in tokens (longer: 400); default: the backends' "
        "max_model_len from /v1/models."),
    fleet_key: Optional[Path] = typer.Option(
        None, "--fleet-key", help="The router's fleet key file (created 0600 if missing): it reads keyed KV event "
        "streams with it."),
    fleet_members: Optional[Path] = typer.Option(
        None, "--fleet-members", help="Members file naming the publishers' keys: a backend whose INSTANCE_ID is a "
        "member there has its events read over CURVE."),
) -> None:
    """OpenAI-compatible KV-aware proxy in front of N vLLM servers (routes each prompt to the best cached prefix net of load)."""
    from kvtier.malloc_arenas import limit_arenas

    limit_arenas()  # before any thread: worker threads tokenizing large bodies keep their arenas' high-water
    from kvtier.router.server import RouterServer
    from kvtier.router.config import (
        RouterConfig,
        RouterConfigError,
        Weights,
        controller_token_from,
        parse_backend,
    )
    from kvtier.router.tokenize import TokenizeError

    try:
        token = controller_token_from(controller_token, controller_token_file)
        cfg = RouterConfig(backends=tuple(parse_backend(b) for b in backend), policy=policy, model=model,
                           controller_url=controller_url, controller_token=token,
                           weights=Weights(load=load_weight), max_body_bytes=max_body_bytes,
                           max_prompt_tokens=max_prompt_tokens,
                           fleet_key=None if fleet_key is None else str(fleet_key),
                           fleet_members=None if fleet_members is None else str(fleet_members)).validate()
        server = RouterServer(cfg, host=host, port=port)
    except (RouterConfigError, TokenizeError, OSError) as exc:
        typer.echo(f"kvtier router: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"kvtier router: {server.url} -> {', '.join(b.url for b in cfg.backends)} (policy {policy})", err=True)
    server.serve_forever()


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


@app.command("pd-proxy")
def pd_proxy(
    prefill: list[str] = typer.Option(..., "--prefill", help="A prefill instance's URL (repeatable; round robin)."),
    decode: list[str] = typer.Option(..., "--decode", help="A decode instance's URL (repeatable; round robin)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8200, help="Port to listen on."),
    max_body_bytes: int = typer.Option(16 << 20, "--max-body-bytes", min=1, help="Largest request body (larger: 413)."),
) -> None:
    """PD disaggregation proxy: each request is prefilled (max_tokens=1) on a prefiller, then decoded
    on a decoder with the prefiller's kv_transfer_params. Exit code 2: bad arguments or port in use."""
    from kvtier.router.pd_proxy import PDProxyServer

    try:
        server = PDProxyServer(prefill, decode, host=host, port=port, max_body_bytes=max_body_bytes)
    except (ValueError, OSError) as exc:
        typer.echo(f"kvtier pd-proxy: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"kvtier pd-proxy: {server.url} prefill {', '.join(prefill)} -> decode {', '.join(decode)}", err=True)
    server.serve_forever()


@app.command("demo-pd")
def demo_pd(
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the per-request rows and summary here (- for stdout)."),
    p2p_channel: str = typer.Option("shm", help="P2P transfer channel: shm (same machine) or tcp (loopback)."),
) -> None:
    """Transfer mode on two vLLM instances: PD disaggregation and P2P pulls, TTFT vs local hits."""
    from kvtier.demo.pd_demo import run_pd_demo

    if p2p_channel not in ("shm", "tcp"):
        typer.echo("kvtier demo-pd: --p2p-channel must be shm or tcp", err=True)
        raise typer.Exit(2)
    with _json_target(json_path) as out:
        _finish("demo-pd", lambda: run_pd_demo(json_path=out, p2p_channel=p2p_channel))


def main() -> None:
    """Entry point. A module a command needs but its extra did not install is one line on
    stderr naming the extra, exit 2 (also when the import happens outside ``_finish``)."""
    from kvtier.cli_common import missing_module_message

    try:
        app()
    except ModuleNotFoundError as exc:
        typer.echo(missing_module_message(" ".join(a for a in sys.argv[1:3] if not a.startswith("-")) or "", exc), err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
