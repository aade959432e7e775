"""Stopping child processes: SIGTERM, a bounded wait, then SIGKILL (one concept, for the
benchmarks' and demos' servers)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence


def stop_processes(procs: Sequence[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM each live process in ``procs``, wait up to ``timeout_s`` seconds in all, then SIGKILL
    those still running (and reap them)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
