"""Entry point of ``kvtier server``: build the config, start the service, stop on SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any

from kvtier.config import ConfigError, load_config
from kvtier.service.server import CacheServer, ServerOptions

log = logging.getLogger(__name__)


def default_socket_path() -> str:
    """``$XDG_RUNTIME_DIR/kvtier.sock``, else ``<tmp>/kvtier-<uid>/kvtier.sock`` (directory 0700)."""
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run:
        return os.path.join(run, "kvtier.sock")
    return os.path.join(tempfile.gettempdir(), f"kvtier-{os.getuid()}", "kvtier.sock")


def run_server(
    socket_path: str | None,
    overrides: dict[str, Any],
    tcp_host: str | None = None,
    tcp_port: int = 0,
    token_file: Path | None = None,
    metrics_host: str = "127.0.0.1",
    metrics_port: int | None = 9477,
    max_clients: int = 256,
    max_namespaces: int = 1,
) -> int:
    """Run the cache service until SIGTERM/SIGINT; returns the exit code.

    ``overrides`` are tier settings (``cpu_capacity``, ``disk_path``...) on top
    of ``KVTIER_*`` environment variables and ``config_file``.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config({k: v for k, v in overrides.items() if v is not None})
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    token = None
    if token_file is not None:
        token = token_file.read_text().strip()
        if not token:
            log.error("token file %s is empty", token_file)
            return 2
    options = ServerOptions(
        socket_path=socket_path or default_socket_path(),
        tcp_host=tcp_host,
        tcp_port=tcp_port,
        token=token,
        metrics_host=metrics_host,
        metrics_port=metrics_port,
        max_clients=max_clients,
        max_namespaces=max_namespaces,
    )
    try:
        server = CacheServer(config, options).start()
    except (RuntimeError, OSError) as exc:
        log.error("cannot start kvtier server: %s", exc)
        return 1
    stop = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    print(f"kvtier server ready on unix://{options.socket_path}", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.close()
    return 0
