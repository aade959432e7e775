"""The hostile client of ``kvtier bench soak-fleet``: every attack of issue 24, in a loop.

What it knows is what a stranger on the machine knows: every address, every public key (the
members file is readable by all; ``/proc`` shows every command line) and the public system
prompts; plus the secret key of one member, ``rogue`` (roles ``register,peer``, ``ids=rogue-*``,
``models=rogue/*``), so the bounds on what a member may claim are attacked too. It never reads the
operator's token, the other members' key files or the workload's seed (same uid on this machine,
so it could: the soak plays a stranger, and a stranger cannot).

Each attack (:func:`attacks`: kinds 1-2 in :mod:`.soak_fleet_attacks_zmq`, 3 in :mod:`.soak_fleet_attacks_net`,
4-6 in :mod:`.soak_fleet_attacks_http`) is one bounded run of the issue's input(s) of its kind. A run
records its window (``time.monotonic()``, system-wide), its actions, the outcomes it saw, and whether
it saw its aim achieved itself (a reply from a socket that must not answer, chunk bytes, an event, a
200...). What only the fleet can show (an instance dropping off, a stalled lookup, an RSS jump, an
operator locked out) the soak's monitor records as events; the report counts a run as a success
when either happened in its window (:mod:`.soak_fleet_report`). Bodies of the answers it got
without a token are kept (bounded) so the report can scan them for secrets it does not know.

Run as ``python -m kvtier.bench.soak_fleet_hostile --plan HOSTILE_PLAN --seconds D --go GO --out OUT``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import zmq

from kvtier.bench.soak_fleet_attack_base import MAX_WINDOWS, Hostile, Tally
from kvtier.bench.soak_workload import wait_for_file

# -- the loop ---------------------------------------------------------------------------------------------

def attacks() -> dict[str, tuple[int, Callable[[Hostile, Tally], None], tuple[str, ...]]]:
    """Every attack: name -> (issue-24 kind, function, monitor events that mean it achieved its aim)."""
    from kvtier.bench.soak_fleet_attacks_http import HTTP_ATTACKS
    from kvtier.bench.soak_fleet_attacks_net import NET_ATTACKS
    from kvtier.bench.soak_fleet_attacks_zmq import ZMQ_ATTACKS

    return {**ZMQ_ATTACKS, **NET_ATTACKS, **HTTP_ATTACKS}


#: Attack kinds run one after the other on one thread; the lanes run side by side, so every
#: attack comes round within a short run and attacks of different kinds overlap.
LANES: tuple[tuple[int, ...], ...] = ((1, 2), (3,), (4, 5), (6,))


#: Seconds past the end a lane's attack in progress may take; one still running then is reported as hung.
LANE_GRACE_S = 30.0


def _lane(h: Hostile, table: dict[str, Any], tallies: dict[str, Tally], end: float) -> None:
    while not h.stop.is_set() and time.monotonic() < end:
        h.run += 1
        for name, (_, attack, _) in table.items():
            if h.stop.is_set() or time.monotonic() >= end:
                break
            t = tallies[name]
            t.runs += 1
            t._run_successes = 0
            t0 = time.monotonic()
            h.state["current"] = (name, t0)
            try:
                attack(h, t)
            except Exception as exc:  # an attack that could not even connect is an outcome, not a crash
                t.saw(f"raised_{type(exc).__name__}")
            t.direct_successes += t._run_successes
            if len(t.windows) < MAX_WINDOWS:
                t.windows.append([t0, time.monotonic(), t._run_successes])
            h.state.pop("current", None)


def run_hostile(plan: dict[str, Any], stop: threading.Event, seconds: float) -> tuple[dict[str, Tally], dict[str, float]]:
    """Run :func:`attacks` for ``seconds``, each lane of :data:`LANES` cycling through its kinds' attacks
    on its own thread (an attack in progress finishes; each is bounded). Returns the tallies and the
    attacks still running ``LANE_GRACE_S`` after the end (name -> seconds they had run: a hang)."""
    table = attacks()
    tallies = {name: Tally(kind, list(effects)) for name, (kind, _, effects) in table.items()}
    end = time.monotonic() + seconds
    ctx = zmq.Context()
    lanes = [(Hostile(plan, stop, ctx), {n: a for n, a in table.items() if a[0] in kinds}) for kinds in LANES]
    threads = [threading.Thread(target=_lane, args=(h, part, tallies, end), daemon=True) for h, part in lanes]
    hung: dict[str, float] = {}
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(max(0.0, end + LANE_GRACE_S - time.monotonic()))
        for h, _ in lanes:
            if "current" in h.state:
                name, t0 = h.state["current"]
                hung[name] = time.monotonic() - t0
    finally:
        stop.set()
        for h, _ in lanes:
            h.close()
        if not hung:
            ctx.destroy(0)  # (a hung lane's sockets would block it; the process exits anyway)
    return tallies, hung


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", type=Path, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--go", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)  # refusals are the point; client-side error logs are noise here
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    tallies: dict[str, Tally] = {}
    hung: dict[str, float] = {}
    error = ""
    try:
        if wait_for_file(a.go, stop, 180.0):
            tallies, hung = run_hostile(json.loads(a.plan.read_text()), stop, a.seconds)
    except Exception as exc:  # reported: the soak judges it
        error = f"{type(exc).__name__}: {exc}"
    if hung:
        error = f"attacks still running {LANE_GRACE_S:.0f} s after the end: {hung}"
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"error": error, "hung": hung, "attacks": {
        n: {k: v for k, v in asdict(x).items() if not k.startswith("_")} for n, x in tallies.items()}}))
    os.replace(tmp, a.out)
    os._exit(0)  # a hung lane's thread must not keep the process (and the soak) waiting


if __name__ == "__main__":
    raise SystemExit(main())
