"""A live instance registering again (same process, same epoch) keeps its index: found by the fleet soak.

``kvtier bench soak-fleet`` saw all three instances "drop off" at once: the controller paused (a
loaded machine, a hostile client's floods), every agent found it silent for longer than its
``expiry_s``, reconnected and sent a Register, and each Register emptied the instance's index until
its snapshot arrived, so for that while lookups and ``/locate`` answered nothing for any of them.
A Register from the record's owner with the record's epoch is the same process: its index stays
served and its registration time is kept; another epoch (a restart) still starts from empty.
"""

from __future__ import annotations

import pytest

import os
import time

from conftest import CHUNK, small_namespace
from transfer_helpers import CB, store_chain
from kvtier.config import KVTierConfig
from kvtier.controller.registry import Sender
from kvtier.controller.server import Controller
from kvtier.controller.state import FleetState
from kvtier.fleet.agent import FleetAgent, namespace_info, tier_infos
from kvtier.protocol import fleet as F
from kvtier.protocol.trust import FleetKey, Member, Members
from kvtier.storage.instance_ops import InstanceOps
from kvtier.storage.manager import StorageManager
from kvtier.testing.fleet_cluster import wait_until

NS = small_namespace()
INFO = namespace_info(NS)


def _register(epoch: str) -> F.Register:
    return F.Register("A", epoch, F.FLEET_PROTOCOL_VERSION, "server", "h", 1, [INFO],
                      [F.TierInfo("cpu", "cpu", 64 * INFO.chunk_bytes)])


def _snapshot(epoch: str, keys: list[bytes]) -> F.Snapshot:
    return F.Snapshot("A", epoch, 1, INFO.digest, "cpu", b"".join(keys), b"", True)


def test_the_same_process_registering_again_keeps_its_index() -> None:
    key = FleetKey.generate("A")
    st = FleetState(members=Members.of(Member("A", key.public)))
    first, again = Sender(b"conn-1", key.public), Sender(b"conn-2", key.public)  # a new connection, same member
    keys = [os.urandom(32) for _ in range(5)]
    assert st.handle(first, _register("e1")).known
    st.handle(first, _snapshot("e1", keys))
    registered_at = st.registry.get("A").registered_at
    assert st.index.tier_chunks("A", INFO.digest, "cpu") == 5
    ack = st.handle(again, _register("e1"))  # the agent reconnected after a silence
    assert ack.known and ack.resync  # it still sends a snapshot, which refreshes the index
    assert st.index.tier_chunks("A", INFO.digest, "cpu") == 5  # served meanwhile (was 0 until the snapshot)
    assert st.registry.get("A").registered_at == registered_at
    assert st.registry.get("A").routing_id == b"conn-2" and st.counters["reregistrations"] == 1
    st.handle(again, _register("e2"))  # a restart (another epoch): its old index is void
    assert st.index.tier_chunks("A", INFO.digest, "cpu") == 0


@pytest.mark.slow
def test_a_controller_pause_longer_than_the_agents_patience_is_no_outage() -> None:
    """End to end: the controller stalls 2.5 s (past the agent's 1.8 s), the agent reconnects and
    registers again; the instance's record keeps its registration and its indexed chunks."""
    ctl = Controller(http_port=0, zmq_endpoint="tcp://127.0.0.1:0").start()
    m = StorageManager(KVTierConfig(chunk_size=CHUNK, cpu_capacity=32 * CB), NS)
    agent = FleetAgent(ctl.zmq_url, "A", "embedded", {INFO.digest: (INFO, InstanceOps(m))}, tier_infos(m)).start()
    try:
        wait_until(lambda: agent.registered, 5.0)
        store_chain(m, list(range(3 * CHUNK)))
        wait_until(lambda: ctl.state.index.tier_chunks("A", INFO.digest, "cpu") == 3, 5.0)
        registered_at = ctl.state.registry.get("A").registered_at
        with ctl.state.lock:  # the endpoint and the HTTP API wait: a paused controller
            time.sleep(2.5)
        wait_until(lambda: ctl.state.counters["registrations"] >= 2, 5.0)  # the agent did register again
        with ctl.state.lock:
            assert ctl.state.registry.get("A").registered_at == registered_at
            assert ctl.state.index.tier_chunks("A", INFO.digest, "cpu") == 3
        assert agent.reconnects >= 1 and ctl.state.counters["expirations"] == 0
    finally:
        agent.close()
        m.close()
        ctl.stop()


@pytest.mark.slow
def test_a_pause_of_the_controller_and_the_agent_together_expires_no_one(monkeypatch) -> None:
    """The fleet soak's other finding: a machine-wide pause (CPU starvation) of about a second stops the
    agent's heartbeats and the controller's endpoint alike; when the endpoint ran again first, its sweep
    found the instance silent past 0.9 s and dropped it, although the controller had heard nothing from
    anyone for that while. Time the endpoint was not running is no longer held against instances."""
    ctl = Controller(http_port=0, zmq_endpoint="tcp://127.0.0.1:0").start()
    m = StorageManager(KVTierConfig(chunk_size=CHUNK, cpu_capacity=32 * CB), NS)
    agent = FleetAgent(ctl.zmq_url, "A", "embedded", {INFO.digest: (INFO, InstanceOps(m))}, tier_infos(m)).start()
    try:
        wait_until(lambda: agent.registered, 5.0)
        registered_at = ctl.state.registry.get("A").registered_at
        paused = {"until": 0.0}
        real_send, real_poll = agent._send, ctl.endpoint._poll

        def agent_send(sock, msg):  # the paused agent sends nothing
            return False if time.monotonic() < paused["until"] + 0.1 else real_send(sock, msg)

        def endpoint_poll(poller):  # the paused endpoint returns from one poll 1.2 s late
            if paused.pop("stall", False):
                time.sleep(1.2)
            return real_poll(poller)

        monkeypatch.setattr(agent, "_send", agent_send)
        monkeypatch.setattr(ctl.endpoint, "_poll", endpoint_poll)
        paused["until"] = time.monotonic() + 1.2
        paused["stall"] = True
        time.sleep(2.5)
        assert ctl.endpoint.stalls >= 1
        assert ctl.state.counters["expirations"] == 0
        assert ctl.state.registry.get("A").registered_at == registered_at
    finally:
        agent.close()
        m.close()
        ctl.stop()


@pytest.mark.slow
def test_a_pause_while_frames_are_handled_expires_no_one(monkeypatch) -> None:
    """The fleet soak's third finding: all three instances dropped off at once while their agents kept
    sending heartbeats. The endpoint had read its frames on time, then was not running (the CPU, the GIL)
    for about a second before its sweep: the heartbeats that arrived meanwhile waited unread in the
    socket, and the sweep found every instance silent past 0.9 s. Time the thread was runnable but not
    running while it handled frames (wall time minus its CPU time) is excused too."""
    ctl = Controller(http_port=0, zmq_endpoint="tcp://127.0.0.1:0").start()
    m = StorageManager(KVTierConfig(chunk_size=CHUNK, cpu_capacity=32 * CB), NS)
    agent = FleetAgent(ctl.zmq_url, "A", "embedded", {INFO.digest: (INFO, InstanceOps(m))}, tier_infos(m)).start()
    try:
        wait_until(lambda: agent.registered, 5.0)
        registered_at = ctl.state.registry.get("A").registered_at
        real_send, real_thread_time = ctl.endpoint._send_outbox, ctl.endpoint._thread_time
        paused = {"stall": False}

        def send_outbox(sock):  # the endpoint is descheduled 1.2 s after reading its frames, before the sweep
            if paused.pop("stall", False):
                t_cpu = real_thread_time()
                time.sleep(1.2)  # off CPU: what a starved thread's clocks show (its CPU time does not move)
                assert real_thread_time() - t_cpu < 0.1
            return real_send(sock)

        monkeypatch.setattr(ctl.endpoint, "_send_outbox", send_outbox)
        paused["stall"] = True
        time.sleep(2.5)
        assert "stall" not in paused and ctl.endpoint.stalls >= 1
        assert ctl.state.counters["expirations"] == 0
        assert ctl.state.registry.get("A").registered_at == registered_at
    finally:
        agent.close()
        m.close()
        ctl.stop()
