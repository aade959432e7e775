"""Controller-directed P2P: a real controller (in process, real ZMQ and HTTP), three storage managers
with real fleet agents, real peer servers over TCP. The fleet is keyed (issue 24): the controller's agent
endpoint is CURVE, each instance has its own key, and peers authenticate.

A has ``peer_discovery`` (the controller-directed peer tier); B and C serve peers (``peer_listen``);
C holds a prompt's 4 chunks, B only the first 2. Every check reads real state: payload bytes, where
chunks live in A's tiers, which peer servers saw connections, the tier's pool.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import httpx
import numpy as np
import pytest

from conftest import CHUNK, payload_for, small_namespace, wait_until
from service_helpers import connect, server_config, short_dir, store  # noqa: F401
from transfer_helpers import CB, store_chain, read_chain
from kvtier.config import KVTierConfig
from kvtier.controller.client import ControllerClient
from kvtier.controller.server import Controller
from kvtier.fleet.agent import FleetAgent, namespace_info, tier_infos
from kvtier.protocol import fleet as F
from kvtier.service.server import CacheServer, ServerOptions
from kvtier.storage.instance_ops import InstanceOps
from kvtier.storage.manager import StorageManager
from kvtier.transfer.assembly import open_manager
from kvtier.testing.fleet_keys import FleetKeys, make_fleet
from kvtier.transfer.directed_peer import DirectedPeerTier

NS = small_namespace()
TIMEOUT_S = 0.5
#: Every key is in the members file before any instance starts (as an operator would write it).
MEMBERS = ["controller", "A", "B", "C", "X", "srv"]


class Fleet:
    """A controller and named instances (manager + agent)."""

    def __init__(self, keys: FleetKeys, token: str = "") -> None:
        self.token = token
        self.keys = keys
        self.ctl = Controller(http_port=0, zmq_endpoint="tcp://127.0.0.1:0", token=token,
                              credentials=keys.credentials("controller")).start()
        self.managers: dict[str, StorageManager] = {}
        self.agents: dict[str, FleetAgent] = {}

    def settings(self, name: str) -> dict[str, Any]:
        """Member ``name``'s key settings (its key added to the members file first)."""
        if name not in self.keys.keys:
            self.keys.add(name)
        return {**self.keys.config(name), "controller_key": self.keys.public("controller")}

    def add(self, name: str, **cfg: Any) -> StorageManager:
        cfg.setdefault("controller_token", self.token or None)
        keyed = self.settings(name)
        m = open_manager(KVTierConfig(chunk_size=CHUNK, cpu_capacity=32 * CB, instance_id=name,
                                        peer_timeout_s=TIMEOUT_S, peer_retry_s=0.2, **keyed, **cfg), NS)
        info = namespace_info(NS)
        self.agents[name] = FleetAgent(self.ctl.zmq_url, name, "embedded", {info.digest: (info, InstanceOps(m))},
                                       tier_infos(m), token=self.token, credentials=self.keys.credentials(name),
                                       controller_key=self.keys.public("controller")).start()
        self.managers[name] = m
        return m

    def locate(self, keys: list[bytes], exclude_instance: str | None = None) -> dict[str, Any]:
        with ControllerClient(self.ctl.http_url, token=self.token, timeout_s=5) as client:
            out = client.locate([k.hex() for k in keys], NS.digest().hex(), exclude_instance)
        return {row["instance"]: row for row in out["instances"]}

    def held_by(self, name: str, keys: list[bytes], n: int) -> None:
        """Wait until the controller's index says ``name`` holds the first ``n`` of ``keys``."""
        wait_until(lambda: self.locate(keys).get(name, {}).get("chunks") == n)

    def close(self) -> None:
        for a in self.agents.values():
            a.close()
        for m in self.managers.values():
            m.close()
        self.ctl.stop()


@pytest.fixture
def fleet(tmp_path: Path):
    f = Fleet(make_fleet(tmp_path / "keys", MEMBERS))
    yield f
    f.close()


def directed(m: StorageManager) -> DirectedPeerTier:
    tiers = [t for t in m.lower if isinstance(t, DirectedPeerTier)]
    assert len(tiers) == 1
    return tiers[0]


def three(fleet: Fleet, tokens: list[int]) -> tuple[StorageManager, StorageManager, StorageManager, list[bytes]]:
    a = fleet.add("A", peer_discovery=fleet.ctl.http_url)
    b = fleet.add("B", peer_listen="tcp://127.0.0.1:0")
    c = fleet.add("C", peer_listen="tcp://127.0.0.1:0")
    keys = store_chain(c, tokens)
    store_chain(b, tokens[: 2 * CHUNK])
    fleet.held_by("C", keys, len(keys))
    fleet.held_by("B", keys, 2)
    return a, b, c, keys


def test_registration_carries_the_real_peer_url(fleet: Fleet) -> None:
    fleet.add("A", peer_discovery=fleet.ctl.http_url)
    c = fleet.add("C", peer_listen="tcp://127.0.0.1:0")
    wait_until(lambda: len(fleet.ctl.ops.instances()) == 2)
    rows = {r["instance"]: r for r in httpx.get(fleet.ctl.http_url + "/instances", timeout=5).json()["instances"]}
    assert rows["C"]["peer_url"] == c.peer_server.url and not c.peer_server.url.endswith(":0")
    assert rows["A"]["peer_url"] == ""


def test_a_miss_is_pulled_from_the_peer_with_the_longest_run(fleet: Fleet) -> None:
    tokens = list(range(4 * CHUNK + 3))
    a, b, c, keys = three(fleet, tokens)
    assert all(a.where(k) is None for k in keys)
    hit = a.lookup(tokens)
    assert hit.num_tokens == 4 * CHUNK and hit.tiers == ["peer"] * 4
    got = read_chain(a, keys)
    assert all(g is not None and np.array_equal(g, payload_for(k, CB)) for k, g in zip(keys, got))
    assert all(a.where(k) == "cpu" for k in keys), "the pulled chunks were not promoted into A's CPU tier"
    tier = directed(a)
    assert tier.pool_urls == [c.peer_server.url]
    assert b.peer_server.connections == 0, "A asked B, whose run is shorter"
    assert tier.counters.snapshot()["get_hits"] == 4


@pytest.mark.slow
def test_a_peer_closed_after_registering_is_a_bounded_miss(fleet: Fleet) -> None:
    tokens = list(range(1000, 1000 + 4 * CHUNK + 1))
    a, _b, c, _keys = three(fleet, tokens)
    assert a.lookup(tokens).num_tokens == 4 * CHUNK  # the connection to C is pooled now
    other = list(range(5000, 5000 + 3 * CHUNK + 1))
    other_keys = store_chain(c, other)
    fleet.held_by("C", other_keys, 3)
    c.close()  # C's peer server is gone; its agent still reports it to the controller
    t0 = time.monotonic()
    hit = a.lookup(other)
    assert hit.num_tokens == 0
    assert time.monotonic() - t0 < 10 * TIMEOUT_S, "the lookup hung on a dead peer"
    assert all(a.where(k) is None for k in other_keys)
    fleet.agents["C"].close()  # now the controller forgets C: its pooled connection is closed
    wait_until(lambda: "C" not in {r["instance"] for r in fleet.ctl.ops.instances()})
    assert directed(a).contains_many(other_keys) == [False] * 3
    assert c.peer_server.url not in directed(a).pool_urls


def test_a_lookup_asks_the_controller_only_and_a_chunk_the_peer_lost_is_a_pull_miss(fleet: Fleet) -> None:
    """The lookup trusts the controller's index (no request to the peer, whose link is only checked
    open); a chunk the peer evicted after the index said so is a miss of the pull, never an error,
    and nothing is committed in its place."""
    tokens = list(range(9000, 9000 + 3 * CHUNK + 1))
    a, _b, c, keys = three(fleet, tokens)
    assert a.lookup(tokens).num_tokens == 3 * CHUNK  # dials and authenticates C's peer server
    served = c.peer_server.counters["requests"]
    assert a.lookup(tokens).num_tokens == 3 * CHUNK
    assert c.peer_server.counters["requests"] == served, "the lookup sent the peer a request"
    for k in reversed(keys[1:]):  # C loses chunks 1-2 (children first); A's tier still routes them to C
        assert c.cpu.delete(k)
    got = read_chain(a, keys)
    assert got[0] is not None and np.array_equal(got[0], payload_for(keys[0], CB))
    assert got[1:] == [None, None]
    assert a.where(keys[0]) == "cpu" and all(a.where(k) is None for k in keys[1:])
    assert c.peer_server.counters["requests"] > served


def test_a_peer_gone_between_lookup_and_pull_is_a_miss(fleet: Fleet) -> None:
    tokens = list(range(7000, 7000 + 3 * CHUNK + 1))
    a, _b, c, keys = three(fleet, tokens)
    assert a.lookup(tokens).num_tokens == 3 * CHUNK  # A's tier remembers C holds them
    c.close()
    t0 = time.monotonic()
    assert read_chain(a, keys) == [None] * 3
    assert time.monotonic() - t0 < 10 * TIMEOUT_S, "the pull hung on a dead peer"
    assert all(a.where(k) is None for k in keys), "nothing may be committed from a failed pull"


def test_the_controller_down_is_a_miss_then_skipped_for_retry_s(fleet: Fleet) -> None:
    tokens = list(range(2000, 2000 + 4 * CHUNK + 1))
    a, _b, c, keys = three(fleet, tokens)
    fleet.ctl.stop()
    tier = directed(a)
    t0 = time.monotonic()
    assert a.lookup(tokens).num_tokens == 0
    assert time.monotonic() - t0 < 10 * TIMEOUT_S
    assert tier.locate_failures == 1
    skipped = tier.counters.snapshot().get("skipped_calls", 0)
    assert tier.contains_many(keys) == [False] * 4  # inside peer_retry_s: not asked again
    assert tier.locate_failures == 1 and tier.counters.snapshot()["skipped_calls"] == skipped + 1
    assert c.peer_server.connections == 0 and all(a.where(k) is None for k in keys)


def test_an_instance_never_pulls_from_itself(fleet: Fleet) -> None:
    tokens = list(range(3000, 3000 + 4 * CHUNK + 1))
    a = fleet.add("A", peer_discovery=fleet.ctl.http_url, peer_listen="tcp://127.0.0.1:0")
    keys = store_chain(a, tokens)
    fleet.held_by("A", keys, 4)  # the controller knows A holds them and serves peers
    tier = directed(a)
    assert tier.contains_many(keys) == [False] * 4
    assert tier.pool_urls == [] and a.peer_server.connections == 0
    assert fleet.locate(keys, exclude_instance="A") == {}
    # Without an instance id the asking process is excluded (host and pid), whatever the instance's id.
    creds = fleet.keys.credentials("A")
    anon = DirectedPeerTier(fleet.ctl.http_url, NS.digest(), instance_id=None, timeout_s=TIMEOUT_S, credentials=creds)
    other = DirectedPeerTier(fleet.ctl.http_url, NS.digest(), instance_id="someone-else", timeout_s=TIMEOUT_S,
                             credentials=creds)
    try:
        assert anon.contains_many(keys) == [False] * 4 and anon.pool_urls == []
        assert other.contains_many(keys) == [True] * 4  # the same call from another instance does hit
    finally:
        anon.close()
        other.close()


def test_a_wrong_token_is_a_miss_the_right_one_a_hit(tmp_path: Path) -> None:
    fleet = Fleet(make_fleet(tmp_path / "keys", MEMBERS), token="s3cret")
    try:
        tokens = list(range(4000, 4000 + 2 * CHUNK + 1))
        good = fleet.add("A", peer_discovery=fleet.ctl.http_url)
        bad = fleet.add("X", peer_discovery=fleet.ctl.http_url, controller_token="wrong")
        c = fleet.add("C", peer_listen="tcp://127.0.0.1:0")
        keys = store_chain(c, tokens)
        fleet.held_by("C", keys, 2)
        assert bad.lookup(tokens).num_tokens == 0 and directed(bad).locate_failures == 1
        assert good.lookup(tokens).num_tokens == 2 * CHUNK
    finally:
        fleet.close()


def test_a_kvtier_server_registers_its_peer_url_and_serves_a_pull(fleet: Fleet, short_dir: Path) -> None:  # noqa: F811
    srv = CacheServer(server_config(32, peer_listen="tcp://127.0.0.1:0", **fleet.settings("srv")),
                      ServerOptions(socket_path=str(short_dir / "s.sock"), controller=fleet.ctl.zmq_url,
                                    instance_id="srv")).start()
    try:
        tokens = list(range(6000, 6000 + 3 * CHUNK + 1))
        client = connect(short_dir / "s.sock", NS)
        a = fleet.add("A", peer_discovery=fleet.ctl.http_url)
        keys = a.keys(tokens)
        store(client, keys)
        fleet.held_by("srv", keys, 3)
        rows = {r["instance"]: r for r in fleet.ctl.ops.instances()}
        assert rows["srv"]["peer_url"] == srv.peer_server.url
        assert a.lookup(tokens).num_tokens == 3 * CHUNK
        got = read_chain(a, keys)
        assert all(g is not None and np.array_equal(g, payload_for(k, CB)) for k, g in zip(keys, got))
        client.close()
    finally:
        srv.close()


def test_locate_validates_its_input(fleet: Fleet) -> None:
    url = fleet.ctl.http_url + "/locate"
    ns = NS.digest().hex()
    bad = [
        {"keys": ["zz" * 32], "namespace": ns},
        {"keys": [], "namespace": ns},
        {"keys": ["00" * 32] * (F.MAX_LOCATE_KEYS + 1), "namespace": ns},
        {"keys": ["00" * 32], "namespace": "00"},
        {"keys": ["00" * 32], "namespace": ns, "extra": 1},
    ]
    for body in bad:
        r = httpx.post(url, json=body, timeout=5)
        assert r.status_code == 422, (body.keys(), r.text)


def test_register_is_compatible_and_checks_the_peer_url(fleet: Fleet) -> None:
    import msgspec

    from kvtier.controller.registry import InstanceRegistry, RegistrationError

    old = msgspec.msgpack.encode({"type": "register", "instance": "x", "epoch": "e", "version": 1,
                                  "role": "embedded", "host": "h", "pid": 1, "namespaces": [], "tiers": []})
    msg = F.decode_agent_message(old)
    assert isinstance(msg, F.Register) and msg.peer_url == ""
    reg = InstanceRegistry()
    tiers = [F.TierInfo("cpu", "cpu")]
    rec, _ = reg.register(F.Register("x", "e", 1, "embedded", "h", 1, [], tiers, "", "tcp://10.0.0.5:7700"))
    assert rec.peer_url == "tcp://10.0.0.5:7700"
    for url in ("http://x:1", "tcp://", "tcp://a\n:1", "tcp://" + "a" * F.MAX_PEER_URL):
        with pytest.raises(RegistrationError):
            reg.register(F.Register("y", "e", 1, "embedded", "h", 1, [], tiers, "", url))


def test_a_wildcard_listen_host_is_advertised_as_the_host_name() -> None:
    import socket

    from kvtier.fleet.identity import advertised_peer_url

    assert advertised_peer_url("tcp://0.0.0.0:7700") == f"tcp://{socket.gethostname()}:7700"
    assert advertised_peer_url("nixl://[::]:7701") == f"nixl://{socket.gethostname()}:7701"
    for same in ("tcp://10.0.0.5:7700", "shm:///run/kvtier-peer.sock", ""):
        assert advertised_peer_url(same) == same


def test_peer_discovery_setting_is_validated() -> None:
    assert KVTierConfig(peer_discovery="http://10.0.0.1:7601").peer_discovery == "http://10.0.0.1:7601"
    assert KVTierConfig(peer_discovery="").peer_discovery is None
    for bad in ("tcp://10.0.0.1:7601", "http://host", "http://host:0", "10.0.0.1:7601"):
        with pytest.raises(ValueError, match="peer_discovery"):
            KVTierConfig(peer_discovery=bad)
