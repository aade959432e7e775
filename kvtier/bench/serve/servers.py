"""Starting and stopping the servers of one configuration of ``kvtier bench serve``: vLLM
OpenAI servers (with or without kvtier) and, for two instances, ``kvtier router``."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvtier.bench.common import BLOCK_SIZE, BenchUsageError
from kvtier.bench.serve.configs import ConfigSpec
from kvtier.bench.serve.lmcache_mp import LMCacheVenv, connector_config, lmcache_server


#: Seconds a vLLM server may take to answer /health (on a loaded 2-core machine a start took 2-4 min).
START_TIMEOUT_S = 600


@dataclass
class Running:
    """Servers of one configuration: where requests go, the instances' URLs, and (``lmcache-mp``)
    the LMCache server's HTTP URL (its ``/metrics``)."""

    url: str
    instances: list[str]
    model: str
    lmcache_http: str | None = None


def _wait_http(url: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}")
        for path in ("/health", "/v1/models"):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + path, timeout=2).status_code == 200:
                    return
        time.sleep(0.5)
    raise RuntimeError(f"{url} not answering after {timeout_s:.0f} s")


def router_command(backend_args: Sequence[str], model_path: str, policy: str, port: int) -> list[str]:
    """``python -m kvtier.cli router ...``: the router in a child process, started by its own command
    (a command line, not an import: the benchmark sits below the CLI that runs it)."""
    return [sys.executable, "-m", "kvtier.cli", "router", *backend_args, "--model", model_path,
            "--policy", policy, "--port", str(port)]


@contextlib.contextmanager
def start_config(
    cfg: ConfigSpec, model_path: str, engine_blocks: int, max_model_len: int, kvtier_cpu_bytes: int,
    workdir: Path, tag: str, lmcache: LMCacheVenv | None = None, cores: str = "0-1",
) -> Iterator[Running]:
    """Start a configuration's servers (and router); stop them all on exit.

    ``kvtier_cpu_bytes``: kvtier's CPU tier capacity (``lmcache-mp``: LMCache's L1 size).
    ``lmcache``: the LMCache venv, required by ``lmcache-mp``. ``cores``: the CPUs of a
    single instance's engine threads (``VLLM_CPU_OMP_THREADS_BIND``); two instances get one core each.

    Raises BenchUsageError when a server or the router does not come up (the message
    names the log file), or ``lmcache-mp`` without ``lmcache``.
    """
    from kvtier.integrations.vllm.serve import ApiServer, ServerSpec
    from kvtier.ports import PortPicker

    servers: list[Any] = []
    router: subprocess.Popen | None = None
    pool: concurrent.futures.ThreadPoolExecutor | None = None
    stack = contextlib.ExitStack()
    lmc_http: str | None = None
    try:
        extra: list[str] = []
        python: str | None = None
        env: dict[str, str] = {}
        if cfg.lmcache:
            if lmcache is None:
                raise BenchUsageError(f"{cfg.name} needs --lmcache-venv PATH (LMCache and vLLM in their own venv)")
            lmc = stack.enter_context(lmcache_server(lmcache, kvtier_cpu_bytes, workdir, tag))
            lmc_http = lmc.http_url
            extra = ["--kv-transfer-config", json.dumps(connector_config(lmc.port))]
            python, env = str(lmcache.python), {"PYTHONPATH": "", "LMCACHE_DISABLE_BANNER": "1"}
        specs = []
        ports = PortPicker()  # the event and router ports: never the same one twice
        for i in range(cfg.instances):
            kv: dict[str, Any] | None = None
            if cfg.kvtier:
                cpu = kvtier_cpu_bytes // 2 if cfg.disk else kvtier_cpu_bytes
                # kvtier's chunk = the engine block, so a kvtier hit ends where an engine hit would
                # (the answer check compares the two at the same split).
                kv = {"cpu_capacity": f"{max(64, cpu >> 20)}MiB", "chunk_size": BLOCK_SIZE}
                if cfg.disk:
                    disk = workdir / f"disk-{tag}-{i}"
                    disk.mkdir(parents=True, exist_ok=True)
                    kv.update(disk_path=str(disk), disk_capacity=f"{max(256, (4 * kvtier_cpu_bytes) >> 20)}MiB")
            inst_cores = cores if cfg.instances == 1 else str(i % 2)
            # vLLM binds its KV-event publisher only for a wildcard endpoint (tcp://*:PORT); with
            # tcp://HOST:PORT it connects, and the router (which connects too) would get nothing.
            port = ports.pick() if cfg.instances > 1 else None
            events = f"tcp://127.0.0.1:{port}" if port else None
            specs.append((ServerSpec(model=model_path, kvtier=kv, cpu_cores=inst_cores, num_gpu_blocks_override=engine_blocks,
                                     max_model_len=max_model_len, extra_args=list(extra), env=dict(env), python=python,
                                     kv_events_endpoint=f"tcp://*:{port}" if port else None), events))
        servers = [ApiServer(s, log_path=str(workdir / f"{tag}-{i}.log")) for i, (s, _) in enumerate(specs)]
        # Started side by side from worker threads kept alive until the servers stop: ApiServer sets
        # PR_SET_PDEATHSIG, which fires when the *thread* that started the child exits.
        pool = concurrent.futures.ThreadPoolExecutor(len(servers))
        futs = [pool.submit(s.start, START_TIMEOUT_S) for s in servers]
        errs = [f.exception() for f in futs]
        if any(errs):
            raise BenchUsageError(f"{tag}: a vLLM server did not start: {str([e for e in errs if e][0])[-1500:]}")
        url = servers[0].url
        if cfg.instances > 1:
            port = ports.pick()
            backends = []
            for i, (srv, (_, ev)) in enumerate(zip(servers, specs)):
                backends += ["--backend", f"{srv.url}=i{i}" + (f"@{ev}" if ev else "")]
            log = open(workdir / f"{tag}-router.log", "ab")
            router = subprocess.Popen(
                router_command(backends, model_path, cfg.policy or "kv-aware", port),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
            log.close()
            url = f"http://127.0.0.1:{port}"
            try:
                _wait_http(url, router, 120)
            except RuntimeError as exc:
                raise BenchUsageError(f"{tag}: kvtier router did not start ({exc}); log {workdir / (tag + '-router.log')}")

        yield Running(url, [s.url for s in servers], servers[0].served_model_name, lmc_http)
    finally:
        if router is not None and router.poll() is None:
            router.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                router.wait(10)
            if router.poll() is None:
                router.kill()
        for s in servers:
            with contextlib.suppress(Exception):
                s.stop()
        if pool is not None:
            pool.shutdown(wait=True)
        stack.close()  # the LMCache server, after the engine that talks to it


def served_model(url: str) -> str:
    """The first model id a running OpenAI-compatible server lists (httpx errors propagate)."""
    r = httpx.get(url + "/v1/models", timeout=10)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])
