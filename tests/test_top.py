"""``kvtier top`` through a pseudo-terminal (issue 13).

Failing inputs: a view that needs a real terminal or never draws; numbers that differ
from ``/metrics``; an unreachable endpoint that crashes (traceback) or exits 0; Ctrl-C
that leaves a traceback.
"""

from __future__ import annotations

import pytest

import os
import pty
import select
import signal
import sys
import time
import urllib.request
from pathlib import Path

from service_helpers import connect, short_dir, start_server, store  # noqa: F401 (fixture)

from kvtier.dashboard.samples import parse_exposition

KEYS = [bytes([i + 1]) * 32 for i in range(5)]


def run_in_pty(args: list[str], until: bytes | None = None, timeout_s: float = 60.0) -> tuple[int, str]:
    """Run ``python -m kvtier.cli *args`` on a pseudo-terminal (80x40); with ``until``, send Ctrl-C
    once that text was drawn. Returns (exit status, everything drawn)."""
    pid, fd = pty.fork()
    if pid == 0:  # child: the pty is its controlling terminal
        os.environ["COLUMNS"], os.environ["LINES"] = "120", "40"
        # A terminal's signals as a user's shell gives them: an ignored or blocked signal survives exec, and
        # something earlier in this test process (a library of another test) may have set SIGINT
        # to SIG_IGN, so Ctrl-C was ignored and the full suite's run of the Ctrl-C test hung.
        for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])  # a blocked mask survives exec too
        os.execv(sys.executable, [sys.executable, "-m", "kvtier.cli", *args])
    out = b""
    sent = False
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        if until is not None and not sent and until in out:
            os.write(fd, b"\x03")  # Ctrl-C through the terminal's line discipline
            sent = True
    else:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


@pytest.mark.slow
def test_top_draws_the_server_tiers_in_a_terminal(short_dir: Path) -> None:  # noqa: F811
    with start_server(short_dir, metrics_port=0) as srv:
        c = connect(short_dir / "s.sock")
        store(c, KEYS[:4])
        for _ in range(3):
            c.lookup_keys(KEYS, None)
        url = f"http://127.0.0.1:{srv.metrics_port}"
        code, screen = run_in_pty(["top", url, "--count", "3", "--interval", "0.3"])
        metrics = parse_exposition(urllib.request.urlopen(url + "/metrics", timeout=10).read().decode())
        c.close()
    assert code == 0, screen
    assert "kvtier top" in screen and "tiers" in screen and "hot prefixes" in screen
    assert "\x1b[" in screen  # drawn as a live terminal view (cursor control), not plain lines
    cpu_line = next(line for line in screen.splitlines() if "│ cpu" in line or line.strip().startswith("cpu"))
    assert f" {int(metrics['kvtier_cpu_chunks'])} " in cpu_line, cpu_line
    assert "80.0%" in screen  # token hit rate: 4 of 5 chunks
    assert KEYS[3].hex()[:16] in screen  # the hot chain, named by its last key
    assert "Traceback" not in screen


@pytest.mark.slow
def test_top_unreachable_and_ctrl_c() -> None:
    code, screen = run_in_pty(["top", "http://127.0.0.1:9", "--count", "2", "--interval", "0.1"])
    assert code == 2 and "Connection refused" in screen and "Traceback" not in screen, screen
    code, screen = run_in_pty(["top", "http://127.0.0.1:9", "--interval", "0.1"], until=b"retrying")
    assert code == 0 and "Traceback" not in screen, screen


@pytest.mark.slow
def test_top_through_a_pipe_prints_every_frame_uncut(short_dir: Path) -> None:  # noqa: F811
    """Batch mode: piped, every frame is printed (a Live view would print only the last) and
    the tiers table keeps its last column (a pipe's default 80 columns cut it)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    with start_server(short_dir, metrics_port=0) as srv:
        c = connect(short_dir / "s.sock")
        store(c, KEYS[:2])
        url = f"http://127.0.0.1:{srv.metrics_port}"
        # The metrics URL the server prints is accepted too (it used to be a 404, retried forever).
        out = subprocess.run([sys.executable, "-m", "kvtier.cli", "top", url + "/metrics", "--count", "2", "--interval", "0.2"],
                             capture_output=True, text=True, timeout=60, env=env)
        c.close()
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("kvtier top") == 2, out.stdout
    assert "hit rate" in out.stdout.split("tiers", 1)[1] and "…" not in out.stdout.split("hot prefixes")[0], out.stdout
    assert "\x1b[" not in out.stdout  # plain text for a file or pipe
