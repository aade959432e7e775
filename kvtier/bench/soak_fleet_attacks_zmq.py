"""Issue 24, kinds 1 ("identity is whatever a connection claims") and 2 ("a registered member is
believed about everything"), as attacks of the fleet soak's hostile client on the controller's agent
endpoint: claimed live ids (plain, a stranger's key, the rogue member), a stranger's Register /
Changes / empty Snapshot / Heartbeat, the rogue's messages for other members' records, a Register of
20,000 namespaces, 20 MiB frames, claims beyond the declared capacity, and a poisoned peer
advertised for the public prompts. Each is one bounded run (:mod:`kvtier.bench.soak_fleet_hostile`).
"""

from __future__ import annotations

import os
import time
from typing import Callable

import zmq

from kvtier.bench.soak_fleet_attack_base import Hostile, Tally, register, replies, send
from kvtier.bench.soak_fleet_probe import poison_keys
from kvtier.fleet.agent import namespace_info
from kvtier.protocol import fleet as F
from kvtier.protocol.trust import FleetKey

# -- kind 1: identity is whatever a connection claims ---------------------------------------------------

def claim_live_id(h: Hostile, t: Tally) -> None:
    """The issue's input: a connection whose ZMQ identity is a live instance's id sends one byte and
    closes (plain), and a stranger's CURVE connection with that identity sends a Register for it."""
    for name in h.names:
        for key in (None, FleetKey.generate()):
            s = h.dealer(key, identity=name.encode())
            try:
                send(t, s, b"\x00" if key is None else register(name, h.ns))
                got = replies(s, 0.1)
                if got:
                    t.success(f"{name}: the controller answered a {'plain' if key is None else 'stranger'} claim: {got[0]!r}")
            finally:
                s.close(0)


def member_claims_live_id(h: Hostile, t: Tally) -> None:
    """A member (rogue) registers a live instance's id, then heartbeats for it: it must be refused."""
    s = h.dealer(h.rogue)
    try:
        for name in h.names:
            send(t, s, register(name, h.rogue_ns), F.Heartbeat(name, "hostile", 0))
            for ack in replies(s):
                if isinstance(ack, F.Ack) and ack.known:
                    t.success(f"rogue's claim of {name} was accepted")
                elif isinstance(ack, F.Ack):
                    t.saw("refused")
    finally:
        s.close(0)


# -- kind 2: a registered member is believed about everything ------------------------------------------

def stranger_messages(h: Hostile, t: Tally) -> None:
    """A stranger (plain, and a key no member holds) sends Register, Changes claiming the poison keys,
    an empty Snapshot and a Heartbeat for live ids: nothing may answer, nothing may change."""
    poison = b"".join(poison_keys())
    digest = h.ns.digest()
    for key in (None, FleetKey.generate()):
        s = h.dealer(key)
        try:
            for name in [*h.names, "hostile-new"]:
                if not send(t, s, register(name, h.ns), F.Changes(name, "hostile", 1, [F.Change("s", digest, "cpu", poison)]),
                            F.Snapshot(name, "hostile", 1, digest, "cpu", b"", b"", True), F.Heartbeat(name, "hostile", 1)):
                    break
            got = replies(s)
            if got:
                t.success(f"a {'plain' if key is None else 'stranger'} connection got {len(got)} answers: {got[0]!r}")
        finally:
            s.close(0)


def member_poisons_index(h: Hostile, t: Tally) -> None:
    """The rogue member sends Changes claiming the poison keys and an empty snapshot under live ids
    (with guessed epochs): the controller must take messages for a record from its own connection only."""
    poison = b"".join(poison_keys())
    digest = h.ns.digest()
    s = h.dealer(h.rogue)
    try:
        for name in h.names:
            send(t, s, F.Changes(name, "hostile", 1, [F.Change("s", digest, "cpu", poison)]),
                 F.Snapshot(name, "hostile", 1, digest, "cpu", b"", b"", True), F.Heartbeat(name, "hostile", 1))
        replies(s)
    finally:
        s.close(0)


def namespaces_20k(h: Hostile, t: Tally) -> None:
    """One Register carrying 20,000 namespaces (stalled the endpoint 1.6 s), from the rogue member and
    from a plain connection, three times each."""
    frame = F.encode(register("rogue-ns", h.rogue_ns, namespaces=[namespace_info(h.rogue_ns)] * 20_000))
    for key in (h.rogue, None):
        s = h.dealer(key)
        try:
            send(t, s, frame, frame, frame)
            for ack in replies(s, 0.5):
                if isinstance(ack, F.Ack) and ack.known:
                    t.success("a 20,000-namespace Register was accepted")
        finally:
            s.close(0)


def oversized_frames(h: Hostile, t: Tally) -> None:
    """Three 20 MiB frames (beyond the 16 MiB bound) from a plain and from the rogue's CURVE connection."""
    blob = h.state.setdefault("blob", os.urandom(20 << 20))
    for key in (None, h.rogue):
        s = h.dealer(key)
        s.setsockopt(zmq.LINGER, 2000)  # let them leave before the close
        try:
            send(t, s, blob, blob, blob)
            replies(s, 0.2)
        finally:
            s.close(2000)


def over_capacity_claims(h: Hostile, t: Tally) -> None:
    """The rogue registers ``rogue-cap`` with room for 64 chunks and claims 20,000 (snapshot, then
    changes), heartbeating about a second so the monitor sees what the controller keeps."""
    import hashlib

    s = h.dealer(h.rogue)
    digest = h.rogue_ns.digest()
    try:
        send(t, s, register("rogue-cap", h.rogue_ns))
        if not any(isinstance(a, F.Ack) and a.known for a in replies(s, 1.0)):
            t.saw("not_registered")
            return
        keys = [hashlib.blake2b(f"cap-{h.run}-{i}".encode(), digest_size=32).digest() for i in range(20_000)]
        part = F.MAX_KEYS_PER_PART
        parts = [keys[i : i + part] for i in range(0, len(keys), part)]
        send(t, s, *(F.Snapshot("rogue-cap", "hostile", 1, digest, "cpu", b"".join(p), b"", i == len(parts) - 1)
                     for i, p in enumerate(parts)))
        send(t, s, *(F.Changes("rogue-cap", "hostile", seq, [F.Change("s", digest, "cpu", b"".join(keys[:1000]))])
                     for seq in range(1, 4)))
        end = time.monotonic() + 1.0
        while time.monotonic() < end and not h.stop.is_set():
            send(t, s, F.Heartbeat("rogue-cap", "hostile", 3))
            replies(s, 0.25)
    finally:
        s.close(0)


def poisoned_peer_advertisement(h: Hostile, t: Tally) -> None:
    """The rogue advertises its own peer server (0xEE bytes, right checksums, for the public system
    prompts' keys) and claims those keys: registering the soak model is refused (``models=``), under
    its own model it is never located for the soak's; any dial of the poison server is a success."""
    from kvtier.bench.soak_fleet_attacks_net import poison_server

    server = poison_server(h)
    s = h.dealer(h.rogue)
    try:
        send(t, s, register("rogue-peer", h.ns, peer_url=server.peer_server.url))
        for ack in replies(s, 0.5):
            if isinstance(ack, F.Ack) and ack.known:
                t.success("the rogue registered the soak model with its poison peer")
        # Under its own model (allowed), claiming the soak prompts' keys, live for a second: never located for them.
        send(t, s, register("rogue-peer", h.rogue_ns, peer_url=server.peer_server.url))
        if any(isinstance(a, F.Ack) and a.known for a in replies(s, 0.5)):
            from kvtier.bench.soak_fleet_attacks_net import public_chain_keys

            keys = public_chain_keys(h)[: F.MAX_KEYS_PER_PART]
            send(t, s, F.Snapshot("rogue-peer", "hostile", 1, h.rogue_ns.digest(), "cpu", b"".join(keys), b"", True))
            end = time.monotonic() + 1.0
            while time.monotonic() < end and not h.stop.is_set():
                send(t, s, F.Heartbeat("rogue-peer", "hostile", 1))
                replies(s, 0.25)
    finally:
        s.close(0)
    dials = server.peer_server.counters.get("authenticated", 0) + server.peer_server.counters.get("requests", 0)
    if dials > h.state.get("poison_dials", 0):
        t.success(f"the poison peer server was dialled ({dials} connections/requests so far)")
    h.state["poison_dials"] = dials


_DROP = ("drop_off",)
#: name -> (kind, attack, monitor events meaning it achieved its aim)
ZMQ_ATTACKS: dict[str, tuple[int, Callable[[Hostile, Tally], None], tuple[str, ...]]] = {
    "claim_live_id": (1, claim_live_id, _DROP),
    "member_claims_live_id": (1, member_claims_live_id, _DROP + ("index_poisoned",)),
    "stranger_messages": (2, stranger_messages, _DROP + ("index_poisoned", "foreign_namespace")),
    "member_poisons_index": (2, member_poisons_index, _DROP + ("index_poisoned",)),
    "namespaces_20k": (2, namespaces_20k, _DROP + ("lookup_stall",)),
    "oversized_frames": (2, oversized_frames, _DROP + ("lookup_stall", "rss_controller")),
    "over_capacity_claims": (2, over_capacity_claims, ("over_capacity", "rss_controller")),
    "poisoned_peer_advertisement": (2, poisoned_peer_advertisement, ("foreign_namespace", "audit_mismatch")),
}
