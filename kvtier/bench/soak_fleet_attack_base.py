"""What the fleet soak's attacks share: their tally, the hostile client's state, ZMQ helpers.

:class:`Tally` is one attack's record (runs and their ``time.monotonic()`` windows, actions,
outcomes, successes it saw itself, bodies of answers it got without credentials); :class:`Hostile` is
what a stranger knows (:mod:`kvtier.bench.soak_fleet_hostile`) plus the rogue member's key; the
helpers speak to the controller's agent endpoint without ever blocking on a refused connection.
"""

from __future__ import annotations

import os
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvtier.bench.soak_workload import soak_namespace
from kvtier.fleet.agent import namespace_info
from kvtier.index.keys import KeyNamespace
from kvtier.protocol import fleet as F
from kvtier.protocol.curve import curve_client
from kvtier.protocol.trust import FleetKey

#: Runs (windows) kept in detail per attack; all are counted.
MAX_WINDOWS = 4000
#: Bytes of each tokenless answer kept for the report's secret scan, and answers kept per attack.
BODY_BYTES = 16 << 10
MAX_BODIES = 48
#: How long a socket that must stay silent is listened to (seconds).
LISTEN_S = 0.3
#: Longest wait of one send on a DEALER whose connection the controller refused (milliseconds).
SEND_TIMEOUT_MS = 500


@dataclass
class Tally:
    """One attack's record (JSON): runs and their windows ``[t0, t1, direct successes]``, actions,
    outcomes, examples of successes, bodies of tokenless answers."""

    kind: int
    effects: list[str]
    runs: int = 0
    actions: int = 0
    direct_successes: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    windows: list[list[float]] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)
    bodies: dict[str, str] = field(default_factory=dict)

    def saw(self, outcome: str, n: int = 1) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + n

    def act(self, n: int = 1) -> None:
        self.actions += n

    def success(self, detail: str) -> None:
        """The attack saw its aim achieved."""
        self._run_successes += 1
        self.saw("SUCCESS")
        if len(self.examples) < 10:
            self.examples.append(detail[:300])

    def keep(self, where: str, body: bytes | str) -> None:
        """Keep (the start of) an answer got without credentials, for the secret scan."""
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
        if where in self.bodies or len(self.bodies) < MAX_BODIES:
            self.bodies[where] = text[:BODY_BYTES]

    _run_successes: int = 0


@dataclass
class Hostile:
    """What the attacks share: the hostile plan, the rogue member's key, a ZMQ context, the stop flag.

    ``tls``: one TLS context for every HTTP call of the attacks (they are all plain ``http://``). A bare
    ``httpx.get``/``post``/``stream`` builds a new one per call and loads the CA bundle into it, which
    cost the hostile client about 37% of its CPU (py-spy, 30 s of a soak): CPU the attacks took from the
    fleet on a 2-core machine without attacking anything. Every request still opens its own connection.
    """

    plan: dict[str, Any]
    stop: threading.Event
    ctx: zmq.Context
    rogue: FleetKey = field(init=False)
    run: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    tls: ssl.SSLContext = field(init=False)

    def __post_init__(self) -> None:
        self.tls = ssl.create_default_context()
        self.rogue = FleetKey.load(self.plan["rogue_key"])
        self.names = [n["name"] for n in self.plan["instances"]]
        self.ns = soak_namespace()
        self.rogue_ns = KeyNamespace("rogue/soak-tiny", self.ns.layout, self.ns.chunk_size)

    def dealer(self, key: FleetKey | None = None, identity: bytes | None = None) -> zmq.Socket:
        """A DEALER to the controller's agent endpoint: plain, or a CURVE client with ``key``."""
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)  # a refused connection leaves no peer: sends would block
        if identity is not None:
            s.setsockopt(zmq.IDENTITY, identity)
        if key is not None:
            curve_client(s, key, self.plan["controller_key"])
        s.connect(self.plan["zmq_url"])
        return s

    def close(self) -> None:
        """Stop what the attacks left running (servers, listeners); the context is the caller's."""
        for fn in self.state.get("closers", []):
            try:
                fn()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass


def register(name: str, ns: KeyNamespace, epoch: str = "hostile", **kw: Any) -> F.Register:
    """A Register for ``name`` claiming ``ns`` and a small CPU tier (``kw``: other fields)."""
    fields: dict[str, Any] = dict(namespaces=[namespace_info(ns)], tiers=[F.TierInfo("cpu", "cpu", 64 * ns.chunk_bytes)],
                                  peer_url="")
    fields.update(kw)
    return F.Register(name, epoch, F.FLEET_PROTOCOL_VERSION, "server", "hostile-host", os.getpid(), **fields)


def send(t: Tally, sock: zmq.Socket, *messages: Any) -> bool:
    """Send each message (a fleet message, or raw bytes); False once one cannot leave within
    ``SEND_TIMEOUT_MS`` (the controller refused the connection: nothing to send to), counted."""
    for m in messages:
        t.act()
        try:
            sock.send(m if isinstance(m, (bytes, memoryview)) else F.encode(m), copy=False)
        except zmq.Again:
            t.saw("send_blocked_not_connected")
            return False
    return True


def replies(sock: zmq.Socket, wait_s: float = LISTEN_S) -> list[Any]:
    """Every message ``sock`` receives within ``wait_s`` seconds (decoded when it decodes)."""
    out: list[Any] = []
    end = time.monotonic() + wait_s
    while (left := end - time.monotonic()) > 0 and sock.poll(int(left * 1000) + 1):
        raw = sock.recv()
        try:
            out.append(F.decode_controller_message(raw))
        except Exception:  # noqa: BLE001 - anything that answers counts
            out.append(raw[:64])
    return out
