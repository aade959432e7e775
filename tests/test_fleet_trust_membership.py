"""Issue 24, kinds 1 and 2: membership is bound to the connection, and a member's claims are bounded.

Kind 1 ("identity is whatever a connection claims"): a stranger's connection claiming a live
instance's id never displaces it, over an open loopback controller (the record's secret epoch) and
over CURVE (the member key). Kind 2 ("a registered member is believed about everything"): strangers
cannot be located as peers, claims are bounded by declared capacity, one sharer cannot erase the
others' view of a shared tier, a Register of 20,000 namespaces or a huge frame cannot stall or bloat
the controller, a heartbeat cannot store megabytes, deadlines are durations. Real controller, real
agents and sockets on loopback; every wait polls with a deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from conftest import CHUNK, payload_for, small_namespace
from transfer_helpers import CB, read_chain, store_chain
from kvtier.config import KVTierConfig
from kvtier.controller.index import FleetIndex
from kvtier.controller.server import Controller, ControllerConfigError
from kvtier.controller.state import FleetState
from kvtier.fleet.agent import FleetAgent, namespace_info, tier_infos
from kvtier.protocol import fleet as F
from kvtier.protocol.curve import curve_client
from kvtier.protocol.trust import FleetKey
from kvtier.storage.instance_ops import InstanceOps
from kvtier.storage.manager import StorageManager
from kvtier.transfer.assembly import open_manager
from conftest import wait_until
from kvtier.testing.fleet_keys import FleetKeys, make_fleet

NS = small_namespace()
INFO = namespace_info(NS)


def _manager(**kw: object) -> StorageManager:
    return open_manager(KVTierConfig(chunk_size=CHUNK, cpu_capacity=32 * CB, peer_timeout_s=0.5, **kw), NS)


def _agent(ctl: Controller, name: str, m: StorageManager, keys: FleetKeys | None = None) -> FleetAgent:
    secure = {} if keys is None else {"credentials": keys.credentials(name), "controller_key": keys.public("controller")}
    return FleetAgent(ctl.zmq_url, name, "embedded", {INFO.digest: (INFO, InstanceOps(m))}, tier_infos(m),
                      **secure).start()


def _dealer(ctx: zmq.Context, url: str, identity: bytes | None = None, key: FleetKey | None = None,
            server: str | None = None) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        s.setsockopt(zmq.IDENTITY, identity)
    if key is not None and server is not None:
        curve_client(s, key, server)
    s.connect(url)
    return s


def _register(name: str, epoch: str = "stranger", **kw: object) -> F.Register:
    fields = dict(namespaces=[INFO], tiers=[F.TierInfo("cpu", "cpu", 32 * CB)], peer_url="")
    fields.update(kw)
    return F.Register(name, epoch, F.FLEET_PROTOCOL_VERSION, "embedded", "evil-host", 1, **fields)  # type: ignore[arg-type]


def _still_served(ctl: Controller, name: str, m: StorageManager, window_s: float) -> None:
    """For ``window_s`` seconds: ``name`` stays registered and answers an operation routed to it."""
    end = time.monotonic() + window_s
    while time.monotonic() < end:
        assert name in {r["instance"] for r in ctl.ops.instances()}, f"{name} dropped off"
        time.sleep(0.1)
    rec = ctl.ops.health(name, live=True) if hasattr(ctl.ops, "health") else None
    assert rec is None or name in str(rec)


@pytest.fixture
def open_ctl():
    ctl = Controller(http_port=0, zmq_endpoint="tcp://127.0.0.1:0").start()
    yield ctl
    ctl.stop()


@pytest.fixture
def keyed(tmp_path: Path):
    keys = make_fleet(tmp_path / "keys", ["controller", "A", "B", "M"])
    ctl = Controller(http_port=0, zmq_endpoint="tcp://127.0.0.1:0", credentials=keys.credentials("controller")).start()
    yield ctl, keys
    ctl.stop()


# -- kind 1 --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_connection_claiming_a_live_id_does_not_displace_it(open_ctl) -> None:
    """The issue's input: a DEALER whose identity is the instance's id sends one byte and closes."""
    m = _manager()
    agent = _agent(open_ctl, "A", m)
    ctx = zmq.Context()
    try:
        wait_until(lambda: agent.registered, 5.0)
        for _ in range(3):
            s = _dealer(ctx, open_ctl.zmq_url, identity=b"A")
            s.send(b"\x00")
            time.sleep(0.05)
            s.close(0)
        _still_served(open_ctl, "A", m, 3 * open_ctl.state.registry.expiry_s)
        assert agent.registered and agent.stats.refusals == 0
        keys = store_chain(m, list(range(2 * CHUNK)))
        wait_until(lambda: open_ctl.state.index.tier_chunks("A", INFO.digest, "cpu") == 2, 5.0)
        assert len(keys) == 2
    finally:
        ctx.destroy(0)
        agent.close()
        m.close()


@pytest.mark.slow
def test_a_register_or_messages_for_a_live_id_from_a_stranger_change_nothing(open_ctl) -> None:
    m = _manager()
    agent = _agent(open_ctl, "A", m)
    ctx = zmq.Context()
    try:
        wait_until(lambda: agent.registered, 5.0)
        epoch = open_ctl.state.registry.get("A").epoch
        s = _dealer(ctx, open_ctl.zmq_url)
        s.send(F.encode(_register("A")))
        assert s.poll(2000)
        ack = F.decode_controller_message(s.recv())
        assert isinstance(ack, F.Ack) and not ack.known and "held by another live connection" in ack.refused
        fake = os.urandom(32)
        s.send(F.encode(F.Changes("A", "stranger", 1, [F.Change("s", INFO.digest, "cpu", fake)])))
        s.send(F.encode(F.Snapshot("A", "stranger", 1, INFO.digest, "cpu", b"", b"", True)))  # an empty snapshot
        s.send(F.encode(F.Heartbeat("A", "stranger", 0)))
        assert s.poll(2000) and F.decode_controller_message(s.recv()).known is False
        keys = store_chain(m, list(range(2 * CHUNK)))
        wait_until(lambda: open_ctl.state.index.tier_chunks("A", INFO.digest, "cpu") == 2, 5.0)
        assert open_ctl.state.index.keys_in("A", INFO.digest) == set(keys)  # nothing of the stranger's
        assert open_ctl.state.registry.get("A").epoch == epoch
        shown = {r["instance"]: r for r in open_ctl.ops.instances()}["A"]
        assert shown["epoch"] != epoch and epoch not in str(shown)  # the secret is never shown
        _still_served(open_ctl, "A", m, 2 * open_ctl.state.registry.expiry_s)
    finally:
        ctx.destroy(0)
        agent.close()
        m.close()


@pytest.mark.slow
def test_a_restarted_instance_takes_its_id_back_once_the_old_record_expires(open_ctl) -> None:
    """The other side of the coin: without keys, a real restart (new epoch, new connection) is refused
    only while the old record lives, and told when to retry (not the 10 s back-off)."""
    m = _manager()
    old = _agent(open_ctl, "A", m)
    try:
        wait_until(lambda: old.registered, 5.0)
        old.close()  # killed: no goodbye
        new = _agent(open_ctl, "A", m)
        t = wait_until(lambda: new.registered and open_ctl.state.registry.get("A").epoch == new.epoch, 10.0)
        assert t < 5.0
        new.close()
    finally:
        m.close()


@pytest.mark.slow
def test_with_keys_a_non_member_cannot_even_connect(keyed) -> None:
    ctl, keys = keyed
    ctx = zmq.Context()
    try:
        s = _dealer(ctx, ctl.zmq_url, key=FleetKey.generate(), server=keys.public("controller"))
        s.send(F.encode(_register("Z", epoch="z")))
        assert not s.poll(1000)  # the ZAP handler refused the CURVE handshake: nothing reaches the controller
        plain = _dealer(ctx, ctl.zmq_url)
        plain.send(F.encode(_register("Z", epoch="z")))
        assert not plain.poll(500)
        assert "Z" not in ctl.state.registry and ctl.endpoint.gate.denied >= 1
    finally:
        ctx.destroy(0)


@pytest.mark.slow
def test_with_keys_another_member_cannot_take_a_live_id(keyed) -> None:
    ctl, keys = keyed
    m = _manager()
    agent = _agent(ctl, "A", m, keys)
    ctx = zmq.Context()
    try:
        wait_until(lambda: agent.registered, 5.0)
        rec = ctl.state.registry.get("A")
        assert rec.member == "A" and rec.member_key == keys.public("A")
        s = _dealer(ctx, ctl.zmq_url, key=keys.keys["M"], server=keys.public("controller"))
        s.send(F.encode(_register("A", epoch=rec.epoch)))  # even with the (leaked) epoch
        assert s.poll(2000)
        ack = F.decode_controller_message(s.recv())
        assert not ack.known and "held by another live connection of member 'A'" in ack.refused
        s.send(F.encode(F.Heartbeat("A", rec.epoch, 0)))
        assert s.poll(2000) and F.decode_controller_message(s.recv()).known is False
        _still_served(ctl, "A", m, 2 * ctl.state.registry.expiry_s)
        assert ctl.state.registry.get("A").member_key == keys.public("A")
    finally:
        ctx.destroy(0)
        agent.close()
        m.close()


@pytest.mark.slow
def test_a_members_ids_and_models_are_enforced(keyed) -> None:
    ctl, keys = keyed
    keys.set_options("M", "ids=M-* models=other/*")
    time.sleep(1.1)  # the controller re-reads the members file at most once a second
    m = _manager()
    agent = _agent(ctl, "A-squat", m, FleetKeys(keys.root, {**keys.keys, "A-squat": keys.keys["M"]}))
    try:
        wait_until(lambda: agent.stats.refusals >= 1, 5.0)
        assert "may not register instance id 'A-squat'" in agent._last_refusal
    finally:
        agent.close()
    agent = _agent(ctl, "M-1", m, FleetKeys(keys.root, {**keys.keys, "M-1": keys.keys["M"]}))
    try:
        wait_until(lambda: agent.stats.refusals >= 1, 5.0)
        assert "may not register model" in agent._last_refusal
    finally:
        agent.close()
        m.close()


@pytest.mark.slow
def test_a_revoked_member_is_dropped_and_refused(keyed) -> None:
    ctl, keys = keyed
    m = _manager()
    agent = _agent(ctl, "B", m, keys)
    try:
        wait_until(lambda: agent.registered, 5.0)
        keys.revoke("B")
        wait_until(lambda: "B" not in ctl.state.registry, 5.0)
        time.sleep(3 * ctl.state.registry.expiry_s)
        assert "B" not in ctl.state.registry  # its reconnects are refused at the CURVE handshake
    finally:
        agent.close()
        m.close()


@pytest.mark.slow
def test_an_agent_reconnects_with_a_new_socket_after_silence(open_ctl) -> None:
    m = _manager()
    agent = _agent(open_ctl, "A", m)
    try:
        wait_until(lambda: agent.registered, 5.0)
        port, url = open_ctl.http_port, open_ctl.zmq_url
        open_ctl.stop()
        wait_until(lambda: agent.reconnects >= 1, 10.0)
        ctl2 = Controller(http_port=port, zmq_endpoint=url).start()
        try:
            wait_until(lambda: "A" in ctl2.state.registry, 10.0)
        finally:
            ctl2.stop()
    finally:
        agent.close()
        m.close()


def test_an_agent_endpoint_beyond_loopback_needs_member_keys() -> None:
    with pytest.raises(ControllerConfigError, match="--key and --members"):
        Controller(http_port=0, zmq_endpoint="tcp://0.0.0.0:0", token="t")


# -- kind 2 --------------------------------------------------------------------------------------------

POISON_CHILD = textwrap.dedent("""
    import sys, os
    sys.path.insert(0, sys.argv[1])
    import zmq
    from kvtier.protocol import fleet as F
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 2000)
    s.connect(sys.argv[2])
    for _ in range(3):
        s.send(os.urandom(20 << 20))  # 20 MiB frames: beyond the 16 MiB bound
    s.close()
    ctx.term()
""")


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.slow
def test_oversized_frames_are_refused_before_they_are_buffered(open_ctl) -> None:
    """The issue's input: 3 frames of 100 MB raised the controller by 323 MB (here 3 x 20 MiB from another process)."""
    before = _rss_bytes()
    bad = open_ctl.state.counters["malformed_frames"]
    subprocess.run([sys.executable, "-c", POISON_CHILD, str(Path(__file__).parents[1]), open_ctl.zmq_url],
                   timeout=60, check=True)
    time.sleep(0.5)
    assert _rss_bytes() - before < 30 << 20
    assert open_ctl.state.counters["malformed_frames"] == bad  # never even received


@pytest.mark.slow
def test_a_register_of_20000_namespaces_is_refused_without_stalling(open_ctl) -> None:
    m = _manager()
    agent = _agent(open_ctl, "A", m)
    ctx = zmq.Context()
    try:
        wait_until(lambda: agent.registered, 5.0)
        s = _dealer(ctx, open_ctl.zmq_url)
        frame = F.encode(_register("Z", namespaces=[INFO] * 20000))
        t0 = time.monotonic()
        for _ in range(5):
            s.send(frame)
        wait_until(lambda: open_ctl.state.counters["malformed_frames"] >= 5, 5.0)
        assert time.monotonic() - t0 < 1.0  # a hang guard: decoding stops at the 65th namespace
        _still_served(open_ctl, "A", m, 2 * open_ctl.state.registry.expiry_s)
        assert "Z" not in open_ctl.state.registry
    finally:
        ctx.destroy(0)
        agent.close()
        m.close()


def test_claims_are_bounded_by_the_declared_capacity() -> None:
    """The issue's input: an instance declaring room for 2,048 chunks got 1.5M keys indexed."""
    st = FleetState()
    cap_chunks = 2048
    reg = _register("A", tiers=[F.TierInfo("cpu", "cpu", cap_chunks * INFO.chunk_bytes),
                                F.TierInfo("remote", "redis://x", 0, True)])
    assert st.handle("conn-a", reg).known
    keys = os.urandom(32 * F.MAX_KEYS_PER_PART)
    for rid in range(3):
        st.handle("conn-a", F.Snapshot("A", "stranger", rid, INFO.digest, "cpu", keys, b"", rid == 2))
    held = st.index.tier_chunks("A", INFO.digest, "cpu")
    assert cap_chunks <= held <= cap_chunks + max(64, cap_chunks // 16)
    for seq in range(1, 4):
        st.handle("conn-a", F.Changes("A", "stranger", seq, [F.Change("s", INFO.digest, "cpu", os.urandom(32 * 4096))]))
    assert st.index.tier_chunks("A", INFO.digest, "cpu") == held and st.index.claims_dropped > 0
    small = FleetIndex(max_keys_per_instance=5000)  # and an instance as a whole
    small.add_instance("B", {"remote": F.TierInfo("remote", "redis://x", 0, True)}, [INFO.digest], {INFO.digest: 1})
    small.apply_snapshot(F.Snapshot("B", "e", 1, INFO.digest, "remote", keys, b"", True), "remote")
    assert small.held("B") == 5000


def test_a_bad_chunk_geometry_is_refused() -> None:
    st = FleetState()
    lying = F.NamespaceInfo(INFO.digest, INFO.spec, INFO.chunk_size, 1)  # 1-byte chunks: a huge capacity in chunks
    ack = st.handle("c", _register("A", namespaces=[lying]))
    assert not ack.known and "per chunk" in ack.refused


def test_an_empty_snapshot_of_a_shared_tier_erases_only_its_senders_view() -> None:
    """The issue's input: a member's empty snapshot of a shared tier erased every other sharer's entries."""
    idx = FleetIndex()
    shared = {"cpu": F.TierInfo("cpu", "cpu"), "remote": F.TierInfo("remote", "redis://h:6379/0", 0, True)}
    for inst in ("A", "B", "M"):
        idx.add_instance(inst, shared, [INFO.digest], {INFO.digest: INFO.chunk_bytes})
    ks = [os.urandom(32) for _ in range(4)]
    idx.apply_snapshot(F.Snapshot("A", "e", 1, INFO.digest, "remote", b"".join(ks), b"", True), "remote")
    assert idx.match("B", INFO.digest, ks).per_tier["remote"] == 4
    idx.apply_snapshot(F.Snapshot("M", "e", 1, INFO.digest, "remote", b"", b"", True), "remote")
    assert idx.match("B", INFO.digest, ks).per_tier["remote"] == 4  # M's empty view erased nothing of A's
    # A removal claimed by M reaches every view (the store is one) and the other sharers resync...
    idx.apply_changes(F.Changes("M", "e", 1, [F.Change("r", INFO.digest, "remote", b"".join(ks[2:]))]))
    assert idx.match("A", INFO.digest, ks).per_tier["remote"] == 2 and {"A", "B"} <= idx.needs_resync
    # ...whose snapshots (listings of the real store) repair it.
    idx.apply_snapshot(F.Snapshot("A", "e", 2, INFO.digest, "remote", b"".join(ks), b"", True), "remote")
    assert idx.match("B", INFO.digest, ks).per_tier["remote"] == 4


def test_a_heartbeat_cannot_store_megabytes_of_health(open_ctl) -> None:
    st = FleetState()
    assert st.handle("c", _register("A")).known
    huge = {"cpu": {"note": "x" * (1 << 20)}}
    frame = F.encode(F.Heartbeat("A", "stranger", 0, huge))
    st.handle("c", F.decode_agent_message(frame), size=len(frame))
    assert len(msgspec.json.encode(st.registry.get("A").health)) < 1024
    assert st.counters["health_dropped"] == 1
    small = F.encode(F.Heartbeat("A", "stranger", 0, {"cpu": {"reachable": True}}))
    st.handle("c", F.decode_agent_message(small), size=len(small))
    assert st.registry.get("A").health == {"cpu": {"reachable": True}}


def test_operations_carry_a_duration_not_a_wall_clock_time(open_ctl, monkeypatch) -> None:
    """The issue's input: an instance clock 15 s ahead failed every operation. The controller now sends
    ``timeout_s`` only; the agent counts it on its own monotonic clock (tests/test_fleet_agent.py: an
    absolute deadline 15 s off changes nothing)."""
    import kvtier.controller.endpoint as endpoint_mod

    m = _manager()
    agent = _agent(open_ctl, "A", m)
    try:
        wait_until(lambda: agent.registered, 5.0)
        sent: list[F.OpRequest] = []
        real = endpoint_mod.encode

        def spy(msg):
            if isinstance(msg, F.OpRequest):
                sent.append(msg)
            return real(msg)

        monkeypatch.setattr(endpoint_mod, "encode", spy)
        res = open_ctl.endpoint.request("A", "health", INFO.digest, {}, 5.0).result(10)
        assert res.ok and sent and sent[0].deadline == 0.0 and sent[0].timeout_s == 5.0
    finally:
        agent.close()
        m.close()


def test_a_stranger_registered_on_an_open_controller_is_never_located(open_ctl, fleet) -> None:
    """The issue's input (kind 2): a registered agent claims a public prompt's keys and advertises its own
    peer_url (a server serving 0xEE bytes with correct checksums); /locate ranked it first and an instance
    with peer_discovery loaded 4 of 4 poisoned chunks. Now: an unauthenticated registration with a TCP
    peer_url is never listed, and the puller loads nothing poisoned."""
    evil = _manager(peer_listen="tcp://127.0.0.1:0", **fleet.config("c"))  # even a well-formed peer server
    tokens = list(range(4 * CHUNK))
    keys = evil.keys(tokens)
    for i, k in enumerate(keys):
        buf = evil.open_write(k, keys[i - 1] if i else None)
        buf[:] = 0xEE
        evil.commit(k, keys[i - 1] if i else None)
    import threading

    stop = threading.Event()
    acked: list[bool] = []

    def stranger() -> None:  # owns its socket: registers, claims the keys, then heartbeats (stays live)
        ctx = zmq.Context()
        s = _dealer(ctx, open_ctl.zmq_url)
        try:
            s.send(F.encode(_register("0-evil", peer_url=evil.peer_server.url)))  # "0" sorts first
            acked.append(bool(s.poll(10_000)) and F.decode_controller_message(s.recv()).known)
            s.send(F.encode(F.Snapshot("0-evil", "stranger", 1, INFO.digest, "cpu", b"".join(keys), b"", True)))
            while not stop.wait(0.1):
                s.send(F.encode(F.Heartbeat("0-evil", "stranger", 0)))
                while s.poll(0):
                    s.recv()
        finally:
            ctx.destroy(0)

    t = threading.Thread(target=stranger, daemon=True)
    t.start()
    a = _manager(peer_discovery=open_ctl.http_url, instance_id="A", **fleet.config("a"))
    try:
        wait_until(lambda: open_ctl.state.index.tier_chunks("0-evil", INFO.digest, "cpu") == 4, 10.0)
        assert acked == [True]
        assert a.lookup(tokens).num_tokens == 0
        assert read_chain(a, keys) == [None] * 4
        assert "0-evil" in open_ctl.state.registry  # still registered and claiming: it was not located
        assert evil.peer_server.counters["accepted"] == 0  # never even dialled
    finally:
        stop.set()
        t.join(5)
        a.close()
        evil.close()


def test_a_keyed_fleet_locates_members_with_their_key(keyed, tmp_path: Path) -> None:
    """Controller-directed P2P in a keyed fleet: the located member is dialled and must prove its key."""
    ctl, keys = keyed
    settings = lambda name: {**keys.config(name), "controller_key": keys.public("controller")}  # noqa: E731
    b = _manager(peer_listen="tcp://127.0.0.1:0", **settings("B"))
    agent = _agent(ctl, "B", b, keys)
    a = _manager(peer_discovery=ctl.http_url, instance_id="A", **settings("A"))
    try:
        tokens = list(range(3 * CHUNK))
        keys_b = store_chain(b, tokens)
        wait_until(lambda: ctl.state.index.tier_chunks("B", INFO.digest, "cpu") == 3, 5.0)
        with __import__("kvtier.controller.client", fromlist=["ControllerClient"]).ControllerClient(ctl.http_url) as c:
            rows = c.locate([k.hex() for k in keys_b], INFO.digest.hex(), "A")["instances"]
        assert rows[0]["instance"] == "B" and rows[0]["key"] == keys.public("B")
        got = read_chain(a, keys_b)
        assert all(g is not None and np.array_equal(g, payload_for(k, CB)) for k, g in zip(keys_b, got))
    finally:
        a.close()
        agent.close()
        b.close()
