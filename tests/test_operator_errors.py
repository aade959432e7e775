"""What an operator sees when something is misused or broken (issue 14, items 10, 12, 13, 15, 16).

Failing inputs: ``kvtier bench remote --url redis://127.0.0.1:1/0`` (and a missing scheme, an
unknown option, ``rediss://`` against a plain Redis) printed ~190 lines of traceback or hung 72 s;
``--tcp-host 0.0.0.0`` was accepted silently and the TCP error named a ``--token`` flag that does
not exist; a dead Redis left one INFO line; a Redis without ``maxmemory`` gave no warning; no
``kvtier --version``; ``--json -`` wrote a file named ``-``; ``simulate`` was silent for 47 s.
Every check here is bounded (loopback, temp dirs, sub-second timeouts).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import free_port
from kvtier import __version__
from kvtier.cli import app
from kvtier.tiers.breaker import CircuitBreaker

runner = CliRunner()


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}


# -- bench: one line, exit code 2, bounded waits (item 13) -------------------------------------------
@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("127.0.0.1:6399", "not a Redis URL"),  # missing scheme
        ("redis://127.0.0.1:1/0", "no Redis answered"),  # nothing listens
        ("redis://127.0.0.1:6399/0?key_prefx=a", "unknown option key_prefx"),  # misspelt option
        ("redis://127.0.0.1:6399/0?ttl_s=soon", "ttl_s='soon'"),
    ],
)
def test_bench_remote_usage_errors_are_one_line_exit_2(url: str, needle: str, monkeypatch) -> None:
    pytest.importorskip("redis")
    from kvtier.bench import remote

    monkeypatch.setattr(remote, "PREFLIGHT_TIMEOUT_S", 0.5)
    result = runner.invoke(app, ["bench", "remote", "--url", url])
    out = result.output.strip()
    assert result.exit_code == 2, out
    assert "Traceback" not in out and len(out.splitlines()) == 1, out
    assert "--url" in out and needle in out, out


def test_bench_remote_tls_against_a_plain_server_is_bounded(monkeypatch) -> None:
    """``rediss://`` to a listener that never answers the TLS handshake hung 72 s silently."""
    pytest.importorskip("redis")
    from kvtier.bench import remote

    monkeypatch.setattr(remote, "PREFLIGHT_TIMEOUT_S", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never speaks
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        result = runner.invoke(app, ["bench", "remote", "--url", f"rediss://127.0.0.1:{port}/0"])
        elapsed = time.monotonic() - t0
    assert result.exit_code == 2 and "TLS" in result.output and elapsed < 10, (elapsed, result.output)


def test_missing_extra_is_one_line_exit_2(monkeypatch) -> None:
    from kvtier.bench import remote

    def no_redis(**kw: object) -> int:
        raise ModuleNotFoundError("No module named 'redis'", name="redis")

    monkeypatch.setattr(remote, "run_remote", no_redis)
    result = runner.invoke(app, ["bench", "remote", "--url", "redis://127.0.0.1:6399/0"])
    assert result.exit_code == 2 and "'redis'" in result.output and "Traceback" not in result.output


# -- CLI conventions (item 16) ----------------------------------------------------------------------
def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"kvtier {__version__}"


def test_json_dash_writes_json_to_stdout_and_the_table_elsewhere(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["simulate", "--trace", "multi-turn", "--requests", "60", "--capacities", "8", "--policies", "lru"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args, "--json", "-"],
        capture_output=True, text=True, timeout=120, env=_clean_env(),
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # stdout is exactly the JSON
    assert data["trace"] == "multi-turn" and data["capacities_chunks"] == [8]
    assert "Token hit rate" in proc.stderr and not (tmp_path / "-").exists()
    assert "simulating trace multi-turn" in proc.stderr  # progress (one line per trace off a terminal)


def test_simulate_reports_progress_through_its_callback() -> None:
    from kvtier.sim.run import simulate

    steps: list[tuple[str, int, int]] = []
    simulate("multi-turn", [4, 8], ["lru", "fifo"], num_requests=30, progress=lambda *a: steps.append(a))
    assert [d for _, d, _ in steps] == list(range(1, 7)) and all(t == 6 for _, _, t in steps)


@pytest.mark.parametrize(
    ("command", "module", "func"),
    [("tiers", "kvtier.bench.tiers", "run_tiers"), ("miss-overhead", "kvtier.bench.miss_overhead", "run_miss_overhead"),
     ("server", "kvtier.bench.server", "run_bench_server")],
)
def test_every_bench_exits_1_when_a_target_is_missed(command: str, module: str, func: str, monkeypatch) -> None:
    """``bench tiers`` and ``bench miss-overhead`` exited 0 with targets missed; ``bench remote`` exited 1."""
    import importlib

    seen: dict[str, object] = {}

    def fake(**kw: object) -> int:
        seen.update(kw)
        return 1 if kw.get("enforce") else 0

    monkeypatch.setattr(importlib.import_module(module), func, fake)
    result = runner.invoke(app, ["bench", command])
    assert result.exit_code == 1 and seen["enforce"] is True, result.output


# -- server start-up refusals (items 10, 13, 15) -----------------------------------------------------
def _server(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    sock = tmp_path / "run" / "s.sock"
    metrics = [] if "--metrics-port" in args else ["--no-metrics"]
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "server", "--socket", str(sock), *metrics, *args],
        capture_output=True, text=True, timeout=60, env=env or _clean_env(),
    )


def test_non_loopback_tcp_host_needs_allow_remote(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    out = _server(tmp_path, "--tcp-host", "0.0.0.0", "--token-file", str(token))
    text = out.stdout + out.stderr
    assert out.returncode == 2 and "--allow-remote" in text and "ready" not in text, text


def test_tcp_without_a_token_names_the_real_flags(tmp_path: Path) -> None:
    out = _server(tmp_path, "--tcp-host", "127.0.0.1")
    text = out.stdout + out.stderr
    assert out.returncode == 2 and "--token-file" in text and "server_token" in text, text
    assert "(--token)" not in text


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--tcp-host", "127.0.0.1", "--token-file", "/nonexistent/token"], "--token-file"),
        (["--metrics-port", "99999"], "metrics_port"),
        (["--cpu-capacity", "10XB"], "cpu_capacity (from flag --cpu-capacity): '10XB' has an unknown unit"),
        (["--cpu-capacity", "4"], "did you mean '4GiB'"),
    ],
)
def test_server_usage_errors_are_one_line_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    out = _server(tmp_path, *args)
    text = (out.stdout + out.stderr).strip()
    assert out.returncode == 2 and needle in text and "Traceback" not in text and len(text.splitlines()) == 1, text


def test_check_tcp_host() -> None:
    from kvtier.service.main import check_tcp_host

    assert check_tcp_host(None, False) is None
    assert check_tcp_host("127.0.0.1", False) is None and check_tcp_host("::1", False) is None
    assert check_tcp_host("localhost", False) is None
    for host in ("0.0.0.0", "::"):
        assert "--allow-remote" in (check_tcp_host(host, False) or "")
        assert check_tcp_host(host, True) is None


def test_server_log_names_only_server_settings(tmp_path: Path) -> None:
    from kvtier.config import load_config

    line = load_config({"server_token": "t", "chunk_size": 512}, environ={}).describe("server")
    assert "cpu_capacity=" in line and "disk_path=" in line
    for engine_only in ("chunk_size", "server_token", "lookup_timeout_s", "async_load", "model_id", "kv_role"):
        assert f"{engine_only}=" not in line


# -- remote failures visible (item 12) ---------------------------------------------------------------
def test_breaker_logs_one_warning_per_outage(caplog) -> None:
    now = [0.0]
    b = CircuitBreaker(2, 1.0, 4.0, clock=lambda: now[0], name="redis 10.0.0.5:6379")
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.breaker"):
        for _ in range(10):  # a long outage: open, probes fail, back-off doubles
            if b.allow():
                b.failure()
            now[0] += 1.5
        opened = [r for r in caplog.records if "circuit breaker open" in r.getMessage()]
        assert len(opened) == 1 and "10.0.0.5:6379" in opened[0].getMessage()
        while not b.allow():
            now[0] += 1.0
        b.success()
    closed = [r for r in caplog.records if "answers again" in r.getMessage()]
    assert len(closed) == 1 and len(caplog.records) == 2


@pytest.fixture
def bare_redis(tmp_path: Path) -> Iterator[int]:
    """A throwaway redis-server with no maxmemory and the noeviction policy (the shared test
    servers are configured properly and must not be changed)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server not installed")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--maxmemory", "0", "--maxmemory-policy", "noeviction", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "throwaway redis-server did not start"
                time.sleep(0.02)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_redis_without_maxmemory_or_eviction_is_warned_at_open(bare_redis: int, caplog) -> None:
    pytest.importorskip("redis")
    from conftest import small_namespace

    from kvtier.config import load_config
    from kvtier.index.keys import KeyNamespace
    from kvtier.storage.lower_tiers import open_remote_tier

    ns: KeyNamespace = small_namespace()
    cfg = load_config({"remote_url": f"redis://127.0.0.1:{bare_redis}/0", "chunk_size": ns.chunk_size}, environ={})
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.lower_tiers"):
        tier = open_remote_tier(cfg, ns)
    assert tier is not None
    tier.close()
    text = caplog.text
    assert "no maxmemory" in text and "noeviction" in text and "allkeys-lru" in text


def test_dead_redis_is_warned_at_open(caplog) -> None:
    pytest.importorskip("redis")
    from conftest import small_namespace

    from kvtier.config import load_config
    from kvtier.storage.lower_tiers import open_remote_tier

    ns = small_namespace()
    cfg = load_config(
        {"remote_url": "redis://127.0.0.1:1/0", "chunk_size": ns.chunk_size, "remote_timeout_s": 0.5}, environ={}
    )
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.lower_tiers"):
        tier = open_remote_tier(cfg, ns)
    assert tier is not None and time.monotonic() - t0 < 5
    tier.close()
    assert "does not answer" in caplog.text and "127.0.0.1:1" in caplog.text


@pytest.mark.slow
def test_a_port_in_use_names_the_flag_and_leaves_no_socket(tmp_path: Path) -> None:
    """A metrics port another process holds: one line naming the flag and port; nothing left bound."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        out = _server(tmp_path, "--metrics-port", str(port))
    text = (out.stdout + out.stderr).strip()
    # a setting that cannot work: exit 2 (as for config errors), with what to do instead
    assert out.returncode == 2 and f"--metrics-port 127.0.0.1:{port}" in text.replace("--metrics-host/", ""), text
    assert "--no-metrics" in text, text
    errors = [line for line in text.splitlines() if " ERROR " in line]
    assert "Traceback" not in text and len(errors) == 1, text
    assert not (tmp_path / "run" / "s.sock").exists()


@pytest.mark.slow  # each case starts a CLI with an extra hidden (~1-3 s)
@pytest.mark.parametrize("argv,module,extra", [
    (["bench", "serve", "--quick"], "httpx", "controller"),  # imported before the command's error handling
    (["demo", "--quick"], "transformers", "vllm-cpu"),
    (["demo", "--quick"], "gguf", "demo"),  # transformers itself raised a bare ImportError for it
])
def test_a_missing_extra_is_one_line_naming_it_never_a_traceback(argv, module, extra, tmp_path: Path) -> None:
    """Failing input (a fresh user's core-only install): `kvtier bench serve` ended in a traceback
    (ModuleNotFoundError: httpx), and `kvtier demo` named no extra. The module is hidden from
    imports and from ``find_spec`` (how transformers looks for gguf), under an empty HOME so the
    demo converts the model rather than reuse a converted copy."""
    import os
    import subprocess
    import sys

    code = (
        "import builtins, importlib.util, sys\n"
        "real = builtins.__import__\n"
        "real_find = importlib.util.find_spec\n"
        f"def fake(name, *a, **k):\n"
        f"    if name.split('.')[0] == {module!r}:\n"
        f"        raise ModuleNotFoundError('No module named ' + repr(name), name={module!r})\n"
        "    return real(name, *a, **k)\n"
        "def fake_find(name, *a, **k):\n"
        f"    return None if name.split('.')[0] == {module!r} else real_find(name, *a, **k)\n"
        "builtins.__import__ = fake\n"
        "importlib.util.find_spec = fake_find\n"
        f"sys.argv = ['kvtier', *{argv!r}]\n"
        "from kvtier.cli import main\n"
        "main()\n"
    )
    env = {**os.environ, "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and f"kvtier[{extra}]" in out.stderr and repr(module) in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
