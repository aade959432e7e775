"""The HOST of a ``scheme://HOST:PORT`` setting, checked when the setting is read, not when it is used.

Every address setting (``peer_listen``, ``peers``, ``controller``, ``peer_discovery``, the KV
event endpoints, the server's ``tcp://`` address) is split at its last ``:`` into HOST and PORT.
The PORT was always checked; the HOST was not, so ``tcp://[::1:0`` (a bracket left open) passed
``kvtier config-check`` and failed only when the server started, as "Invalid IPv6 URL". The
split at the last colon also takes ``tcp://::1:5555`` (IPv6 without brackets) for host ``::1``,
which no socket library reads the same way. :func:`check_host` refuses both kinds, and any host
that is not a DNS name, an IPv4 address or a bracketed IPv6 address (RFC 3986 section 3.2.2).

:func:`is_loopback` says which hosts are this machine's loopback (no DNS lookup, ever), where a
service decides what to trust without a secret: a listener bound to loopback, a browser's
``Host`` header naming it (DNS rebinding defence), a PD decoder's default prefillers, a
``peer_listen`` that needs no ``peer_allow_remote``.
"""

from __future__ import annotations

import ipaddress
import re

#: One label of a DNS name (or an interface name: ZeroMQ binds ``tcp://eth0:PORT``): letters, digits,
#: ``-`` and ``_``, 1-63 characters (RFC 1035 2.3.4), not starting or ending with ``-``.
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
#: An IPv6 zone id (``[fe80::1%eth0]``): an interface name or number, nothing a URL reader splits on.
_ZONE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def check_host(host: str, wildcard: bool = True) -> str:
    """``host`` unchanged if it is a host name, an IPv4 address, ``[IPv6]`` or (``wildcard``) ``*``.

    A DNS name may end in ``.`` (absolute: ``ctl.ns.svc.cluster.local.``); its labels are 1-63
    characters, the whole at most 253 (an empty label, ``a..b``, fails later inside the IDNA codec
    instead). A zone id after ``%`` in ``[IPv6]`` is an interface name or number only: ``ipaddress``
    takes any text there, ``]``, ``@`` and ``#`` included, which let ``[::1%x]@0.0.0.0:PORT#]`` pass as
    loopback and be read by the URL parser as ``0.0.0.0`` (the hostile trial of this change).

    Raises:
        ValueError: why not (a bracket without its pair, IPv6 without brackets, a ``user:password@``
            part, a character no host name has). The message quotes the host, except when it holds
            an ``@`` (whatever precedes it may be a password).
    """
    if "@" in host:
        raise ValueError("a user[:password]@ part is not allowed in this address (host names hold no '@')")
    if host.startswith("[") or host.endswith("]"):
        if not (host.startswith("[") and host.endswith("]")) or len(host) < 3:
            raise ValueError(f"host {host!r}: an IPv6 address needs both brackets, e.g. [::1]")
        addr, pct, zone = host[1:-1].partition("%")
        if pct and not _ZONE.fullmatch(zone):
            raise ValueError(f"host {host!r}: a zone id is an interface name or number, e.g. [fe80::1%eth0]")
        try:
            ipaddress.IPv6Address(addr)
        except ValueError:
            raise ValueError(f"host {host!r}: {addr!r} is not an IPv6 address") from None
        return host
    if wildcard and host == "*":
        return host
    if ":" in host:
        raise ValueError(f"host {host!r}: an IPv6 address goes in brackets, e.g. [{host}]")
    name = host[:-1] if host.endswith(".") else host
    if not name or len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise ValueError(f"host {host!r} is not a host name, an IPv4 address or a bracketed IPv6 address")
    return host


__all__ = ["check_host"]


def canonical_host(host: str) -> str:
    """``host`` (as :func:`check_host` accepted it) in one form per address: an IP literal as
    :mod:`ipaddress` writes it (``[::1]`` for ``[0:0::1]``), a name lowercased (DNS is
    case-blind); an IPv6 zone id (``%eth0``: an interface name, case-sensitive) kept as written.

    Raises:
        ValueError: a name that only looks like an IPv4 address in another notation (``127.1``,
            ``2130706433``, ``0x7f.0.0.1``, ``0177.0.0.1``): resolvers read those differently, and
            two spellings of one peer would both be dialled.
    """
    if host.startswith("["):
        addr, pct, zone = host[1:-1].partition("%")
        try:
            return f"[{ipaddress.IPv6Address(addr).compressed}{pct}{zone}]"
        except ValueError:
            return host.lower()  # check_host has accepted it; keep it as written
    name = host.lower()
    last = name.rstrip(".").rpartition(".")[2]
    if last.isdigit() or last.startswith("0x"):
        try:
            return str(ipaddress.IPv4Address(name))
        except ValueError:
            raise ValueError(f"{host!r} is not a dotted-decimal IPv4 address (write a.b.c.d, no leading zeros) "
                             "nor a host name") from None
    return name


#: Host names that always mean this machine's loopback.
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and the loopback IPs (``127.0.0.0/8``, ``::1``, bracketed or not);
    a wildcard, another name or address is not. Names are never resolved: a name that merely resolves to 127.0.0.1 (what a
    DNS-rebinding page uses) is not loopback here."""
    h = host.strip().strip("[]").lower().rstrip(".")
    if h in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(h.split("%", 1)[0]).is_loopback
    except ValueError:
        return False
