"""Helpers shared by the cache service tests (tests/test_service_*.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from kvtier.config import KVTierConfig
from kvtier.index.keys import KeyNamespace
from kvtier.service.client import ServiceClient
from kvtier.service.server import CacheServer, ServerOptions

from conftest import CHUNK, payload_for, small_namespace


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short temporary directory (Unix socket paths are limited to ~107 bytes)."""
    d = tempfile.mkdtemp(prefix="kvts-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def server_config(cpu_chunks: int = 16, disk_path: Path | None = None, **kw: object) -> KVTierConfig:
    cb = small_namespace().chunk_bytes
    fields: dict[str, object] = dict(chunk_size=CHUNK, cpu_capacity=cpu_chunks * cb, disk_path=disk_path)
    fields.update(kw)
    return KVTierConfig(**fields)  # type: ignore[arg-type]


def start_server(d: Path, cpu_chunks: int = 16, disk: bool = False, **opts: object) -> CacheServer:
    """An in-process server on ``d/s.sock`` (threads)."""
    cfg = server_config(cpu_chunks, d / "disk" if disk else None)
    return CacheServer(cfg, ServerOptions(socket_path=str(d / "s.sock"), **opts)).start()  # type: ignore[arg-type]


def connect(path: str | Path, ns: KeyNamespace | None = None, client_id: str = "engine-a", **kw: object) -> ServiceClient:
    """A client that waited (up to 20 s) for its first connection."""
    kw.setdefault("wait_connected_s", 20.0)
    kw.setdefault("timeout_s", 5.0)
    c = ServiceClient(str(path), ns or small_namespace(), client_id, **kw)  # type: ignore[arg-type]
    assert c.connected, "client did not connect"
    return c


def wait_until(pred: Callable[[], bool], timeout_s: float = 30.0, what: str = "condition") -> None:
    """Poll ``pred`` until true; fails the test after ``timeout_s`` (a hang guard, not a speed check)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout_s} s")


def start_server_process(d: Path, cpu_chunks: int = 16, disk: bool = True) -> subprocess.Popen:
    """``kvtier server`` in a child process on ``d/s.sock`` (tiny chunks, optional disk tier)."""
    cb = small_namespace().chunk_bytes
    cmd = [
        sys.executable, "-m", "kvtier.cli", "server", "--socket", str(d / "s.sock"),
        "--cpu-capacity", str(cpu_chunks * cb), "--no-metrics",
    ]
    if disk:
        cmd += ["--disk-path", str(d / "disk"), "--disk-capacity", str(1 << 20)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def store(c: ServiceClient, keys: list[bytes]) -> None:
    """Store ``keys`` as one chain through ``c`` (payloads from ``payload_for``); every slot must be granted."""
    parent = None
    for k in keys:
        buf = c.open_write(k, parent)
        assert buf is not None
        buf[:] = payload_for(k, c.chunk_bytes)
        c.commit(k, parent)
        parent = k
