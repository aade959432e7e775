"""The options of one ``kvtier bench soak`` run (read by the run, :mod:`kvtier.bench.soak`, and its
report, :mod:`kvtier.bench.soak_report`)."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class SoakOptions:
    """One soak run.

    Attributes:
        minutes: length of the measured run (after every client connected).
        clients: well-behaved client processes.
        rate: requests per second of each well-behaved client.
        cpu_capacity: bytes of the server's CPU pool.
        rss_allowance: bytes of server RSS allowed above ``cpu_capacity``
            (interpreter, numpy, index, sessions, buffers).
        tcp: also listen on loopback TCP (so the hostile client tries wrong tokens).
        restart_every_s: each well-behaved client is replaced by a new one (a
            new registration, as after an engine restart) this often, staggered;
            0: never.
    """

    minutes: float = 10.0
    clients: int = 8
    rate: float = 20.0
    cpu_capacity: int = 64 * MiB
    rss_allowance: int = 128 * MiB
    tcp: bool = True
    restart_every_s: float = 30.0

    def problems(self) -> list[str]:
        """Usage errors, one line each (naming the flag, the value and the accepted range)."""
        out = []
        if not 0 < self.minutes <= 24 * 60:
            out.append(f"--minutes must be in (0, 1440], got {self.minutes}")
        if not 1 <= self.clients <= 64:
            out.append(f"--clients must be in 1..64, got {self.clients}")
        if not 0 < self.rate <= 1000:
            out.append(f"--rate must be in (0, 1000] requests/s, got {self.rate}")
        if not 8 * MiB <= self.cpu_capacity <= 64 * 1024 * MiB:
            out.append(f"--cpu-capacity must be 8MiB..64GiB, got {self.cpu_capacity} bytes")
        if self.restart_every_s < 0:
            out.append(f"--restart-every must be >= 0 seconds, got {self.restart_every_s}")
        if self.rss_allowance < 0:
            out.append(f"--rss-allowance must be >= 0, got {self.rss_allowance} bytes")
        return out
