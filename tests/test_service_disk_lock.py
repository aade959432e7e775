"""A second ``kvtier server`` (or an engine) on a disk directory a live server uses is refused at
start, exit 2, never "ready".

Failing input (a fresh user's trial): the lock was taken per model namespace (``ns-*/.lock``)
only when the first engine registered, so a second server on the same ``--disk-path`` printed
"ready" and then failed every registration with a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CHUNK, small_namespace
from kvtier.config import ConfigError, KVTierConfig
from kvtier.service.server import CacheServer, ServerOptions
from kvtier.storage.manager import StorageManager
from kvtier.tiers.disk import DiskTierLocked
from service_helpers import short_dir, start_server_process  # noqa: F401 (fixture)


def server_cmd(sock: Path, disk: Path) -> list[str]:
    cb = small_namespace().chunk_bytes
    return [sys.executable, "-m", "kvtier.cli", "server", "--socket", str(sock), "--cpu-capacity", str(16 * cb),
            "--no-metrics", "--disk-path", str(disk), "--disk-capacity", str(1 << 20)]


@pytest.mark.slow
def test_second_server_on_the_same_disk_path_exits_2(short_dir: Path) -> None:  # noqa: F811
    first = start_server_process(short_dir)  # disk at short_dir / "disk"
    try:
        seen = []
        while not any("ready" in line for line in seen):
            line = first.stdout.readline()  # type: ignore[union-attr]
            assert line, "".join(seen)
            seen.append(line)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        (short_dir / "b").mkdir()
        second = subprocess.run(server_cmd(short_dir / "b" / "s.sock", short_dir / "disk"), env=env,
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second.stdout + second.stderr
        assert "ready" not in second.stdout and "Traceback" not in second.stderr
        assert "disk_path" in second.stderr and str(first.pid) in second.stderr, second.stderr
        # An engine pointed at the same directory is refused too (it would share the files).
        cfg = KVTierConfig(chunk_size=CHUNK, cpu_capacity=1 << 20, disk_path=short_dir / "disk", disk_capacity=1 << 20)  # type: ignore[arg-type]
        with pytest.raises((ConfigError, DiskTierLocked), match="another process"):
            StorageManager(cfg, small_namespace())
    finally:
        first.terminate()
        first.wait(30)
    # Released with the server: the directory is usable again.
    srv = CacheServer(KVTierConfig(cpu_capacity=1 << 20, disk_path=short_dir / "disk", disk_capacity=1 << 20),  # type: ignore[arg-type]
                      ServerOptions(socket_path=str(short_dir / "c.sock")))
    srv.close()
