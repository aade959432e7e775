"""Which host names and addresses are this machine's loopback (no DNS lookup, ever).

Used where a service decides what to trust without a secret: a listener bound to loopback, a
browser's ``Host`` header naming it (DNS rebinding defence), a PD decoder's default prefillers.
"""

from __future__ import annotations

import ipaddress

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
