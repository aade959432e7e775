"""``kvtier bench soak``: well-behaved engines and a hostile client against one ``kvtier server``.

Starts, each in its own process: a ``kvtier server`` (private temp socket
directory, ``cpu_capacity`` bytes of CPU pool, TCP on loopback with a token,
metrics on a free loopback port), ``clients`` well-behaved engines
(:mod:`kvtier.bench.soak_workload`: multi-turn chat over shared system prompts,
``rate`` requests/s each, 131,072-byte chunks) and one hostile client
(:mod:`kvtier.bench.soak_hostile`: idle connections, unregistered requests,
garbage and oversized frames, wrong TCP tokens, namespace squatting, hoarded
reservations/leases/reads). Once a second it samples the server's RSS
(``/proc/PID/status`` ``VmRSS``), ``/metrics`` and ``/health``.

Targets (issue 14): the well-behaved clients' lookup p99 < 10 ms, no call of
theirs refused, server RSS max <= ``cpu_capacity + rss_allowance``. Exit code:
0 every target met, 1 a target missed (or the run could not be made), 2 a
usage error. Every process is stopped and the temp directory removed on exit,
Ctrl-C included; children also get SIGTERM if this process dies
(``PR_SET_PDEATHSIG``), and the server's pool is a memfd (nothing in /dev/shm).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

from kvtier.bench.common import write_json
from kvtier.bench.soak_options import MiB, SoakOptions
from kvtier.bench.soak_report import build_report, pct
from kvtier.ports import PortPicker
from kvtier.processes import stop_processes

#: Seconds allowed for the server to answer /health and for clients to connect.
STARTUP_S = 90.0
#: Seconds a worker may take past the run's end (an attack in progress finishes; each is bounded).
FINISH_GRACE_S = 30.0
#: Seconds between progress lines.
PROGRESS_EVERY_S = 15.0


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _spawn(args: Sequence[str], log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", *args], env=env, stdout=f, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
        )


def _rss_bytes(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def _http(port: int, path: str, timeout_s: float = 2.0) -> tuple[int, str]:
    """(status, body) of a GET on the loopback metrics port; (0, error) when it fails."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except Exception as exc:
        return 0, f"{type(exc).__name__}: {exc}"


def _metric_values(text: str) -> dict[str, float]:
    """``name{labels}`` -> value of every ``kvtier_*`` / ``process_*`` sample (buckets and ``_created`` left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name.endswith(("_bucket", "_created")) or not s.name.startswith(("kvtier_", "process_")):
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    except Exception as exc:
        out["parse_error"] = 1.0
        out[f"parse_error:{type(exc).__name__}"] = 1.0
    return out


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_soak(opts: SoakOptions, json_path: Path | None = None) -> int:
    """Run the soak; returns the exit code (0 pass, 1 a target missed or no run, 2 usage error)."""
    bad = opts.problems()
    if bad:
        for line in bad:
            print(f"kvtier bench soak: {line}", file=sys.stderr)
        return 2
    seconds = opts.minutes * 60.0
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if json_path is not None and str(json_path) == "-":  # stdout holds the JSON only; tables go to stderr
            with contextlib.redirect_stdout(sys.stderr):
                code, report = _run(opts, seconds)
            print(json.dumps(report, indent=1, sort_keys=True))
        else:
            code, report = _run(opts, seconds)
            write_json(json_path, report)
        return code
    except KeyboardInterrupt:
        print("soak: interrupted; every process stopped, temp directory removed", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _interrupt(signum: int, frame: object) -> None:
    """SIGINT/SIGTERM (even if SIGINT was ignored when started in the background): unwind and clean up."""
    raise KeyboardInterrupt


def _run(opts: SoakOptions, seconds: float) -> tuple[int, dict[str, Any]]:
    """Start everything, sample, stop everything; (exit code, report). No run: (1, the reason)."""
    tmp = Path(tempfile.mkdtemp(prefix="kvsoak-", dir="/tmp"))  # 0700; short: socket paths are <= 107 bytes
    sock = str(tmp / "s.sock")
    ports = PortPicker()
    metrics_port = ports.pick()
    tcp_port = ports.pick() if opts.tcp else None
    server: subprocess.Popen | None = None
    workers: list[subprocess.Popen] = []
    try:
        cmd = ["kvtier.cli", "server", "--socket", sock, "--cpu-capacity", str(opts.cpu_capacity),
               "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port)]
        if tcp_port is not None:
            token = tmp / "token"
            token.write_text(os.urandom(16).hex())
            token.chmod(0o600)
            cmd += ["--tcp-host", "127.0.0.1", "--tcp-port", str(tcp_port), "--token-file", str(token)]
        server = _spawn(cmd, tmp / "server.log")
        print(f"soak: server pid {server.pid}, {opts.cpu_capacity / MiB:.0f} MiB pool, "
              f"{opts.clients} clients at {opts.rate:g} req/s + 1 hostile, {seconds:.0f} s", flush=True)
        deadline = time.monotonic() + STARTUP_S
        while _http(metrics_port, "/health", 1.0)[0] != 200:
            if server.poll() is not None or time.monotonic() > deadline:
                log = _tail(tmp / "server.log")
                print(f"soak: kvtier server did not come up:\n{log}", file=sys.stderr)
                return 1, {"passed": False, "error": "kvtier server did not come up", "server_log": log}
            time.sleep(0.1)
        go = tmp / "go"
        common = ["--socket", sock, "--seconds", str(seconds), "--go", str(go)]
        for i in range(opts.clients):
            workers.append(_spawn(["kvtier.bench.soak_workload", *common, "--index", str(i), "--rate", str(opts.rate),
                                   "--restart-every", str(opts.restart_every_s),
                                   "--ready", str(tmp / f"ready-{i}"), "--out", str(tmp / f"client-{i}.json")],
                                  tmp / f"client-{i}.log"))
        hostile_cmd = ["kvtier.bench.soak_hostile", *common, "--out", str(tmp / "hostile.json")]
        hostile_cmd += ["--http", f"127.0.0.1:{metrics_port}"]
        if tcp_port is not None:
            hostile_cmd += ["--tcp", f"127.0.0.1:{tcp_port}"]
        workers.append(_spawn(hostile_cmd, tmp / "hostile.log"))
        while not all((tmp / f"ready-{i}").exists() for i in range(opts.clients)):
            if time.monotonic() > deadline or server.poll() is not None:
                break  # the missing clients report their error; the run goes on and is judged
            time.sleep(0.05)
        go.write_text("go")
        samples = _sample(server, metrics_port, seconds, workers)
        end = time.monotonic() + FINISH_GRACE_S
        for w in workers:
            try:
                w.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        final_metrics = _metric_values(_http(metrics_port, "/metrics")[1])
        server_alive = server.poll() is None
        stop_processes(workers, 5.0)
        stop_processes([server], 20.0)
        results = [_read_json(tmp / f"client-{i}.json") or {"index": i, "error": "no result"} for i in range(opts.clients)]
        hostile = _read_json(tmp / "hostile.json") or {}
        report = build_report(opts, seconds, samples, results, hostile, final_metrics, server_alive,
                              server.returncode, not Path(sock).exists(), _log_summary(tmp / "server.log"))
    finally:
        stop_processes(workers, 5.0)
        if server is not None:
            stop_processes([server], 20.0)
        shutil.rmtree(tmp, ignore_errors=True)
    return (0 if report["passed"] else 1), report


def soak_main(minutes: float, clients: int, rate: float, cpu_capacity: str, rss_allowance: str, tcp: bool,
              json_path: str | None, restart_every_s: float = 30.0) -> int:
    """``kvtier bench soak`` from its flags (sizes as strings, e.g. ``64MiB``); usage errors print one line, exit 2."""
    from kvtier.sizes import parse_size

    sizes: dict[str, int] = {}
    for flag, value in (("--cpu-capacity", cpu_capacity), ("--rss-allowance", rss_allowance)):
        try:
            sizes[flag] = parse_size(value)
        except ValueError as exc:
            print(f"kvtier bench soak: {flag}: {exc}", file=sys.stderr)
            return 2
    opts = SoakOptions(minutes, clients, rate, sizes["--cpu-capacity"], sizes["--rss-allowance"], tcp, restart_every_s)
    return run_soak(opts, None if json_path is None else Path(json_path))


def _log_summary(path: Path) -> dict[str, Any]:
    """Size of the server's log (bytes, lines), lines per level, tracebacks, and its last 40 lines."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    lines = text.splitlines()
    levels: dict[str, int] = {}
    for line in lines:
        m = re.search(r" (DEBUG|INFO|WARNING|ERROR|CRITICAL) ", line)
        if m:
            levels[m.group(1)] = levels.get(m.group(1), 0) + 1
    return {"bytes": len(text.encode()), "lines": len(lines), "levels": levels,
            "tracebacks": text.count("Traceback (most recent call last)"), "tail": lines[-40:]}


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _sample(server: subprocess.Popen, port: int, seconds: float, workers: list[subprocess.Popen]) -> dict[str, Any]:
    """Once a second until ``seconds`` have passed: server RSS, /health status, a /metrics scrape."""
    t0 = time.monotonic()
    rss: list[int] = []
    health: dict[str, int] = {}
    scrape_ms: list[float] = []
    scrape_failures = 0
    degraded: list[str] = []
    next_progress = t0 + PROGRESS_EVERY_S
    while (now := time.monotonic()) < t0 + seconds and server.poll() is None:
        r = _rss_bytes(server.pid)
        if r is not None:
            rss.append(r)
        code, body = _http(port, "/health")
        try:
            status = str(json.loads(body).get("status", code)) if code else "unreachable"
        except ValueError:
            status = f"http_{code}"
        health[status] = health.get(status, 0) + 1
        if status not in ("ok",) and len(degraded) < 20:
            degraded.append(body[:300])
        s0 = time.perf_counter()
        code, _ = _http(port, "/metrics")
        if code == 200:
            scrape_ms.append((time.perf_counter() - s0) * 1e3)
        else:
            scrape_failures += 1
        if now >= next_progress:
            alive = sum(1 for w in workers if w.poll() is None)
            print(f"soak: {now - t0:5.0f}/{seconds:.0f} s  server RSS {max(rss, default=0) / MiB:.0f} MiB max  "
                  f"health {health}  workers alive {alive}/{len(workers)}", flush=True)
            next_progress += PROGRESS_EVERY_S
        time.sleep(max(0.0, 1.0 - (time.monotonic() - now)))
    return {
        "rss_bytes": rss, "health": health, "health_not_ok": degraded, "metrics_scrape_ms_p99": pct(scrape_ms, 99),
        "metrics_scrapes": len(scrape_ms), "metrics_scrape_failures": scrape_failures,
        "sampled_s": time.monotonic() - t0,
    }
