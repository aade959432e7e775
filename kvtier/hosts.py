"""The HOST of a ``scheme://HOST:PORT`` setting, checked when the setting is read, not when it is used.

Every address setting (``peer_listen``, ``peers``, ``controller``, ``peer_discovery``, the KV
event endpoints, the server's ``tcp://`` address) is split at its last ``:`` into HOST and PORT.
The PORT was always checked; the HOST was not, so ``tcp://[::1:0`` (a bracket left open) passed
``kvtier config-check`` and failed only when the server started, as "Invalid IPv6 URL". The
split at the last colon also takes ``tcp://::1:5555`` (IPv6 without brackets) for host ``::1``,
which no socket library reads the same way. :func:`check_host` refuses both kinds, and any host
that is not a DNS name, an IPv4 address or a bracketed IPv6 address (RFC 3986 section 3.2.2).
"""

from __future__ import annotations

import ipaddress
import re

#: A DNS name or an IPv4 address (a dotted-quad out of range is left to the resolver) or an interface name
#: (ZeroMQ binds ``tcp://eth0:PORT``): letters, digits, ``.``, ``-``, ``_``; 1-253 characters.
_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9._-]{0,251}[A-Za-z0-9_])?")


def check_host(host: str, wildcard: bool = True) -> str:
    """``host`` unchanged if it is a host name, an IPv4 address, ``[IPv6]`` or (``wildcard``) ``*``.

    Raises:
        ValueError: why not (a bracket without its pair, IPv6 without brackets, a character no
            host name has); the message names the host, never anything else of the URL.
    """
    if host.startswith("[") or host.endswith("]"):
        if not (host.startswith("[") and host.endswith("]")) or len(host) < 3:
            raise ValueError(f"host {host!r}: an IPv6 address needs both brackets, e.g. [::1]")
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"host {host!r}: {host[1:-1]!r} is not an IPv6 address") from None
        return host
    if wildcard and host == "*":
        return host
    if ":" in host:
        raise ValueError(f"host {host!r}: an IPv6 address goes in brackets, e.g. tcp://[{host}]:PORT")
    if not _NAME.fullmatch(host):
        raise ValueError(f"host {host!r} is not a host name, an IPv4 address or a bracketed IPv6 address")
    return host


__all__ = ["check_host"]
