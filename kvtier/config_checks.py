"""Start-up checks of a config that need the machine or the model (server start, manager open).

- ``disk_path`` must be a creatable, writable directory not locked by another
  live process (a second server or engine on the same directory would miss for
  every engine);
- each capacity must hold one chunk of the model's real size (with the size
  still unknown, e.g. a server before any engine registers, below 1 MiB is a
  WARNING).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from pathlib import Path

from kvtier.config import KVTierConfig
from kvtier.config_base import ConfigError

#: Below this a capacity is legal but almost surely a unit mistake (warned when the chunk size is unknown).
WARN_CAPACITY_BYTES = 1 << 20

log = logging.getLogger(__name__)


def probe_dir(path: Path) -> None:
    """Create ``path`` (and parents) owner-only (0700) if missing and write, then delete, a temporary file in it.

    The directory will hold users' cached KV: created 0700 like every directory the
    disk tier makes (an existing directory's mode is left to its owner).

    Raises:
        OSError: the directory cannot be created or written.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".kvtier-probe-", dir=path)
    os.close(fd)
    os.unlink(name)


def lock_holder(path: Path) -> str | None:
    """The pid recorded by the live process that holds the disk tier lock ``path/.lock``
    (or of a server's ``path/ns-*/.lock``), or None when no live process holds one.

    Probes with a non-blocking ``flock`` on a fresh descriptor, released at once;
    creates nothing.
    """
    for lock in [path / ".lock", *sorted(path.glob("ns-*/.lock"))]:
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            except OSError:
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    return None


def validate_config(config: KVTierConfig, chunk_bytes: int | None = None) -> None:
    """Check what needs the machine or the model, when the tiers open (server start, manager open).

    Args:
        config: the effective settings.
        chunk_bytes: bytes of one chunk of the model (None: not known yet, e.g.
            a server before any engine registers; then capacities below 1 MiB
            only log a warning).

    Raises:
        ConfigError: ``disk_path`` is not a creatable, writable directory or is
            locked by another live process, or
            ``cpu_capacity``/``disk_capacity`` is below one chunk; the message
            names the key, its source and the value.
    """
    if config.disk_path is not None:
        try:
            probe_dir(Path(config.disk_path))
        except OSError as exc:
            raise ConfigError(
                f"invalid kvtier config: disk_path (from {config.source_of('disk_path')}): "
                f"{config.disk_path} is not a creatable, writable directory: {exc.strerror or exc}"
            ) from None
        holder = lock_holder(Path(config.disk_path))
        if holder is not None:
            raise ConfigError(
                f"invalid kvtier config: disk_path (from {config.source_of('disk_path')}): {config.disk_path} "
                f"is in use by another process (pid {holder}); give each server or engine its own directory"
            )
    sizes = [("cpu_capacity", int(config.cpu_capacity))]
    if config.disk_path is not None:
        sizes.append(("disk_capacity", int(config.disk_capacity)))
    for key, value in sizes:
        if chunk_bytes is not None and value < chunk_bytes:
            raise ConfigError(
                f"invalid kvtier config: {key} (from {config.source_of(key)}): {value} B is below one chunk "
                f"({chunk_bytes} B for this model and chunk_size {config.chunk_size})"
            )
        if chunk_bytes is None and value < WARN_CAPACITY_BYTES:
            log.warning(
                "kvtier config: %s (from %s) is only %d B; sizes are bytes (e.g. '4GiB'), "
                "and a tier smaller than one chunk is refused when the model is known",
                key, config.source_of(key), value,
            )
