"""The primitives every settings reader shares, below the config model and every plane.

- :class:`ConfigError`: the error of a refused setting or settings source.
- :func:`parse_address`: the cache service's address forms (``unix:///path``, ``/path``,
  ``tcp://host:port``), checked by the config model and dialled by the service client.
"""

from __future__ import annotations

from typing import Union

from kvtier.hosts import check_host

#: A parsed service address: ``("unix", path)`` or ``("tcp", (host, port))``.
Address = tuple[str, Union[str, tuple[str, int]]]


class ConfigError(ValueError):
    """A configuration value or source is invalid; the message names the key and the source."""


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
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"TCP address must be tcp://host:port (port 1-65535), got {address!r}")
        if host:
            try:
                check_host(host)
            except ValueError as exc:
                raise ValueError(f"TCP address {address!r}: {exc}") from None
        return "tcp", (host.strip("[]") or "127.0.0.1", int(port))
    raise ValueError(f"server address must be unix:///path or tcp://host:port, got {address!r}")
