"""Throwaway Mooncake processes for tests and benchmarks (loopback only, nothing durable).

- :class:`MooncakeMasterProcess`: a ``mooncake_master`` on free 127.0.0.1 ports,
  with no metadata server (clients use ``P2PHANDSHAKE``; the master's embedded HTTP
  metadata server binds 0.0.0.0 whatever it is told) and its RPC and metrics
  servers bound to 127.0.0.1;
- :class:`SegmentOwnerProcess`: a ``mooncake_client`` that mounts a segment (holds
  pool memory) for clients that mount none, so a test can kill the owner;
- :class:`SilentServer`: a TCP port that accepts connections and never answers
  (a hung master);
- :func:`listening_addresses`: the TCP addresses a process listens on (from /proc).

Each object owns the child process it started and is the only thing that
signals it (by pid). Use them as context managers or call ``stop()``.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from kvtier.ports import PortPicker, free_port

__all__ = [
    "MooncakeMasterProcess", "SegmentOwnerProcess", "SilentServer", "listening_addresses",
    "mooncake_binary", "mooncake_missing",
]


def mooncake_binary(name: str) -> str | None:
    """Path of a binary shipped in the ``mooncake`` package (``mooncake_master``,
    ``mooncake_client``), or None when Mooncake is not installed. Does not import it."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        p = Path(d) / name
        if p.is_file():
            return str(p)
    return None


def mooncake_missing() -> str | None:
    """Why the Mooncake tests cannot run here (a line for ``pytest.skip``), or None if they can."""
    if mooncake_binary("mooncake_master") is None:
        return "Mooncake is not installed (pip install --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1)"
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"mooncake.store cannot be imported ({exc}); apt-get install -y libibverbs1"
    return None


def _accepts(port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket process ``pid`` listens on (IPv4 and IPv6).

    Reads ``/proc/<pid>/fd`` and ``/proc/<pid>/net/tcp{,6}``; addresses are dotted IPv4 or
    IPv6 hex groups (``"0.0.0.0"``, ``"127.0.0.1"``, ``"::"``).
    """
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if v6:
                words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
                addr = socket.inet_ntop(socket.AF_INET6, b"".join(words))
            else:
                addr = socket.inet_ntoa(raw[::-1])
            out.append((addr, int(hexport, 16)))
    return out



def wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Wait until ``pid`` is in the stopped state (``T`` in ``/proc/PID/stat``) after a SIGSTOP:
    the signal is only queued when ``kill`` returns, and on a loaded machine the process may
    still run (and answer) for a moment."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    return
        except OSError:
            return  # no /proc (or gone): nothing more to wait for
        time.sleep(0.005)


class _Pausable:
    """SIGSTOP / SIGCONT of a child process ``proc``: stopped, it keeps its sockets but answers nothing."""

    proc: subprocess.Popen | None

    def pause(self) -> None:
        """Stop the process; returns once it is stopped."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        wait_stopped(self.proc.pid)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

class MooncakeMasterProcess(_Pausable):
    """One ``mooncake_master`` on 127.0.0.1, no metadata server, in memory only.

    Args:
        port: RPC port (default: a free one); ``url`` is ``mooncake://127.0.0.1:PORT``.
        extra_args: more master flags, e.g. ``("--default_kv_lease_ttl=1000",)``.

    Raises:
        FileNotFoundError: Mooncake is not installed.
        RuntimeError: the master did not accept connections within 20 s.
    """

    def __init__(self, port: int | None = None, extra_args: tuple[str, ...] = ()):
        binary = mooncake_binary("mooncake_master")
        if binary is None:
            raise FileNotFoundError("mooncake_master is not installed (pip install mooncake-transfer-engine-non-cuda)")
        self.binary = binary
        ports = PortPicker()
        self.port = port or ports.pick()
        self.metrics_port = ports.pick()
        self.extra_args = tuple(extra_args)
        self.dir = tempfile.mkdtemp(prefix="kvtier-mooncake-test-")
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start (or restart) the master, empty, on the same ports."""
        args = [
            self.binary, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
            f"--metrics_port={self.metrics_port}", "--metrics_host=127.0.0.1",
            "--enable_http_metadata_server=false", f"--log_dir={self.dir}", *self.extra_args,
        ]
        log = open(os.path.join(self.dir, "master.out"), "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)
        log.close()
        deadline = time.monotonic() + 20.0
        while not _accepts(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"mooncake_master on port {self.port} did not start (see {self.dir})")
            time.sleep(0.02)

    def listening(self) -> list[tuple[str, int]]:
        """The addresses the running master listens on (see :func:`listening_addresses`)."""
        assert self.proc is not None
        return listening_addresses(self.proc.pid)

    def kill(self) -> None:
        """SIGKILL the master (as a crash would) and reap it: every key is lost."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.kill()
            self.proc.wait(timeout=60)
        self.proc = None

    def stop(self) -> None:
        """Kill the master and remove its directory."""
        self.kill()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "MooncakeMasterProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SegmentOwnerProcess(_Pausable):
    """A ``mooncake_client`` that mounts ``segment_bytes`` of pool memory on ``master``.

    Raises:
        FileNotFoundError: Mooncake is not installed. RuntimeError: it did not come up in 20 s.
    """

    def __init__(self, master: str, segment_bytes: int = 256 << 20):
        binary = mooncake_binary("mooncake_client")
        if binary is None:
            raise FileNotFoundError("mooncake_client is not installed")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvtier-mooncake-owner-")
        args = [
            binary, "--host=127.0.0.1", f"--port={self.port}", f"--global_segment_size={segment_bytes}",
            f"--master_server_address={master}", "--metadata_server=P2PHANDSHAKE", f"--log_dir={self.dir}",
        ]
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
        log = open(os.path.join(self.dir, "owner.out"), "ab")
        self.proc: subprocess.Popen | None = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir, env=env
        )
        log.close()
        deadline = time.monotonic() + 20.0
        while not _accepts(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_client on port {self.port} did not start (see {self.dir})")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the owner: the chunks in its segment are gone."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=60)
        self.proc = None

    def stop(self) -> None:
        """SIGTERM (it unmounts its segment, so the master stops placing chunks there), SIGKILL
        if it has not exited within 15 s; remove its directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "SegmentOwnerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SilentServer:
    """A 127.0.0.1 TCP port that accepts every connection and never sends a byte (a hung
    master); ``url`` names it as a Mooncake master. Closes its sockets on :meth:`stop`."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="silent-master", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        self._sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self._conns.append(conn)

    @property
    def accepted(self) -> int:
        """Connections accepted so far."""
        return len(self._conns)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for c in self._conns:
            c.close()
        self._sock.close()

    def __enter__(self) -> "SilentServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
