"""The hostile client of ``kvtier bench soak``: cycles through attacks on the server until told to stop.

Attacks (each bounded: every socket has a timeout, holds last ``HOLD_S`` /
``HOARD_S`` seconds):

- ``idle_connections``: opens ``IDLE_UNIX`` Unix (and ``IDLE_TCP`` TCP,
  ``IDLE_HTTP`` metrics-port) connections that never send a byte, holds them, then checks which the server
  already closed (its idle/handshake timeout).
- ``unregistered``: data-plane requests on a connection that never registered.
- ``garbage``: random bodies behind valid headers, msgpack that is not a map,
  wrong protocol versions, unknown ops, then junk bytes.
- ``oversized``: frame headers announcing more than ``MAX_FRAME_BYTES``.
- ``wrong_token``: TCP registrations with wrong tokens (skipped without TCP).
- ``namespaces``: registrations of other models' namespaces (squatting) and a
  second registration on a registered connection.
- ``hoard``: ``HOARDERS`` connections under one client id reserve slots and
  never commit, take leases and never release them, open reads and never close
  them; all held ``HOARD_S`` seconds, then dropped.

Run as ``python -m kvtier.bench.soak_hostile --socket S [--tcp HOST:PORT]
--seconds D --go GO_FILE --out OUT.json``; the JSON holds, per attack, runs,
actions and the outcomes seen (reply codes, ``closed``, ``timeout``...).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from struct import error as struct_error
from typing import Any, Callable

import msgpack
import numpy as np

from kvtier import protocol as P
from kvtier.bench.soak_workload import soak_namespace, system_prompts, wait_for_file
from kvtier.index.keys import ChunkHasher
from kvtier.service.client import ServiceClient, ServiceUnavailable

#: Socket timeout of every raw connection (seconds).
IO_TIMEOUT_S = 1.0
#: Idle connections opened per round, and how long they are held (seconds).
IDLE_UNIX = 48
IDLE_TCP = 16
IDLE_HTTP = 32
HOLD_S = 1.0
#: Hoarding connections (one client id) and how long they hold (seconds).
HOARDERS = 3
HOARD_S = 2.0
#: Leases (distinct 256-character owners) each hoarding connection takes per system prompt.
LEASE_OWNERS = 8
#: Wrong-token registrations per round.
WRONG_TOKENS = 3


@dataclass
class AttackTally:
    """One attack's record: rounds run, actions taken (connections, frames, holds), outcomes seen."""

    runs: int = 0
    actions: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)

    def saw(self, outcome: str, n: int = 1) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + n


@dataclass
class Target:
    """Where the attacks go: the Unix socket, the optional TCP address, when to stop."""

    socket_path: str
    tcp: tuple[str, int] | None
    http: tuple[str, int] | None
    stop: threading.Event


def _unix(t: Target) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(IO_TIMEOUT_S)
    try:
        s.connect(t.socket_path)
    except BaseException:
        s.close()
        raise
    return s


def _tcp(t: Target) -> socket.socket:
    assert t.tcp is not None
    return socket.create_connection(t.tcp, timeout=IO_TIMEOUT_S)


def _http(t: Target) -> socket.socket:
    assert t.http is not None
    return socket.create_connection(t.http, timeout=IO_TIMEOUT_S)


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout):
        return "timeout"
    if isinstance(exc, (ConnectionError, BrokenPipeError)):
        return "closed"
    if isinstance(exc, P.ProtocolError):
        return f"reply_{exc.code}"
    return type(exc).__name__


def _rpc(sock: socket.socket, frame: bytes) -> str:
    """Send one frame and read one reply; the reply's code (``ok`` or the error code) or what went wrong."""
    try:
        sock.sendall(frame)
        reply, _ = P.read_reply(sock, bytearray(1 << 16), time.monotonic() + IO_TIMEOUT_S)
    except (OSError, ValueError) as exc:
        return _outcome(exc)
    return "ok" if reply.get("ok") else str(reply.get("code"))


def _answer(sock: socket.socket) -> str:
    """After a bad frame: ``<code>_then_closed``, ``<code>_still_open``, ``closed``, or ``no_answer`` (within 1 s)."""
    data = b""
    try:
        data = sock.recv(1 << 16)
    except TimeoutError:
        return "no_answer"
    except OSError:
        return "closed"
    if not data:
        return "closed"
    time.sleep(0.01)
    more, eof = _drain(sock)
    return f"{_code(data + more)}_{'then_closed' if eof else 'still_open'}"


def _register(client_id: str, model: str | None = None, token: str | None = None) -> bytes:
    ns = soak_namespace(model) if model else soak_namespace()
    return P.encode_request(P.Register(client_id, os.getpid(), ns, ns.digest(), ns.chunk_bytes, token), 1)


def _drain(sock: socket.socket) -> tuple[bytes, bool]:
    """Bytes the server already sent on ``sock`` (without waiting) and whether it hung up."""
    sock.setblocking(False)
    data = b""
    try:
        while len(data) < (1 << 16):
            got = sock.recv(1 << 16)
            if not got:
                return data, True
            data += got
    except BlockingIOError:
        return data, False
    except OSError:
        return data, True
    return data, False


def _code(data: bytes) -> str:
    """The error code of the first frame in ``data`` (``ok``, a code, or ``unparsable``)."""
    try:
        (n,) = P.HEADER.unpack_from(data)
        body = P.unpack_body(data[P.HEADER.size : P.HEADER.size + n])
    except (ValueError, struct_error):
        return "unparsable"
    return "ok" if body.get("ok") else str(body.get("code"))


def _hold(t: Target, seconds: float) -> None:
    t.stop.wait(seconds)


def idle_connections(t: Target, tally: AttackTally) -> None:
    socks: list[socket.socket] = []
    opens: list[Callable[[Target], socket.socket]] = [_unix] * IDLE_UNIX
    opens += [_tcp] * IDLE_TCP if t.tcp else []
    opens += [_http] * IDLE_HTTP if t.http else []
    try:
        for open_ in opens:
            tally.actions += 1
            try:
                socks.append(open_(t))
                tally.saw("opened")
            except OSError as exc:
                tally.saw(f"connect_{_outcome(exc)}")
        _hold(t, HOLD_S)
        for s in socks:
            data, eof = _drain(s)
            tally.saw(("closed_by_server" if eof else "still_open") + (f"_{_code(data)}" if data else ""))
    finally:
        for s in socks:
            s.close()


def unregistered(t: Target, tally: AttackTally) -> None:
    key = os.urandom(32)
    frames = [
        P.encode_request(P.Lookup([key], "squat"), 1), P.encode_request(P.Stats(), 2),
        P.encode_request(P.ReserveMany([key], None), 3), P.encode_request(P.Load(key, None), 4),
        P.encode_request(P.Commit(key, None), 5), P.encode_request(P.Clear(), 6),
    ]
    with _unix(t) as s:
        for f in frames:
            tally.actions += 1
            tally.saw(_rpc(s, f))


def garbage(t: Target, tally: AttackTally) -> None:
    rnd = random.Random()
    bodies = [rnd.randbytes(rnd.randint(0, 256)) for _ in range(6)]
    bodies += [msgpack.packb(x, use_bin_type=True) for x in ([1, 2, 3], "op", 7, None)]
    bodies += [msgpack.packb({"v": 99, "id": 1, "op": "lookup", "keys": b""}, use_bin_type=True)]
    bodies += [msgpack.packb({"v": P.PROTOCOL_VERSION, "id": 1, "op": "no_such_op"}, use_bin_type=True)]
    bodies += [msgpack.packb({"v": P.PROTOCOL_VERSION, "id": 1, "op": "lookup", "keys": b"x" * 33}, use_bin_type=True)]
    s = _unix(t)
    try:
        for body in bodies:
            tally.actions += 1
            got = _rpc(s, P.HEADER.pack(len(body)) + body)
            tally.saw(got)
            if got in ("closed", "timeout"):
                s.close()
                s = _unix(t)
        tally.actions += 1
        try:  # junk with no valid header: the server reads a huge length or garbage and must hang up or answer
            s.sendall(b"\xff\xfe GET / HTTP/1.1\r\n\r\n" + rnd.randbytes(64))
        except OSError as exc:
            tally.saw(f"junk_send_{_outcome(exc)}")
        else:
            tally.saw(f"junk_{_answer(s)}")
    finally:
        s.close()


def oversized(t: Target, tally: AttackTally) -> None:
    for n in (P.MAX_FRAME_BYTES + 1, 0xFFFFFFFF):
        tally.actions += 1
        with _unix(t) as s:
            try:
                s.sendall(P.HEADER.pack(n) + b"\0" * 65536)
            except OSError as exc:
                tally.saw(f"send_{_outcome(exc)}")
                continue
            tally.saw(_answer(s))


def wrong_token(t: Target, tally: AttackTally) -> None:
    if t.tcp is None:
        tally.saw("skipped_no_tcp")
        return
    for i in range(WRONG_TOKENS):
        tally.actions += 1
        try:
            with _tcp(t) as s:
                tally.saw(_rpc(s, _register(f"hostile-guess-{i}", token=os.urandom(8).hex())))
        except OSError as exc:
            tally.saw(f"connect_{_outcome(exc)}")


def namespaces(t: Target, tally: AttackTally) -> None:
    for i in range(2):
        tally.actions += 1
        with _unix(t) as s:
            tally.saw(_rpc(s, _register("hostile-squatter", model=f"squatter/any-{i}")))
    tally.actions += 1
    with _unix(t) as s:
        first = _rpc(s, _register("hostile-reregister"))
        tally.saw(f"first_{first}")
        if first == "ok":
            tally.actions += 1
            tally.saw(f"again_{_rpc(s, _register('hostile-reregister', model='squatter/again'))}")


def hoard(t: Target, tally: AttackTally) -> None:
    ns = soak_namespace()
    hasher = ChunkHasher(ns)
    shared = [hasher.keys(p) for p in system_prompts()]
    clients = [
        ServiceClient(t.socket_path, ns, "hostile-hoarder", timeout_s=IO_TIMEOUT_S, connect_timeout_s=5.0)
        for _ in range(HOARDERS)
    ]
    held: list[Any] = []
    try:
        for c in clients:
            try:
                c.wait_connected(5.0)
            except ServiceUnavailable:
                tally.saw("not_connected")
                continue
            for j, keys in enumerate(shared):  # leases never released, reads never closed
                for _ in range(LEASE_OWNERS):  # long, distinct owner names: server memory must stay bounded
                    tally.actions += 1
                    owner = os.urandom(P.MAX_NAME_CHARS // 2).hex()
                    errors = c.counters.error_replies
                    if c.lookup_keys(keys, lease_owner=owner).keys:
                        tally.saw("lease_taken")
                    else:
                        tally.saw("lease_refused" if c.counters.error_replies > errors else "lease_miss")
                for h in c.open_read_many([(k, None) for k in keys]):
                    if h is not None:
                        held.append(h)
                        tally.saw("read_held")
            for _ in range(8):  # reservations never committed
                tally.actions += 1
                got = c.open_write_many([os.urandom(32) for _ in range(128)], [None] * 128)
                n = sum(1 for g in got if isinstance(g, np.ndarray))
                tally.saw("reservation_held", n)
                if n == 0:
                    tally.saw("reservation_refused")
                    break
        _hold(t, HOARD_S)
    finally:
        held.clear()  # the handles are dropped unclosed; closing the clients ends every hold
        for c in clients:
            c.close()


ATTACKS: dict[str, Callable[[Target, AttackTally], None]] = {
    "unregistered": unregistered,
    "garbage": garbage,
    "oversized": oversized,
    "wrong_token": wrong_token,
    "namespaces": namespaces,
    "idle_connections": idle_connections,
    "hoard": hoard,
}


def run_hostile(t: Target, seconds: float) -> dict[str, AttackTally]:
    """Cycle through :data:`ATTACKS` for ``seconds`` (an attack in progress finishes; each is bounded)."""
    tallies = {name: AttackTally() for name in ATTACKS}
    end = time.monotonic() + seconds
    while not t.stop.is_set() and time.monotonic() < end:
        for name, attack in ATTACKS.items():
            if t.stop.is_set() or time.monotonic() >= end:
                break
            tallies[name].runs += 1
            try:
                attack(t, tallies[name])
            except Exception as exc:  # an attack that could not even connect is an outcome, not a crash
                tallies[name].saw(f"raised_{_outcome(exc)}")
    return tallies


def _host_port(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--tcp", default=None, help="HOST:PORT of the server's TCP listener, if any.")
    ap.add_argument("--http", default=None, help="HOST:PORT of the server's metrics endpoint, if any.")
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--go", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)  # refusals are the point; the client's error logs are noise here
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    tcp, http = (_host_port(x) if x else None for x in (a.tcp, a.http))
    tallies: dict[str, AttackTally] = {}
    if wait_for_file(a.go, stop, 120.0):
        tallies = run_hostile(Target(a.socket, tcp, http, stop), a.seconds)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps({name: asdict(x) for name, x in tallies.items()}))
    os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
