"""Loopback TCP ports for the processes kvtier starts itself: tests, demos, benchmarks, the vLLM launcher.

Asking the kernel for port 0 and closing the socket again (the usual trick) hands out a port
from the *ephemeral* range (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by
default). That is the range every outgoing connection on the machine also takes its local port
from. A busy test run opens a lot of them: clients of Redis and of Mooncake masters reconnecting
once a second, HTTP probes, ZMQ peers. So between the pick and the ``bind`` of the process that
was given the port, an unrelated connection can hold it. The failure is a server that does not
start, seen as a timeout somewhere else (CI, stop 32: a fleet soak whose fleet did not come up).

:class:`PortPicker` picks instead below the ephemeral range (20000 up to its start), where only
listeners live (and above the 12000-17000 that Mooncake's transfer engine takes its RPC ports from), checks that the port binds, and never hands the same port out twice (two
processes of one fleet told the same port is the other way such a race goes).
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

#: Where the kernel says its ephemeral range is.
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Lowest port :class:`PortPicker` hands out: above the registered services (1-9999), Redis Cluster's bus
#: ports (client port + 10000) and the ports Mooncake's transfer engine binds (seen 12000-17000).
LOW_PORT = 20000
#: Candidates :meth:`PortPicker.pick` tries before it gives up.
MAX_TRIES = 200


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range ``(first, last)``, both inclusive; Linux's default when unreadable."""
    try:
        first, last = (int(x) for x in path.read_text().split())
        return first, last
    except (OSError, ValueError):
        return 32768, 60999


class PortPicker:
    """Hands out loopback TCP ports that bind at the time of the call, each at most once per picker.

    Args:
        low: lowest port handed out.
        high: highest port handed out (inclusive); default: one below the ephemeral range, or 65535
            when that range leaves fewer than 1000 ports above ``low`` (then collisions with outgoing
            connections are possible again, as with port 0).
        rng: the random source (tests pass a seeded one).

    Raises:
        ValueError: ``low > high``.
    """

    def __init__(self, low: int = LOW_PORT, high: int | None = None, rng: random.Random | None = None) -> None:
        if high is None:
            first, _ = ephemeral_range()
            high = first - 1 if first - 1 - low >= 1000 else 65535
        if not 0 < low <= high <= 65535:
            raise ValueError(f"port range [{low}, {high}] is empty or outside 1-65535")
        self.low, self.high = low, high
        self._rng = rng or random.Random()
        self._given: set[int] = set()
        self._lock = threading.Lock()  # check-and-record is one step: threads sharing a picker get distinct ports

    def pick(self, host: str = "127.0.0.1") -> int:
        """A port in ``[low, high]`` that binds on ``host`` (an IPv4 or IPv6 address or a name) now and this
        picker never gave out before. Thread-safe.

        Another process may still take it before the caller binds it (no pick can rule that out),
        but nothing on this machine takes local ports from this range unasked.

        Raises:
            OSError: ``host`` does not resolve (at once), every port of the range was given out, or no
                free port was found in :data:`MAX_TRIES` candidates.
        """
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with self._lock:
            if len(self._given) > self.high - self.low:
                raise OSError(f"every port in [{self.low}, {self.high}] was given out by this picker")
            for _ in range(MAX_TRIES):
                port = self._rng.randint(self.low, self.high)
                if port in self._given:
                    continue
                with socket.socket(family) as s:
                    try:
                        s.bind((host, port))
                    except socket.gaierror as exc:  # a name that does not resolve: no port will bind
                        raise OSError(f"cannot pick a port on {host!r}: {exc.strerror or exc}") from None
                    except OSError:
                        continue
                self._given.add(port)
                return port
        raise OSError(f"no free TCP port on {host} in [{self.low}, {self.high}] after {MAX_TRIES} tries")


def free_port(host: str = "127.0.0.1") -> int:
    """One port from a fresh :class:`PortPicker` (see the module doc for why not port 0).

    Code that hands out several ports to processes that run at the same time holds one picker
    instead, so that none is given twice. Raises OSError as :meth:`PortPicker.pick`.
    """
    return PortPicker().pick(host)


__all__ = ["PortPicker", "ephemeral_range", "free_port"]
