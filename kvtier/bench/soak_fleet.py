"""``kvtier bench soak-fleet``: a keyed fleet under normal load while a hostile client attacks it (issue 24).

Starts the fleet of :mod:`kvtier.bench.soak_fleet_procs` (a controller, three ``kvtier server``
instances that are CURVE/peer/event-stream members, ``kvtier router`` and ``kvtier pd-proxy`` in
front of fake OpenAI backends), then, each in its own process:

- ``clients`` well-behaved engines (:mod:`.soak_fleet_workload`) storing and loading chunk chains
  through the instances, turns moving between instances so loads arrive via P2P, every load
  audited against the writer's bytes;
- the lookup prober and the monitor (:mod:`.soak_fleet_probe`): controller ``/lookup`` and router
  requests timed; drop-offs, poisoned index entries, over-capacity claims, operator and peer
  lock-outs recorded; peer pulls and KV event reads as a member;
- the hostile client (:mod:`.soak_fleet_hostile`) running every attack of issue 24 (kinds 1-6) in a
  loop;
- the floor probe (:mod:`.soak_fleet_floor`): the machine's own wake-up and one-hop IPC latency in
  the same run, the floor under the lookup p99 (reported, not judged).

Once a second it samples every fleet process's RSS (``/proc/PID/status`` ``VmRSS``). The verdict
and its figures are :mod:`.soak_fleet_report`'s. Exit code: 0 every target met, 1 a target missed
(or the fleet did not come up), 2 a usage error. Every process is stopped and the temp directory
removed on exit, Ctrl-C included; children get SIGTERM if this process dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.common import write_json
from kvtier.bench.soak import _interrupt, _log_summary, _metric_values, _read_json, _rss_bytes
from kvtier.processes import stop_processes
from kvtier.bench.soak_fleet_procs import SoakFleet, get, spawn
from kvtier.bench.soak_fleet_report import build_report

MiB = 1 << 20
#: Seconds a worker may take past the run's end (an attack in progress finishes; each is bounded).
FINISH_GRACE_S = 50.0
PROGRESS_EVERY_S = 15.0
#: Niceness of the hostile client's process. What the fleet spends answering its attacks is the fleet's
#: (and is measured); what the hostile spends making them (20 MiB frames, 42 MB bodies, thousands of
#: handshakes) runs at low priority, as it would on its own cores of a larger machine: on 2 shared cores
#: it would otherwise only measure that two processes share a CPU.
HOSTILE_NICE = 10


def default_router_model() -> str | None:
    """The demo's model folder (its tokenizer lets the router bound text prompts), if prepared."""
    from kvtier.demo.model import MODEL_DIR_NAME, default_cache_dir, is_complete

    folder = default_cache_dir() / "models" / MODEL_DIR_NAME
    return str(folder) if is_complete(folder) else None


@dataclass(frozen=True)
class FleetSoakOptions:
    """One run.

    Attributes:
        duration_s: the measured run, seconds (after every client connected).
        clients: well-behaved client processes.
        rate: requests per second of each client.
        lookup_rate / router_rate: controller lookups and router requests per second.
        cpu_capacity: bytes of each instance's CPU pool.
        rss_allowance: controller and router RSS allowed above their level 10-20 % into the run, bytes.
        router_model: model folder whose tokenizer the router loads ("" : none; text prompts are then
            routed by load alone and the huge-text-prompt attack is not judged on them).
        keep_logs: a folder the processes' logs and JSON outputs are copied to at the end ("": none).
        hostile: run the hostile client; False: the same fleet and load alone (a baseline for the
            lookup and RSS figures; the attack checks are then not judged).
    """

    duration_s: float = 600.0
    clients: int = 3
    rate: float = 6.0
    lookup_rate: float = 20.0
    router_rate: float = 5.0
    cpu_capacity: int = 48 * MiB
    rss_allowance: int = 128 * MiB
    router_model: str = ""
    keep_logs: str = ""
    hostile: bool = True

    def problems(self) -> list[str]:
        """Usage errors, one line each, naming the flag and the accepted range."""
        out = []
        if not 10 <= self.duration_s <= 24 * 3600:
            out.append(f"--duration must be in [10, 86400] seconds, got {self.duration_s}")
        if not 1 <= self.clients <= 32:
            out.append(f"--clients must be in 1..32, got {self.clients}")
        for flag, v in (("--rate", self.rate), ("--lookup-rate", self.lookup_rate), ("--router-rate", self.router_rate)):
            if not 0 < v <= 500:
                out.append(f"{flag} must be in (0, 500] per second, got {v}")
        if not 8 * MiB <= self.cpu_capacity <= 64 * 1024 * MiB:
            out.append(f"--cpu-capacity must be 8MiB..64GiB, got {self.cpu_capacity} bytes")
        if self.rss_allowance < 0:
            out.append(f"--rss-allowance must be >= 0, got {self.rss_allowance} bytes")
        if self.router_model and not Path(self.router_model).is_dir():
            out.append(f"--router-model {self.router_model!r} is not a folder")
        return out


def run_soak_fleet(opts: FleetSoakOptions, json_path: Path | None = None) -> int:
    """Run the soak; returns the exit code (0 pass, 1 a target missed or no run, 2 usage error)."""
    bad = opts.problems()
    if bad:
        for line in bad:
            print(f"kvtier bench soak-fleet: {line}", file=sys.stderr)
        return 2
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if json_path is not None and str(json_path) == "-":  # stdout holds the JSON only; tables go to stderr
            with contextlib.redirect_stdout(sys.stderr):
                code, report = _run(opts)
            print(json.dumps(report, indent=1, sort_keys=True))
        else:
            code, report = _run(opts)
            write_json(json_path, report)
        return code
    except KeyboardInterrupt:
        print("soak-fleet: interrupted; every process stopped, temp directory removed", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _write_private(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data))
    os.chmod(path, 0o600)
    return path


def _run(opts: FleetSoakOptions) -> tuple[int, dict[str, Any]]:
    tmp = Path(tempfile.mkdtemp(prefix="kvsoakf-", dir="/tmp"))  # 0700; short: socket paths are <= 107 bytes
    fleet = SoakFleet(tmp, cpu_capacity=opts.cpu_capacity, router_model=opts.router_model or None)
    workers: dict[str, subprocess.Popen] = {}
    try:
        print(f"soak-fleet: starting 3 instances, controller, router, pd-proxy, backends in {tmp}", flush=True)
        try:
            fleet.start()
        except RuntimeError as exc:
            print(f"soak-fleet: the fleet did not come up: {exc}", file=sys.stderr)
            return 1, {"passed": False, "error": str(exc)}
        seed = os.urandom(16).hex()
        plan = _write_private(tmp / "plan.json", {**fleet.plan(), "seed": seed})
        hplan = _write_private(tmp / "hostile-plan.json", {**fleet.hostile_plan(), "router_tokenizer": bool(opts.router_model)})
        go = tmp / "go"
        secs = str(opts.duration_s)
        for i in range(opts.clients):
            workers[f"client-{i}"] = spawn(
                ["kvtier.bench.soak_fleet_workload", "--plan", str(plan), "--index", str(i), "--seconds", secs,
                 "--rate", str(opts.rate), "--go", str(go), "--ready", str(tmp / f"ready-{i}"),
                 "--out", str(tmp / f"client-{i}.json")], tmp / f"client-{i}.log")
        for role in ("lookups", "monitor"):
            workers[role] = spawn(["kvtier.bench.soak_fleet_probe", "--role", role, "--plan", str(plan),
                                   "--seconds", secs, "--go", str(go), "--out", str(tmp / f"{role}.json"),
                                   "--rate", str(opts.lookup_rate), "--router-rate", str(opts.router_rate)],
                                  tmp / f"{role}.log")
        workers["floor"] = spawn(["kvtier.bench.soak_fleet_floor", "--seconds", secs, "--go", str(go),
                                  "--out", str(tmp / "floor.json")], tmp / "floor.log")
        if opts.hostile:  # niced: on a machine this small its own CPU would starve the fleet (see HOSTILE_NICE)
            workers["hostile"] = spawn(["kvtier.bench.soak_fleet_hostile", "--plan", str(hplan), "--seconds", secs,
                                        "--go", str(go), "--out", str(tmp / "hostile.json")], tmp / "hostile.log",
                                       nice=HOSTILE_NICE)
        deadline = time.monotonic() + 120.0
        while not all((tmp / f"ready-{i}").exists() for i in range(opts.clients)):
            if time.monotonic() > deadline or fleet.dead():
                break  # the missing clients report their error; the run goes on and is judged
            time.sleep(0.05)
        go.write_text("go")
        print(f"soak-fleet: {opts.clients} clients at {opts.rate:g} req/s, lookups {opts.lookup_rate:g}/s, "
              f"router {opts.router_rate:g}/s, {'hostile client attacking' if opts.hostile else 'no hostile client'}, "
              f"{opts.duration_s:.0f} s", flush=True)
        rss = _sample(fleet, opts.duration_s, workers)
        end = time.monotonic() + FINISH_GRACE_S
        for w in workers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.wait(max(0.1, end - time.monotonic()))
        dead = fleet.dead()
        seen_pd = {}
        for name, port in (("prefill", fleet.prefill_port), ("decode", fleet.decode_port)):
            code, body = get(f"http://127.0.0.1:{port}/fake/seen")
            seen_pd[name] = json.loads(body) if code == 200 else {"error": body.decode(errors="replace")[:200]}
        p2p = {}
        for n in fleet.nodes:
            code, body = get(f"http://127.0.0.1:{n.metrics_port}/metrics")
            if code == 200:
                p2p.update({f"{n.name}:{k}": v for k, v in _metric_values(body.decode()).items() if "peer" in k})
        code, body = get(f"{fleet.controller_url}/metrics", fleet.token)
        ctl_counters = {k.removeprefix("kvtier_controller_").removesuffix("_total"): v
                        for k, v in _metric_values(body.decode() if code == 200 else "").items()
                        if k.startswith("kvtier_controller_") and "{" not in k}
        stop_processes(list(workers.values()), 5.0)
        exits = fleet.stop()
        clients = [_read_json(tmp / f"client-{i}.json") or {"index": i, "error": "no result"} for i in range(opts.clients)]
        lookups = _read_json(tmp / "lookups.json") or {}
        monitor = _read_json(tmp / "monitor.json") or {}
        hostile = (_read_json(tmp / "hostile.json") or {}) if opts.hostile else {"attacks": {}, "baseline": True}
        logs = {name: _log_summary(tmp / f"{name}.log") for name in fleet.procs}
        for summary in logs.values():
            if not summary.get("tracebacks"):
                summary.pop("tail", None)  # the tails of clean logs are noise in the JSON
        report = build_report(opts, opts.duration_s, clients, lookups, monitor, hostile, rss, seen_pd, dead,
                              exits, logs, fleet.secrets(), p2p, ctl_counters, _read_json(tmp / "floor.json"))
    finally:
        stop_processes(list(workers.values()), 5.0)
        fleet.stop()
        if opts.keep_logs:
            keep = Path(opts.keep_logs)
            keep.mkdir(parents=True, exist_ok=True)
            for f in [*tmp.glob("*.log"), *tmp.glob("*.json")]:
                if f.name not in ("plan.json",) and not f.name.startswith("inst-"):  # plans and configs hold secrets
                    shutil.copy(f, keep / f.name)
            for f in tmp.glob("inst-*.log"):
                shutil.copy(f, keep / f.name)
        shutil.rmtree(tmp, ignore_errors=True)
    return (0 if report["passed"] else 1), report


def _sample(fleet: SoakFleet, seconds: float, workers: dict[str, subprocess.Popen]) -> dict[str, list[tuple[float, int]]]:
    """Once a second until ``seconds`` have passed: every fleet process's RSS (bytes), with its monotonic time."""
    t0 = time.monotonic()
    rss: dict[str, list[tuple[float, int]]] = {name: [] for name in fleet.procs}
    next_progress = t0 + PROGRESS_EVERY_S
    while (now := time.monotonic()) < t0 + seconds:
        for name, p in fleet.procs.items():
            r = _rss_bytes(p.pid)
            if r is not None:
                rss[name].append((now, r))
        if now >= next_progress:
            alive = sum(1 for w in workers.values() if w.poll() is None)
            mib = {n: f"{s[-1][1] / MiB:.0f}" for n, s in rss.items() if s and n in ("controller", "router")}
            print(f"soak-fleet: {now - t0:5.0f}/{seconds:.0f} s  RSS MiB {mib}  fleet dead {fleet.dead() or 'none'}  "
                  f"workers alive {alive}/{len(workers)}", flush=True)
            next_progress += PROGRESS_EVERY_S
        time.sleep(max(0.0, 1.0 - (time.monotonic() - now)))
    return rss


def soak_fleet_main(duration: float, clients: int, rate: float, lookup_rate: float, router_rate: float,
                    cpu_capacity: str, rss_allowance: str, router_model: str | None, json_path: str | None,
                    keep_logs: str = "", hostile: bool = True) -> int:
    """``kvtier bench soak-fleet`` from its flags (sizes as strings, e.g. ``48MiB``; ``router_model`` None:
    the demo's model folder when prepared, "" none); usage errors print one line, exit 2."""
    from kvtier.sizes import parse_size

    sizes: dict[str, int] = {}
    for flag, value in (("--cpu-capacity", cpu_capacity), ("--rss-allowance", rss_allowance)):
        try:
            sizes[flag] = parse_size(value)
        except ValueError as exc:
            print(f"kvtier bench soak-fleet: {flag}: {exc}", file=sys.stderr)
            return 2
    model = (default_router_model() or "") if router_model is None else router_model
    opts = FleetSoakOptions(duration, clients, rate, lookup_rate, router_rate, sizes["--cpu-capacity"],
                            sizes["--rss-allowance"], model, keep_logs, hostile)
    return run_soak_fleet(opts, None if json_path is None else Path(json_path))
