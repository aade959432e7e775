"""Shared fixtures for kvtier's unit tests.

Everything here is deliberately tiny: a layout of 2 layers x 1 KV head x 8 dims
in float16 is 64 bytes per token, so a 32-token chunk is 2 KiB and a disk file
4 KiB + 2 KiB. Tests therefore move kilobytes, never megabytes.
"""

from __future__ import annotations

import signal
import socket
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from kvtier.config import KVTierConfig
from kvtier.index.keys import ChunkHasher, KeyNamespace, LayoutSignature
from kvtier.ports import PortPicker
from kvtier.testing.redis_server import ping
from skip_guard import pytest_configure, pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (hooks)

#: Tokens per chunk in the small namespace (two 16-token engine blocks).
CHUNK = 32

#: The CI's Redis servers (``.ci/redis.sh start``; ``scripts/test.sh`` starts them): a standalone
#: server and the first node of a 3-node cluster, both on loopback.
CI_REDIS = ("127.0.0.1", 6399)
CI_REDIS_CLUSTER = ("127.0.0.1", 7100)
REDIS_HINT = "start the CI servers with `bash .ci/redis.sh start` (scripts/test.sh does)"


#: The test session's one port picker: below the ephemeral range, and never the same port twice
#: in a session (see :mod:`kvtier.ports` for the CI flakes port 0 caused).
_PORTS = PortPicker()


def free_port() -> int:
    """A loopback TCP port nothing listens on at the time of the call, never handed out before in this session."""
    return _PORTS.pick()


def wait_until(pred: Callable[[], object], timeout_s: float = 30.0, what: str = "condition", step_s: float = 0.01) -> float:
    """Poll ``pred`` until it is true; returns the seconds it took.

    A hang guard, never a speed check: ``timeout_s`` is generous. Raises AssertionError naming
    ``what`` when it did not hold within ``timeout_s`` seconds.
    """
    t0 = time.monotonic()
    while True:
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(step_s)


def http_status(sock: socket.socket, timeout_s: float = 10.0) -> int:
    """The status code of the HTTP answer arriving on ``sock`` (0 if it closes first)."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return 0
        data += chunk
    return int(data.split(b" ", 2)[1])


def require_redis(cluster: bool = False) -> tuple[str, int]:
    """The CI's Redis (or Redis Cluster) address; skips the test, naming Redis, when it does not answer PING
    (``KVTIER_TEST_REQUIRE=redis`` turns that skip into a failure)."""
    host, port = CI_REDIS_CLUSTER if cluster else CI_REDIS
    if not ping(host, port):
        pytest.skip(f"no Redis {'Cluster ' if cluster else ''}on {host}:{port}; {REDIS_HINT}")
    return host, port


def small_layout(**changes: object) -> LayoutSignature:
    """A 64-bytes-per-token layout; keyword arguments replace single fields."""
    fields: dict[str, object] = dict(
        engine="test",
        attn_backend="TEST_ATTN",
        kv_layout="LBHNC",
        block_size=16,
        num_layers=2,
        num_kv_heads=1,
        head_dim=8,
        dtype="float16",
    )
    fields.update(changes)
    return LayoutSignature(**fields)  # type: ignore[arg-type]


def small_namespace(**changes: object) -> KeyNamespace:
    """A 32-token-chunk namespace (2,048-byte chunks); keyword arguments replace fields."""
    fields: dict[str, object] = dict(model="test/tiny-model", layout=small_layout(), chunk_size=CHUNK)
    fields.update(changes)
    return KeyNamespace(**fields)  # type: ignore[arg-type]


def payload_for(key: bytes, nbytes: int) -> np.ndarray:
    """Deterministic uint8 payload of ``nbytes`` derived from ``key`` (distinct per key)."""
    reps = -(-nbytes // len(key))
    data = np.frombuffer(key * reps, dtype=np.uint8)[:nbytes].copy()
    data[: min(8, nbytes)] ^= np.arange(min(8, nbytes), dtype=np.uint8)
    return data


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every ``vllm`` test (it starts vLLM on the real model) is also ``slow``: ``-m "not slow"`` leaves it out."""
    for item in items:
        if item.get_closest_marker("vllm") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def redis_url() -> str:
    """``redis://`` URL of the CI's standalone Redis, database 0 (skips without it: :func:`require_redis`)."""
    host, port = require_redis()
    return f"redis://{host}:{port}/0"


@pytest.fixture
def namespace() -> KeyNamespace:
    return small_namespace()


@pytest.fixture
def hasher(namespace: KeyNamespace) -> ChunkHasher:
    return ChunkHasher(namespace)


@pytest.fixture
def chunk_bytes(namespace: KeyNamespace) -> int:
    assert namespace.chunk_bytes == 2048
    return namespace.chunk_bytes


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    """An empty directory for one disk tier."""
    d = tmp_path / "disk"
    d.mkdir()
    return d


@pytest.fixture
def make_key() -> Callable[[int], bytes]:
    """Distinct 32-byte keys by integer (for tier tests that need no real prompt)."""

    def make(i: int) -> bytes:
        return i.to_bytes(4, "little") * 8

    return make


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[..., KVTierConfig]:
    """KVTierConfig for the small namespace: ``cpu_chunks``/``disk_chunks`` size the tiers in chunks.

    ``disk_chunks=0`` leaves the disk tier off. Other keyword arguments pass through.
    """

    def make(cpu_chunks: int = 8, disk_chunks: int = 0, **kw: object) -> KVTierConfig:
        chunk_bytes = small_namespace().chunk_bytes
        fields: dict[str, object] = dict(chunk_size=CHUNK, cpu_capacity=cpu_chunks * chunk_bytes)
        if disk_chunks:
            from kvtier.tiers.disk import HEADER_BYTES

            fields.update(
                disk_path=tmp_path / "mgr-disk",
                disk_capacity=disk_chunks * (HEADER_BYTES + chunk_bytes),
            )
        fields.update(kw)
        return KVTierConfig(**fields)  # type: ignore[arg-type]

    return make


@pytest.fixture
def fleet(tmp_path: Path):
    """Fleet keys of members ``a``, ``b``, ``c`` and their members file (kvtier.testing.fleet_keys):
    ``fleet.config("a")`` is member a's ``fleet_key``/``fleet_members`` settings."""
    from kvtier.testing.fleet_keys import make_fleet

    return make_fleet(tmp_path / "fleet-keys", ["a", "b", "c"])


def _signal_masks() -> tuple[int, int]:
    """This process's ignored and blocked signal masks as the kernel holds them (``SigIgn`` and
    ``SigBlk`` of /proc/self/status; 0 where not readable): changes made from C are seen too,
    unlike ``signal.getsignal``. Both survive exec, so both reach every later child."""
    masks = {"SigIgn:": 0, "SigBlk:": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                head = line[:7]
                if head in masks:
                    masks[head] = int(line.split()[1], 16)
    except OSError:
        pass
    return masks["SigIgn:"], masks["SigBlk:"]


_WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_WATCHED = sum(1 << (s - 1) for s in _WATCHED_SIGNALS)
#: The masks this test process started with: a change by a module- or session-scoped fixture is
#: seen at the end of the first test after it, not taken as the state to keep.
_SESSION_IGNORED, _SESSION_BLOCKED = (m & _WATCHED for m in _signal_masks())


@pytest.fixture(autouse=True)
def _terminal_signals_kept(request: pytest.FixtureRequest):
    """A test (or a fixture, or a library it starts in-process) that leaves SIGINT or SIGTERM
    ignored or blocked changes every later child of this process (both survive exec: a Ctrl-C test
    hung on an ignored SIGINT). Such a change is undone after the test, with a warning naming it."""
    yield
    ignored, blocked = _signal_masks()
    new_ignored = ignored & _WATCHED & ~_SESSION_IGNORED
    new_blocked = blocked & _WATCHED & ~_SESSION_BLOCKED
    if new_ignored or new_blocked:
        for sig in _WATCHED_SIGNALS:
            if new_ignored & (1 << (sig - 1)):
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        unblock = [sig for sig in _WATCHED_SIGNALS if new_blocked & (1 << (sig - 1))]
        if unblock:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, unblock)
        warnings.warn(f"{request.node.nodeid} (or a fixture before it) left signals ignored {new_ignored:#x}, "
                      f"blocked {new_blocked:#x}; restored", stacklevel=1)
