"""Entry point of ``kvtier server``: build the config, start the service, stop on SIGTERM/SIGINT."""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any

from kvtier.config import ConfigError, load_config
from kvtier.protocol.transport import private_runtime_dir
from kvtier.service.server import CacheServer, ServerOptions

log = logging.getLogger(__name__)
#: ``kvtier server`` flags whose name is not the setting's (for error messages naming the flag).
_FLAG_OF = {"config_file": "--config", "peers": "--peer"}
#: Bind failures: the address is taken, not on this machine, or needs privileges.
_BIND_ERRNOS = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES})


def default_socket_path() -> str:
    """``$XDG_RUNTIME_DIR/kvtier.sock``, else ``<tmp>/kvtier-<uid>/kvtier.sock`` (directory 0700)."""
    return os.path.join(private_runtime_dir(), "kvtier.sock")


def check_tcp_host(tcp_host: str | None, allow_remote: bool) -> str | None:
    """Why ``tcp_host`` must not be listened on, or None.

    A name or address that is not loopback (``0.0.0.0``, ``::``, a LAN address
    or a host name that resolves to one) needs ``allow_remote``.
    """
    if tcp_host is None or allow_remote:
        return None
    try:
        infos = socket.getaddrinfo(tcp_host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        return f"--tcp-host {tcp_host!r} does not resolve: {exc}"
    if all(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]).is_loopback for info in infos):
        return None
    return (
        f"--tcp-host {tcp_host!r} is not a loopback address: other machines could connect; "
        "add --allow-remote to mean it, or use 127.0.0.1"
    )


#: glibc's ``mallopt`` parameter number of ``M_ARENA_MAX`` (malloc.h).
_M_ARENA_MAX = -8
#: Malloc arenas the server keeps (glibc's default is 8 per core).
SERVER_MALLOC_ARENAS = 2


def limit_malloc_arenas(arenas: int = SERVER_MALLOC_ARENAS) -> bool:
    """Bound glibc's malloc arenas before the server starts its threads.

    With glibc's default (up to 8 arenas per core, one taken by each thread that finds the others
    locked) the server's connection, write-behind and HTTP threads each grew their own arena under
    client churn and freed memory stayed spread over them: ``kvtier bench soak`` measured server RSS
    +14% over 10 minutes (124.7 -> 142.2 MiB), and +1.5% over 5 minutes with 2 arenas. The server's
    hot path copies bytes in shared memory, not through malloc, so fewer arenas cost no throughput.
    A ``MALLOC_ARENA_MAX`` set in the environment wins (glibc reads it itself). No-op off glibc.

    Returns:
        True if the limit was set here.
    """
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_ARENA_MAX, arenas))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to bound
        return False


def run_server(
    socket_path: str | None,
    overrides: dict[str, Any],
    tcp_host: str | None = None,
    tcp_port: int = 0,
    token_file: Path | None = None,
    metrics_host: str = "127.0.0.1",
    metrics_port: int | None = 9477,
    max_clients: int = 256,
    max_namespaces: int = 8,
    allow_remote: bool = False,
    extra_options: dict[str, Any] | None = None,
) -> int:
    """Run the cache service until SIGTERM/SIGINT; returns the exit code.

    ``overrides`` are tier settings (``cpu_capacity``, ``disk_path``...) on top
    of ``KVTIER_*`` environment variables and ``config_file``. Exit codes: 0
    after a clean stop, 2 for a setting that cannot work (the message names the
    key and its source; "ready" is never printed), 1 when it cannot listen.

    TCP: the token comes from ``token_file`` (first line) or else the
    ``server_token`` setting; a ``tcp_host`` that is not a loopback address is
    refused unless ``allow_remote`` (every machine that reaches it may try tokens).
    ``extra_options``: further :class:`ServerOptions` fields (quotas, namespaces).
    The fleet options (``controller``, ``instance_id``, ``controller_token``,
    ``kv_events_endpoint``, ``kv_events_replay_endpoint``) come from the settings of
    the same names (``overrides``, ``KVTIER_*``, the config file) unless
    ``extra_options`` gives them.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limit_malloc_arenas()  # first: before any thread exists
    try:
        config = load_config(
            {k: v for k, v in overrides.items() if v is not None},
            flags={k: _FLAG_OF.get(k, "--" + k.replace("_", "-")) for k in overrides},
        )
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    logging.getLogger("kvtier").setLevel(config.log_level)
    problem = check_tcp_host(tcp_host, allow_remote)
    if problem:
        log.error("%s", problem)
        return 2
    token = config.server_token
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            log.error("cannot read token file %s (--token-file): %s", token_file, exc.strerror or exc)
            return 2
        if not token:
            log.error("token file %s (--token-file) is empty", token_file)
            return 2
        if token_file.stat().st_mode & 0o077:
            log.warning("token file %s (--token-file) is readable by other users; chmod 600 it", token_file)
    if tcp_host is not None and not token:
        log.error("--tcp-host needs a token: --token-file FILE or the server_token setting (KVTIER_SERVER_TOKEN)")
        return 2
    fleet = {
        "controller": config.controller,
        "instance_id": config.instance_id,
        "controller_token": config.controller_token,
        "kv_events_endpoint": config.kv_events_endpoint,
        "kv_events_replay_endpoint": config.kv_events_replay_endpoint,
    }
    fleet.update({k: v for k, v in (extra_options or {}).items() if k in fleet})
    try:
        options = ServerOptions(
            socket_path=socket_path or default_socket_path(),
            tcp_host=tcp_host,
            tcp_port=tcp_port,
            token=token,
            metrics_host=metrics_host,
            metrics_port=metrics_port,
            max_clients=max_clients,
            max_namespaces=max_namespaces,
            **{**(extra_options or {}), **fleet},
        )
    except ValueError as exc:
        log.error("cannot start kvtier server: %s", exc)
        return 2
    try:
        server = CacheServer(config, options)
    except (ConfigError, RuntimeError) as exc:
        log.error("%s", exc)
        return 2
    stop = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        stop.set()

    # Before start: a SIGTERM while the server starts (its fleet agent may already have registered,
    # a supervisor may already stop it) must still end in a clean close, not a kill.
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        server.start()
    except (RuntimeError, OSError, ValueError) as exc:
        log.error("cannot start kvtier server: %s", exc)
        server.close()  # what start() had bound (the Unix socket, threads) goes too
        # An address that is taken or not ours to bind, or unusable fleet credentials (a key file others
        # can read, a members file others can write: ValueError), are settings that cannot work (2, like
        # the config errors above); anything else failed while starting (1).
        return 2 if isinstance(exc, ValueError) or (isinstance(exc, OSError) and exc.errno in _BIND_ERRNOS) else 1
    print(f"kvtier server ready on unix://{options.socket_path}", flush=True)
    try:
        while not stop.wait(0.2):
            pass
    finally:
        server.close()
    return 0
