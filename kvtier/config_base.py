"""The primitives every settings reader shares, below the config model and every plane.

- :class:`ConfigError`: the error of a refused setting or settings source.
- :func:`parse_address`: the cache service's address forms (``unix:///path``, ``/path``,
  ``tcp://host:port``), checked by the config model and dialled by the service client.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Union

from kvtier.hosts import check_host

#: A parsed service address: ``("unix", path)`` or ``("tcp", (host, port))``.
Address = tuple[str, Union[str, tuple[str, int]]]


class ConfigError(ValueError):
    """A configuration value or source is invalid; the message names the key and the source."""


#: Largest config file kvtier reads, in bytes (a real one is a few KiB; /dev/zero is not one).
MAX_CONFIG_FILE_BYTES = 1 << 20


def read_config_text(path: Path | str, what: str = "kvtier config file") -> str:
    """The text of a config file: a regular file of at most :data:`MAX_CONFIG_FILE_BYTES`, UTF-8
    (a leading byte-order mark is dropped, as editors on Windows write one).

    Checked before reading so that no input hangs or exhausts the process: a FIFO (opening one
    blocks until a writer comes), a device such as ``/dev/zero`` (endless), a directory.

    Raises:
        ConfigError: unreadable, not a regular file, too large, or not UTF-8; the message names
            ``what`` and the path.
    """
    path = Path(path)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {path} is not a regular file")
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_FILE_BYTES:
        raise ConfigError(f"{what} {path} is larger than {MAX_CONFIG_FILE_BYTES} bytes; is it a config file?")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})") from None


def parse_address(address: str) -> Address:
    """``unix:///path``, ``/path``, or ``tcp://host:port`` -> (family, address).

    Raises:
        ValueError: anything else.
    """
    if address.startswith("unix://"):
        path = address[len("unix://") :]
        if not path.startswith("/"):
            raise ValueError(f"Unix socket address must be unix:///absolute/path, got {address!r}")
        return "unix", path
    if address.startswith("/"):
        return "unix", address
    if address.startswith("tcp://"):
        host, sep, port = address[len("tcp://") :].rpartition(":")
        if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            raise ValueError(f"TCP address must be tcp://host:port (port 1-65535), got {address!r}")
        if host:
            try:
                check_host(host, wildcard=False)
            except ValueError as exc:
                raise ValueError(f"TCP address {address!r}: {exc}") from None
        return "tcp", (host.strip("[]") or "127.0.0.1", int(port))
    raise ValueError(f"server address must be unix:///path or tcp://host:port, got {address!r}")
