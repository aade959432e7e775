"""Issue 24, kind 3 ("peers serve anyone"), as attacks of the fleet soak's hostile client.

Each function is one bounded run against every instance (or one in turn) of the fleet
(:mod:`kvtier.bench.soak_fleet_hostile` runs them in a loop and records their windows):

- ``stranger_peer_pull``: dial each ``peer_listen`` without a key (the plain hello), with a key no
  member holds, with a member's public key but a made-up proof, and as the rogue member (a member,
  but ``models=rogue/*``) asking for the public system prompts' chunks: success = any chunk found
  or any byte of one received.
- ``silent_peer_connections``: 100 TCP connections that never say hello, held 2 s, on one
  instance in turn (20 locked real peers out before); the monitor's fresh member links must still
  be served (``peer_lockout``).
- ``idle_peer_links``: the rogue member opens 24 authenticated links and holds them (at most 16 per
  member): success = more than 16 admitted; the monitor's links must still be served.
- ``event_subscribe``: subscribe to each instance's KV event stream plainly (the issue's input),
  with a stranger's key and as the rogue member (no ``events`` role), and ask the replay socket
  for everything: success = any message.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import zmq

from kvtier.bench.soak_fleet_workload import SALTS
from kvtier.bench.soak_workload import system_prompts
from kvtier.protocol.curve import curve_client
from kvtier.protocol.trust import Credentials, FleetKey, Member, Members
from kvtier.transfer.errors import TransferError

if TYPE_CHECKING:
    from kvtier.bench.soak_fleet_attack_base import Hostile, Tally

#: Silent connections per run, and how long they are held (seconds).
SILENT = 100
HOLD_S = 2.0
#: Authenticated links the rogue opens per run (the server admits 16 per member).
ROGUE_LINKS = 24
MAX_PER_MEMBER = 16


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def public_chain_keys(h: Hostile) -> list[bytes]:
    """Keys of the public system prompts' chunks, under every tenant salt (what a stranger would ask for)."""
    from kvtier.index.keys import ChunkHasher

    hasher = ChunkHasher(h.ns)
    return [k for p in system_prompts() for s in SALTS for k in hasher.keys(p, cache_salt=s)]


def poison_server(h: Hostile) -> Any:
    """The rogue's own peer server (started once): a storage manager of the soak model holding 0xEE
    chunks for the public prompts' keys, serving over TCP with the rogue key to the fleet's members."""
    got = h.state.get("poison_server")
    if got is not None:
        return got
    from kvtier.config import KVTierConfig
    from kvtier.transfer.assembly import open_manager

    d = Path(tempfile.mkdtemp(prefix="kvsoak-hostile-"))
    members = d / "members"
    members.write_text("".join(f"{n['name']} {n['public']}\n" for n in h.plan["instances"]))
    os.chmod(members, 0o644)
    h.rogue.save(d / "rogue.key")
    keys = public_chain_keys(h)
    m = open_manager(KVTierConfig(chunk_size=h.ns.chunk_size, cpu_capacity=(len(keys) + 8) * h.ns.chunk_bytes,
                                    peer_listen="tcp://127.0.0.1:0", fleet_key=d / "rogue.key", fleet_members=members), h.ns)
    for k in keys:
        buf = m.open_write(k, None)
        if buf is not None:
            buf[:] = 0xEE
            m.commit(k, None)
    h.state["poison_server"] = m
    h.state.setdefault("closers", []).extend([m.close, lambda: shutil.rmtree(d, ignore_errors=True)])
    return m


def _refused(connect: Callable[[], Any]) -> tuple[bool, Any]:
    try:
        return False, connect()
    except TransferError:
        return True, None


def stranger_peer_pull(h: Hostile, t: Tally) -> None:
    from kvtier.transfer.peer_auth import ClientAuth
    from kvtier.transfer.peer_tier import PeerTier
    from kvtier.transfer.tcp import TcpChannel

    keys = public_chain_keys(h)[:24]
    stranger = FleetKey.generate("stranger")
    rogue = Credentials(h.rogue, Members.of(*(Member(n["name"], n["public"]) for n in h.plan["instances"])))
    for node in h.plan["instances"]:
        host, port = _address(node["peer_url"])
        trusting = Credentials(stranger, Members.of(Member(node["name"], node["public"])))
        for label, auth in (("plain", None), ("stranger key", ClientAuth(trusting))):
            t.act()
            refused, chan = _refused(lambda: TcpChannel.connect(host, port, timeout_s=1.0, auth=auth))
            if refused:
                t.saw("refused")
            else:
                chan.close()
                t.success(f"{node['name']}: a {label} link was admitted")
        t.act()
        if _forged_proof(host, port, node, keys[0]):
            t.success(f"{node['name']}: answered a request after a made-up proof for {node['name']}'s key")
        t.act()
        tier = PeerTier(lambda: TcpChannel.connect(host, port, timeout_s=1.0, auth=ClientAuth(rogue, node["public"])),
                        timeout_s=1.0, retry_s=0.05, location=node["peer_url"])
        try:
            found = tier.contains_many(keys)
            outs = [bytearray(h.ns.chunk_bytes) for _ in keys[:4]]
            got = tier.get_many_into(list(zip(keys[:4], outs)))
            if any(found) or any(got):
                t.success(f"{node['name']}: the rogue (models=rogue/*) got {sum(found)} found, {sum(got)} chunks")
            else:
                t.saw("rogue_got_nothing")
        finally:
            tier.close()


def _forged_proof(host: str, port: int, node: dict[str, Any], key: bytes) -> bool:
    """Hello with the member's public key, a random proof, then a ``contains``: True if answered."""
    from kvtier.transfer.frames import PREFIX, Control, Hello, Proof, decode_header, encode_frame
    from kvtier.transfer.peer_auth import _ephemeral

    s = socket.create_connection((host, port), timeout=1.0)
    try:
        _, eph = _ephemeral()
        s.sendall(encode_frame(Hello(kind="tcp", key=FleetKey(node["public"], "").public_raw, eph=eph)))
        head = s.recv(PREFIX.size, socket.MSG_WAITALL)
        if len(head) == PREFIX.size:
            body = s.recv(PREFIX.unpack(head)[1], socket.MSG_WAITALL)
            decode_header(body)
        s.sendall(encode_frame(Proof(mac=os.urandom(32))))
        s.sendall(encode_frame(Control(body=b"\x82\xa2op\xa8contains\xa4keys\x91\xc4\x20" + key)))
        rest = b""
        try:
            while len(rest) < 1 << 16 and (chunk := s.recv(65536)):
                rest += chunk
        except OSError:
            pass
        return b"found" in rest
    except (OSError, ValueError):
        return False
    finally:
        s.close()


def silent_peer_connections(h: Hostile, t: Tally) -> None:
    node = h.plan["instances"][h.run % len(h.plan["instances"])]
    held: list[socket.socket] = []
    try:
        for _ in range(SILENT):
            t.act()
            try:
                held.append(socket.create_connection(_address(node["peer_url"]), timeout=1.0))
            except OSError:
                t.saw("connect_failed")
        h.stop.wait(HOLD_S)
        closed = 0
        for s in held:
            s.setblocking(False)
            try:
                closed += s.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        t.saw("closed_by_server", closed)
        t.saw("still_open", len(held) - closed)
    finally:
        for s in held:
            s.close()


def idle_peer_links(h: Hostile, t: Tally) -> None:
    from kvtier.transfer.peer_auth import ClientAuth
    from kvtier.transfer.tcp import TcpChannel

    node = h.plan["instances"][h.run % len(h.plan["instances"])]
    host, port = _address(node["peer_url"])
    rogue = Credentials(h.rogue, Members.of(Member(node["name"], node["public"])))
    links = []
    try:
        for _ in range(ROGUE_LINKS):
            t.act()
            refused, chan = _refused(lambda: TcpChannel.connect(host, port, timeout_s=1.0, auth=ClientAuth(rogue)))
            if chan is not None:
                links.append(chan)
        h.stop.wait(0.3)
        alive = [c for c in links if not _closed(c)]
        t.saw("links_kept", len(alive))
        if len(alive) > MAX_PER_MEMBER:
            t.success(f"{node['name']}: {len(alive)} links of one member kept (at most {MAX_PER_MEMBER})")
        h.stop.wait(HOLD_S)
    finally:
        for c in links:
            c.close()


def _closed(chan: Any) -> bool:
    import select

    sock = getattr(chan, "_sock", None)
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def event_subscribe(h: Hostile, t: Tally) -> None:
    subs: list[tuple[str, zmq.Socket]] = []
    stranger = FleetKey.generate("stranger")
    try:
        for node in h.plan["instances"]:
            for label, key in (("plain", None), ("stranger", stranger), ("rogue", h.rogue)):
                s = h.ctx.socket(zmq.SUB)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SUBSCRIBE, b"")
                if key is not None:
                    curve_client(s, key, node["public"])
                s.connect(f"tcp://127.0.0.1:{node['events_port']}")
                subs.append((f"{node['name']} {label} SUB", s))
                r = h.ctx.socket(zmq.DEALER)
                r.setsockopt(zmq.LINGER, 0)
                r.setsockopt(zmq.SNDTIMEO, 500)  # a refused connection leaves no peer to send to
                if key is not None:
                    curve_client(r, key, node["public"])
                r.connect(f"tcp://127.0.0.1:{node['replay_port']}")
                subs.append((f"{node['name']} {label} replay", r))
                t.act(2)
                try:
                    r.send_multipart([b"", (0).to_bytes(8, "big")])
                except zmq.Again:
                    t.saw("replay_send_blocked")
        end = time.monotonic() + 1.5
        got: dict[str, int] = {}
        while time.monotonic() < end and not h.stop.is_set():
            for label, s in subs:
                while s.poll(0):
                    s.recv_multipart()
                    got[label] = got.get(label, 0) + 1
            time.sleep(0.02)
        for label, n in got.items():
            t.success(f"{label}: {n} messages")
        if not got:
            t.saw("nothing_received")
    finally:
        for _, s in subs:
            s.close(0)


#: name -> (kind, attack, monitor events meaning it achieved its aim)
NET_ATTACKS: dict[str, tuple[int, Callable[[Hostile, Tally], None], tuple[str, ...]]] = {
    "stranger_peer_pull": (3, stranger_peer_pull, ("audit_mismatch",)),
    "silent_peer_connections": (3, silent_peer_connections, ("peer_lockout",)),
    "idle_peer_links": (3, idle_peer_links, ("peer_lockout",)),
    "event_subscribe": (3, event_subscribe, ()),
}
