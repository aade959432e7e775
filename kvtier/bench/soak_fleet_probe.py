"""The soak's own observers (``kvtier bench soak-fleet``): lookups, and what the fleet looks like.

Two roles, each its own process (so neither's work skews the other's timings):

- ``lookups``: the fleet's lookups under normal load. ``POST /lookup`` on the controller (bearer
  token) at ``rate`` per second, and completions through ``kvtier router`` (which asks the
  controller's ``/lookup`` for every request and forwards to a backend) at ``router_rate``; each
  call's wall time (milliseconds). A lookup slower than ``STALL_S`` or failed is a ``lookup_stall``
  event, a router request slower than ``ROUTER_STALL_S`` or failed a ``router_stall``.
- ``monitor``: the fleet as its operator sees it. ``/instances`` four times a second: an instance
  missing, or registered again (a new epoch fingerprint or registration time), is a ``drop_off``; a
  ``rogue-*`` record holding more chunks than it declared room for is ``over_capacity``; a record
  of the soak model by anyone but the fleet's instances is ``foreign_namespace``. Once a second the
  hostile client's poison keys are looked up (``index_poisoned`` if anyone holds one); every 2 s
  the operator reads ``/dashboard/snapshot`` (``operator_lockout`` if it cannot within
  ``OPERATOR_S``). Every second a fresh authenticated peer link (member ``auditor``) to one
  instance in turn asks which probe chunks it holds and pulls two, audited against the writer's
  bytes (``peer_lockout`` if it fails or takes longer than ``PEER_S``, ``peer_mismatch`` on wrong
  bytes). The auditor also reads every instance's KV event stream (a member with the events role
  must get them, so a stranger getting none means something).

Events carry ``time.monotonic()`` (system-wide on Linux), so the report can put them next to the
hostile client's attack windows. Run as ``python -m kvtier.bench.soak_fleet_probe --role ROLE
--plan PLAN --seconds D --go GO --out OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvtier.bench.soak_fleet_workload import SALTS, chunk_bytes
from kvtier.bench.soak_workload import VOCAB, soak_namespace, system_prompts, wait_for_file
from kvtier.index.keys import ChunkHasher

#: A controller lookup slower than this (or failed) is a stall (seconds).
STALL_S = 1.0
#: A router request slower than this (or failed) is a stall (seconds).
ROUTER_STALL_S = 2.0
#: The operator must read the dashboard within this (seconds).
OPERATOR_S = 3.0
#: A fresh peer link's contains + pull must finish within this (seconds).
PEER_S = 1.5
#: Events kept in detail per process (all are counted).
MAX_EVENTS = 2000
#: Public seed of the keys the hostile client claims (both sides derive them).
POISON_SEED = b"kvtier-soak-poison"
POISON_KEYS = 64


def poison_keys(n: int = POISON_KEYS) -> list[bytes]:
    """The chunk keys the hostile client tries to get into the index (never a real chunk's key)."""
    import hashlib

    return [hashlib.blake2b(POISON_SEED + i.to_bytes(4, "little"), digest_size=32).digest() for i in range(n)]


@dataclass
class Observations:
    """One observer's record: events (kind, monotonic time, detail), counters, latencies
    (``[monotonic time, milliseconds]`` pairs)."""

    role: str
    events: list[dict[str, Any]] = field(default_factory=list)
    event_counts: dict[str, int] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    lookup_ms: list[list[float]] = field(default_factory=list)  # [monotonic t, ms]
    router_ms: list[list[float]] = field(default_factory=list)
    error: str = ""

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def event(self, kind: str, detail: str = "") -> None:
        with self._lock:
            self.event_counts[kind] = self.event_counts.get(kind, 0) + 1
            if len(self.events) < MAX_EVENTS:
                self.events.append({"kind": kind, "t": time.monotonic(), "detail": detail[:300]})

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


def _paced(stop: threading.Event, end: float, rate: float, step: Callable[[], None]) -> None:
    period = 1.0 / rate
    next_t = time.monotonic()
    while not stop.is_set() and time.monotonic() < end:
        step()
        next_t = max(next_t + period, time.monotonic() - period)
        stop.wait(max(0.0, next_t - time.monotonic()))


def _prompt(rng: np.random.Generator, prompts: list[np.ndarray]) -> list[int]:
    p = prompts[int(rng.integers(len(prompts)))]
    return np.concatenate([p, rng.integers(0, VOCAB, int(rng.integers(32, 160)), dtype=np.uint32)]).tolist()


def run_lookups(plan: dict[str, Any], obs: Observations, stop: threading.Event, end: float,
                rate: float, router_rate: float) -> None:
    import httpx

    prompts = system_prompts()

    def controller() -> None:
        rng = np.random.default_rng(7)
        with httpx.Client(base_url=plan["controller_url"], timeout=5.0,
                          headers={"Authorization": f"Bearer {plan['token']}"}) as c:
            def step() -> None:
                body = {"tokens": _prompt(rng, prompts), "cache_salt": SALTS[int(rng.integers(len(SALTS)))]}
                t0 = time.perf_counter()
                try:
                    code = c.post("/lookup", json=body).status_code
                    ok, why = code == 200, f"HTTP {code}"
                except httpx.HTTPError as exc:
                    ok, why = False, type(exc).__name__
                dt = time.perf_counter() - t0
                if ok:
                    obs.lookup_ms.append([time.monotonic(), dt * 1e3])
                if not ok or dt > STALL_S:
                    obs.event("lookup_stall", f"{dt:.3f} s {why}")
            _paced(stop, end, rate, step)

    def router() -> None:
        rng = np.random.default_rng(8)
        with httpx.Client(base_url=plan["router_url"], timeout=10.0) as c:
            def step() -> None:
                body = {"model": "fake", "prompt": _prompt(rng, prompts), "max_tokens": 1}
                t0 = time.perf_counter()
                try:
                    r = c.post("/v1/completions", json=body)
                    ok, why = r.status_code == 200, f"HTTP {r.status_code}"
                except httpx.HTTPError as exc:
                    ok, why = False, type(exc).__name__
                dt = time.perf_counter() - t0
                if ok:
                    obs.router_ms.append([time.monotonic(), dt * 1e3])
                if not ok or dt > ROUTER_STALL_S:
                    obs.event("router_stall", f"{dt:.3f} s {why}")
            _paced(stop, end, router_rate, step)

    threads = [threading.Thread(target=f, daemon=True) for f in (controller, router)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class _InstancesWatch:
    """Drop-offs, foreign records and over-capacity claims from successive ``/instances`` answers."""

    def __init__(self, plan: dict[str, Any], obs: Observations):
        self.expected = {n["name"] for n in plan["instances"]}
        self.obs = obs
        self.first: dict[str, tuple[Any, Any]] = {}
        self.missing: set[str] = set()
        self.model = soak_namespace().model

    def sample(self, rows: list[dict[str, Any]]) -> None:
        seen = {r["instance"]: r for r in rows}
        for name in self.expected:
            r = seen.get(name)
            if r is None:
                if name not in self.missing:
                    self.obs.event("drop_off", f"{name} not registered")
                self.missing.add(name)
                continue
            self.missing.discard(name)
            age_ms = int(1000 * float(r.get("last_seen_age_s") or 0.0))  # diagnosis: the controller's view of silence
            key = f"max_silence_ms_{name}"
            self.obs.counters[key] = max(self.obs.counters.get(key, 0), age_ms)
            ident = (r.get("epoch"), r.get("registered_at"))
            if name not in self.first:
                self.first[name] = ident
            elif ident != self.first[name]:
                self.obs.event("drop_off", f"{name} registered again ({ident} after {self.first[name]})")
                self.first[name] = ident
        for name, r in seen.items():
            if name in self.expected:
                continue
            self.obs.count("foreign_records_seen")
            if any(ns.get("model") == self.model for ns in r.get("namespaces", [])):
                self.obs.event("foreign_namespace", f"{name} registered {self.model}")
            for t in r.get("tiers", []):
                cap = int(t.get("capacity_bytes") or 0)
                per = max((int(ns.get("chunk_bytes") or 1) for ns in r.get("namespaces", [])), default=1)
                if not t.get("shared") and cap and t.get("chunks", 0) > cap // per + max(64, cap // per // 16):
                    self.obs.event("over_capacity", f"{name} {t.get('kind')}: {t.get('chunks')} chunks, room for {cap // per}")


def run_monitor(plan: dict[str, Any], obs: Observations, stop: threading.Event, end: float) -> None:
    import httpx

    auth = {"Authorization": f"Bearer {plan['token']}"}
    watch = _InstancesWatch(plan, obs)
    poison = [k.hex() for k in poison_keys()]

    def instances() -> None:
        with httpx.Client(base_url=plan["controller_url"], timeout=OPERATOR_S, headers=auth) as c:
            def step() -> None:
                try:
                    r = c.get("/instances")
                    if r.status_code != 200:
                        raise ValueError(f"HTTP {r.status_code}")
                    watch.sample(r.json()["instances"])
                    obs.count("instances_samples")
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    obs.event("operator_lockout", f"/instances: {type(exc).__name__}: {exc}")
            _paced(stop, end, 4.0, step)

    def oracles() -> None:
        with httpx.Client(base_url=plan["controller_url"], timeout=OPERATOR_S, headers=auth) as c:
            tick = 0

            def step() -> None:
                nonlocal tick
                tick += 1
                try:
                    r = c.post("/lookup", json={"keys": poison})
                    held = {i: row["longest_matched"] for i, row in r.json()["instances"].items() if row["longest_matched"]}
                    if held:
                        obs.event("index_poisoned", f"poison keys indexed: {held}")
                    obs.count("poison_checks")
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    obs.event("operator_lockout", f"/lookup: {type(exc).__name__}")
                if tick % 2 == 0:
                    t0 = time.monotonic()
                    code: int | str
                    try:
                        code = c.get("/dashboard/snapshot").status_code
                    except httpx.HTTPError as exc:
                        code = type(exc).__name__
                    if code != 200 or time.monotonic() - t0 > OPERATOR_S:
                        obs.event("operator_lockout", f"/dashboard/snapshot: {code} in {time.monotonic() - t0:.2f} s")
                    else:
                        obs.count("operator_dashboard_reads")
            _paced(stop, end, 1.0, step)

    threads = [threading.Thread(target=f, daemon=True) for f in (instances, oracles)]
    threads.append(threading.Thread(target=_peer_probe, args=(plan, obs, stop, end), daemon=True))
    threads.append(threading.Thread(target=_events_reader, args=(plan, obs, stop, end), daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _probe_keys() -> list[bytes]:
    hasher = ChunkHasher(soak_namespace())
    return [hasher.keys(p, cache_salt=s)[0] for p in system_prompts() for s in SALTS]


def _peer_probe(plan: dict[str, Any], obs: Observations, stop: threading.Event, end: float) -> None:
    from kvtier.protocol.trust import Credentials
    from kvtier.transfer.peer_open import UrlPeerTier

    creds = Credentials.from_paths(plan["auditor_key"], plan["members_path"])
    nbytes = soak_namespace().chunk_bytes
    seed = bytes.fromhex(plan["seed"])
    keys = _probe_keys()
    nodes = plan["instances"]
    i = 0

    def step() -> None:
        nonlocal i
        node = nodes[i % len(nodes)]
        i += 1
        t0 = time.monotonic()
        tier = UrlPeerTier(node["peer_url"], timeout_s=PEER_S, retry_s=0.05, credentials=creds, expect=node["public"])
        try:
            held = [k for k, h in zip(keys, tier.contains_many(keys)) if h][:2]
            outs = [np.empty(nbytes, np.uint8) for _ in held]
            got = tier.get_many_into(list(zip(held, outs))) if held else []
            errors = tier.stats().get("errors", 0)
        finally:
            tier.close()
        dt = time.monotonic() - t0
        if errors or dt > PEER_S:
            obs.event("peer_lockout", f"{node['name']}: {errors} errors, {dt:.2f} s")
            return
        obs.count("peer_probes")
        for k, ok, out in zip(held, got, outs):
            if not ok:
                continue  # evicted between contains and pull: a miss
            obs.count("peer_probe_loads")
            if not np.array_equal(out, chunk_bytes(seed, k, nbytes)):
                obs.event("peer_mismatch", f"{node['name']}: {k.hex()}")

    _paced(stop, end, 1.0, step)


def _events_reader(plan: dict[str, Any], obs: Observations, stop: threading.Event, end: float) -> None:
    from kvtier.events.subscriber import EventSubscriber
    from kvtier.protocol.trust import Credentials

    creds = Credentials.from_paths(plan["auditor_key"], plan["members_path"])
    subs = [(n["name"], EventSubscriber(f"tcp://127.0.0.1:{n['events_port']}", topic="", credentials=creds,
                                        server_key=n["public"])) for n in plan["instances"]]
    try:
        while not stop.is_set() and time.monotonic() < end:
            for name, s in subs:
                while s.poll(0.0) is not None:
                    obs.count(f"member_event_batches_{name}")
            stop.wait(0.1)
    finally:
        for _, s in subs:
            s.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("lookups", "monitor"), required=True)
    ap.add_argument("--plan", type=Path, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--go", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rate", type=float, default=20.0, help="Controller lookups per second.")
    ap.add_argument("--router-rate", type=float, default=5.0, help="Router requests per second.")
    a = ap.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    obs = Observations(a.role)
    plan = json.loads(a.plan.read_text())
    try:
        if wait_for_file(a.go, stop, 180.0):
            end = time.monotonic() + a.seconds
            if a.role == "lookups":
                run_lookups(plan, obs, stop, end, a.rate, a.router_rate)
            else:
                run_monitor(plan, obs, stop, end)
        else:
            obs.error = "no start signal"
    except Exception as exc:  # reported: the soak judges it
        obs.error = f"{type(exc).__name__}: {exc}"
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(obs.to_json()))
    os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
