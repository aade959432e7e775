"""Throwaway ``redis-server`` processes for tests (loopback only, no persistence).

Each :class:`RedisServerProcess` owns one child process it started and is the
only thing that signals it (by pid). Use it as a context manager or call
:meth:`stop` in teardown.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from kvtier.ports import free_port


def redis_server_binary() -> str | None:
    """Path of ``redis-server`` or None if it is not installed."""
    return shutil.which("redis-server")


def ping(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True if a Redis server answers PING on ``host:port`` within ``timeout_s`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServerProcess:
    """One standalone redis-server on 127.0.0.1:``port``.

    Args:
        port: TCP port (default: a free one).
        maxmemory: e.g. ``"64mb"``; None for unbounded.
        policy: ``maxmemory-policy``.
        extra_args: more ``redis-server`` arguments, e.g. ``("--enable-debug-command", "yes")``.

    Raises:
        FileNotFoundError: redis-server is not installed.
        RuntimeError: the server did not answer PING within 5 s of starting.
    """

    def __init__(
        self,
        port: int | None = None,
        maxmemory: str | None = None,
        policy: str = "allkeys-lru",
        extra_args: tuple[str, ...] = (),
    ):
        binary = redis_server_binary()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install -y redis-server)")
        self.binary = binary
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.policy = policy
        self.extra_args = tuple(extra_args)
        self.dir = tempfile.mkdtemp(prefix="kvtier-redis-test-")
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (or restart) the server, empty."""
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", self.dir, "--daemonize", "no", "--loglevel", "warning",
        ]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy]
        args += list(self.extra_args)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 5.0
        while not ping("127.0.0.1", self.port, 0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the server (as a crash would) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process must be able to die
            except ProcessLookupError:
                pass
            self.proc.kill()
            # SIGKILL cannot be ignored, but on a loaded machine the exit can take seconds.
            self.proc.wait(timeout=60)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server keeps its socket but answers nothing (a hung server)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Kill the server and remove its directory."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
