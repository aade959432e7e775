"""The machine's own latency floor during a fleet soak: what no kvtier code path can go below.

A lookup's p99 on a loaded machine is bounded below by the operating system: a process woken by
a reply waits for a CPU, and every process hop a lookup makes (client -> server, and on a local
miss server -> controller and server -> peer) can wait again. This probe measures that floor in
the same run, beside the fleet, with no kvtier code in the path, so the soak's lookup p99 can be
read against it (issue 24: "lookup p99 stays under 10 ms" on a 2-core machine running ~15 fleet
processes).

Every ``PERIOD_S`` it records two figures, each ``[monotonic seconds, milliseconds]``:

- ``wake_ms``: how much later than asked a 1 ms ``time.sleep`` returned (scheduler wake-up
  latency: the time a runnable process waits for a CPU);
- ``echo_ms``: the round trip of one byte to a child process and back over a Unix socket pair
  (one process hop each way, the smallest IPC a lookup makes).

It runs at the clients' niceness, as one more well-behaved process of the soak. Usage (from
:mod:`kvtier.bench.soak_fleet`): ``python -m kvtier.bench.soak_fleet_floor --seconds S --go PATH
--out PATH``; it starts measuring once ``--go`` exists and writes its JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

#: Seconds between samples.
PERIOD_S = 0.01
#: The sleep whose overshoot is measured, seconds.
NAP_S = 0.001
#: Longest a round trip may take before the probe stops (the child died or was stopped), seconds.
ECHO_TIMEOUT_S = 5.0
#: Longest run, seconds (a day, like the soak's own bound).
MAX_SECONDS = 86_400.0
#: Longest wait for the ``--go`` file, seconds.
GO_WAIT_S = 300.0


def _echo_child(sock: socket.socket) -> None:
    """Answer every byte with the same byte until the other end closes (runs in the forked child)."""
    try:
        while (b := sock.recv(1)):
            sock.sendall(b)
    finally:
        os._exit(0)


def measure(seconds: float) -> dict[str, Any]:
    """Sample for ``seconds``; returns ``{"wake_ms": [[t, ms], ...], "echo_ms": [[t, ms], ...],
    "stopped_early": None or why}`` (the echo child died or stalled past ``ECHO_TIMEOUT_S``: the
    samples so far stand, the stalled round trip is not one of them).

    Raises:
        OSError: the socket pair or the fork failed.
    """
    parent, child = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        parent.close()
        _echo_child(child)
    child.close()
    parent.settimeout(ECHO_TIMEOUT_S)
    wake: list[list[float]] = []
    echo: list[list[float]] = []
    stopped: str | None = None
    end = time.monotonic() + seconds
    try:
        while (now := time.monotonic()) < end:
            t0 = time.perf_counter()
            time.sleep(NAP_S)
            wake.append([now, max(0.0, (time.perf_counter() - t0 - NAP_S) * 1e3)])
            t0 = time.perf_counter()
            try:
                parent.sendall(b"x")
                if parent.recv(1) != b"x":
                    stopped = "the echo child closed its end"
                    break
            except OSError as exc:  # the child died or stalled past the timeout: what was measured stands
                stopped = f"the echo child did not answer ({type(exc).__name__})"
                break
            echo.append([now, (time.perf_counter() - t0) * 1e3])
            time.sleep(max(0.0, PERIOD_S - (time.monotonic() - now)))
    finally:
        parent.close()
        try:  # a stopped (SIGSTOP) child would never exit on its own: never wait on it
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    return {"wake_ms": wake, "echo_ms": echo, "stopped_early": stopped}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtier.bench.soak_fleet_floor")
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--go", type=Path, required=True, help="start once this file exists")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if not (math.isfinite(a.seconds) and 0 < a.seconds <= MAX_SECONDS):
        ap.error(f"--seconds must be in (0, {MAX_SECONDS:g}], got {a.seconds}")
    if not a.out.parent.is_dir() or a.out.is_dir():
        ap.error(f"--out {a.out}: not a file in an existing directory")
    deadline = time.monotonic() + GO_WAIT_S
    while not a.go.is_file():
        if time.monotonic() > deadline:
            print(f"soak_fleet_floor: {a.go} did not appear within {GO_WAIT_S:g} s; nothing measured", file=sys.stderr)
            return 2
        time.sleep(0.05)
    a.out.write_text(json.dumps(measure(a.seconds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
