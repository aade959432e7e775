"""The fleet agent against a minimal in-test ROUTER (no controller needed).

Checks what the controller would see: the Register, a snapshot equal to the
instance's real tier state, Changes with consecutive seq, resync and re-register
on request, operations answered with OpResult, and that the engine side never
blocks when no controller listens.
"""

from __future__ import annotations

import os
import stat
import time
from typing import Any

import pytest
import zmq

from kvtier.config import KVTierConfig
from kvtier.fleet import ChangeQueue, FleetAgent, namespace_info, tier_infos
from kvtier.index.keys import KeyNamespace, LayoutSignature
from kvtier.protocol import fleet as F
from kvtier.storage.manager import StorageManager
from kvtier.storage.tier_events import TierChange

from service_helpers import connect, short_dir, start_server, store, wait_until  # noqa: F401 (fixture)

instance_ops = pytest.importorskip("kvtier.storage.instance_ops")

CHUNK = 16


def _namespace() -> KeyNamespace:
    layout = LayoutSignature(engine="test", attn_backend="x", kv_layout="x", dtype="uint8", block_size=16,
                             num_layers=1, num_kv_heads=1, head_dim=8)
    return KeyNamespace(model="fleet-test", layout=layout, chunk_size=CHUNK)


@pytest.fixture
def manager(tmp_path):
    ns = _namespace()
    cfg = KVTierConfig(chunk_size=CHUNK, cpu_capacity=64 * ns.chunk_bytes, disk_path=tmp_path / "disk",
                       disk_capacity=1 << 22)
    m = StorageManager(cfg, ns)
    yield m
    m.close()


def _store(m: StorageManager, n: int, start: int = 0) -> list[bytes]:
    tokens = list(range(start * CHUNK, (start + n) * CHUNK))
    keys = m.keys(tokens)
    parent = None
    for k in keys:
        buf = m.open_write(k, parent)
        if buf is not None:
            buf[:] = 7
            m.commit(k, parent)
        parent = k
    return keys


class Router:
    """The controller's socket, scripted by the test."""

    def __init__(self, port: int = 0):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port:
            self.sock.bind(f"tcp://127.0.0.1:{port}")
        else:
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.port = port
        self.url = f"tcp://127.0.0.1:{port}"

    def recv(self, timeout_s: float = 5.0) -> tuple[bytes, Any]:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("no agent message")
        ident, frame = self.sock.recv_multipart()
        return ident, F.decode_agent_message(frame)

    def recv_until(self, kind: type, timeout_s: float = 5.0, keep: list | None = None) -> tuple[bytes, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            ident, msg = self.recv(max(0.01, deadline - time.monotonic()))
            if keep is not None:
                keep.append(msg)
            if isinstance(msg, kind):
                return ident, msg

    def send(self, ident: bytes, msg: Any) -> None:
        self.sock.send_multipart([ident, F.encode(msg)])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _snapshot_state(
    router: Router, ident: bytes, timeout_s: float = 5.0, tiers_expected: tuple[str, ...] = ("cpu", "disk")
) -> tuple[dict[str, set[bytes]], int]:
    """Collect one full snapshot round (every tier of ``tiers_expected`` up to its last part): tier -> keys, seq."""
    tiers: dict[str, set[bytes]] = {}
    done: set[str] = set()
    seq = -1
    rid = None
    deadline = time.monotonic() + timeout_s
    while not set(tiers_expected) <= done:
        _, msg = router.recv(max(0.01, deadline - time.monotonic()))
        if isinstance(msg, F.Heartbeat):
            router.send(ident, F.Ack("c1", True))
            continue
        if not isinstance(msg, F.Snapshot):
            continue
        if rid is None:
            rid = msg.resync_id
        assert msg.resync_id == rid
        tiers.setdefault(msg.tier, set()).update(F.split_keys(msg.keys))
        seq = msg.seq
        if msg.last:
            done.add(msg.tier)
    return tiers, seq


def _expected(ops) -> dict[str, set[bytes]]:
    return {tier: {k for k, _ in entries} for tier, entries in ops.snapshot().items()}


def _agent(router: Router, manager: StorageManager, **kw) -> tuple[FleetAgent, Any]:
    ops = instance_ops.InstanceOps(manager)
    info = namespace_info(manager.namespace)
    agent = FleetAgent(router.url, "inst-1", "embedded", {info.digest: (info, ops)}, tier_infos(manager),
                       token="t", heartbeat_s=0.05, **kw)
    return agent.start(), ops


def _register(router: Router) -> tuple[bytes, F.Register]:
    ident, reg = router.recv_until(F.Register)
    router.send(ident, F.Ack("c1", True))
    return ident, reg


def test_register_snapshot_changes_heartbeat(manager) -> None:
    first = _store(manager, 3)
    manager.flush()
    router = Router()
    agent, ops = _agent(router, manager)
    try:
        ident, reg = _register(router)
        # The controller's ROUTER names the connection (issue 24): the agent claims no routing identity.
        assert ident[:1] == b"\x00" and reg.instance == "inst-1" and reg.role == "embedded"
        assert reg.version == F.FLEET_PROTOCOL_VERSION
        assert reg.namespaces[0].digest == manager.namespace.digest() and reg.token == "t"
        assert {t.kind for t in reg.tiers} == {"cpu", "disk"}
        state, seq = _snapshot_state(router, ident)
        exp = _expected(ops)
        assert state["cpu"] == exp["cpu"] == set(first)
        assert state.get("disk", set()) == exp.get("disk", set())
        # Changes: every later store arrives, seq 1, 2, 3...
        more = _store(manager, 2, start=10)
        seen: set[bytes] = set()
        seqs: list[int] = []
        deadline = time.monotonic() + 5
        while not set(more) <= seen and time.monotonic() < deadline:
            _, msg = router.recv()
            if isinstance(msg, F.Changes):
                seqs.append(msg.seq)
                for ch in msg.changes:
                    if ch.op == "s" and ch.tier == "cpu":
                        seen.update(F.split_keys(ch.keys))
            elif isinstance(msg, F.Heartbeat):
                router.send(ident, F.Ack("c1", True))
        assert set(more) <= seen
        assert seqs == list(range(seq + 1, seq + 1 + len(seqs)))
        _, hb = router.recv_until(F.Heartbeat)
        assert hb.seq >= seqs[-1] and hb.epoch == reg.epoch
    finally:
        agent.close()
        router.close()


def test_resync_and_reregister(manager) -> None:
    _store(manager, 2)
    router = Router()
    agent, ops = _agent(router, manager)
    try:
        ident, reg = _register(router)
        _snapshot_state(router, ident)
        keys = _store(manager, 2, start=5)
        router.send(ident, F.Ack("c1", True, resync=True))
        state, _ = _snapshot_state(router, ident)
        assert set(keys) <= state["cpu"] and state["cpu"] == _expected(ops)["cpu"]
        # a restarted controller: known=False -> Register again (same epoch) then a snapshot
        router.send(ident, F.Ack("c2", False))
        _, reg2 = router.recv_until(F.Register)
        assert reg2.epoch == reg.epoch
        router.send(ident, F.Ack("c2", True))
        state, _ = _snapshot_state(router, ident)
        assert state["cpu"] == _expected(ops)["cpu"]
    finally:
        agent.close()
        router.close()


def test_silence_triggers_reregister(manager) -> None:
    router = Router()
    agent, _ = _agent(router, manager, expiry_s=0.3)
    try:
        ident, _ = _register(router)
        _snapshot_state(router, ident)
        # never answer heartbeats: the agent registers again after the expiry
        _, reg = router.recv_until(F.Register, timeout_s=3)
        assert reg.instance == "inst-1"
    finally:
        agent.close()
        router.close()


def test_op_request_runs_against_the_tiers(manager) -> None:
    keys = _store(manager, 3)
    router = Router()
    agent, ops = _agent(router, manager)
    try:
        ident, _ = _register(router)
        _snapshot_state(router, ident)
        ns = manager.namespace.digest()
        router.send(ident, F.OpRequest("op1", "clear", ns, {"tier": "cpu"}))
        _, res = router.recv_until(F.OpResult)
        assert res.op_id == "op1" and res.ok, res.error
        assert not any(manager.cpu.contains(k) for k in keys)  # the tier's real state
        router.send(ident, F.OpRequest("op2", "compress", ns, {"keys": b"".join(keys), "tier": "cpu",
                                                                  "codec": "no-such-codec"}))
        _, res = router.recv_until(F.OpResult)
        assert res.op_id == "op2" and not res.ok and res.error
        router.send(ident, F.OpRequest("op3", "health", ns, {}, timeout_s=1e-9))
        _, res = router.recv_until(F.OpResult)
        assert not res.ok and res.error == "deadline"
        # Issue 24: a deadline is a duration on the agent's clock; an absolute time from a controller whose
        # clock is 15 s behind this one (or ahead) changes nothing.
        router.send(ident, F.OpRequest("op3b", "health", ns, {}, deadline=time.time() - 15, timeout_s=5.0))
        _, res = router.recv_until(F.OpResult)
        assert res.op_id == "op3b" and res.ok, res.error
        router.send(ident, F.OpRequest("op4", "health", ns, {}))
        _, res = router.recv_until(F.OpResult)
        assert res.ok and res.result
        router.send(ident, F.OpRequest("op5", "clear", b"\x01" * 32, {}))
        _, res = router.recv_until(F.OpResult)
        assert not res.ok and "namespace" in res.error
    finally:
        agent.close()
        router.close()


def test_injected_drops_are_repaired_by_resync(manager) -> None:
    router = Router()
    agent, ops = _agent(router, manager, drop_fraction=1.0, seed=1)
    try:
        ident, _ = _register(router)
        _snapshot_state(router, ident)
        keys = _store(manager, 2, start=20)
        wait_until(lambda: agent.stats.injected_drops >= 1, 10, "an injected drop")
        # the controller sees the gap in the heartbeat's seq and asks for a resync
        hb = router.recv_until(F.Heartbeat)[1]
        while hb.seq < agent.seq:  # older heartbeats still queued
            hb = router.recv_until(F.Heartbeat)[1]
        assert hb.seq >= 1
        router.send(ident, F.Ack("c1", True, resync=True))
        state, seq = _snapshot_state(router, ident)
        assert set(keys) <= state["cpu"] and seq == agent.seq
    finally:
        agent.close()
        router.close()


def test_dead_controller_never_blocks_the_engine(manager) -> None:
    with zmq.Context() as ctx:  # a port nobody listens on
        s = ctx.socket(zmq.ROUTER)
        port = s.bind_to_random_port("tcp://127.0.0.1")
        s.close(0)
    ops = instance_ops.InstanceOps(manager)
    info = namespace_info(manager.namespace)
    agent = FleetAgent(f"tcp://127.0.0.1:{port}", None, "server", {info.digest: (info, ops)}, tier_infos(manager),
                       heartbeat_s=0.01, max_pending_keys=64).start()
    try:
        for i in range(20):  # the engine's stores finish: nothing waits for the controller
            _store(manager, 4, start=100 + 4 * i)
        wait_until(lambda: agent.stats.dropped_sends >= 1, 10, "a dropped send")
        assert agent.stats.registers == 0  # refused, not queued
        assert len(agent.changes) <= 64
        t0 = time.monotonic()
        agent.close()
        assert time.monotonic() - t0 < 1.5
        assert not agent._thread.is_alive()
    finally:
        agent.close()


def test_late_controller_gets_the_state(manager) -> None:
    with zmq.Context() as ctx:
        s = ctx.socket(zmq.ROUTER)
        port = s.bind_to_random_port("tcp://127.0.0.1")
        s.close(0)
    ops = instance_ops.InstanceOps(manager)
    info = namespace_info(manager.namespace)
    agent = FleetAgent(f"tcp://127.0.0.1:{port}", "late", "server", {info.digest: (info, ops)},
                       tier_infos(manager), heartbeat_s=0.05).start()
    try:
        keys = _store(manager, 3)
        time.sleep(0.2)
        router = Router(port)
        try:
            ident, _ = _register(router)
            state, _ = _snapshot_state(router, ident)
            assert set(keys) <= state["cpu"]
        finally:
            router.close()
    finally:
        agent.close()


def test_add_namespace_registers_again(manager, tmp_path) -> None:
    router = Router()
    agent, _ = _agent(router, manager)
    layout = LayoutSignature(engine="test", attn_backend="x", kv_layout="x", dtype="uint8", block_size=16,
                             num_layers=2, num_kv_heads=1, head_dim=8)
    ns2 = KeyNamespace(model="other", layout=layout, chunk_size=CHUNK)
    m2 = StorageManager(KVTierConfig(chunk_size=CHUNK, cpu_capacity=8 * ns2.chunk_bytes), ns2)
    try:
        ident, _ = _register(router)
        _snapshot_state(router, ident)
        info2 = namespace_info(ns2)
        agent.add_namespace(info2.digest, info2, instance_ops.InstanceOps(m2))
        _, reg = router.recv_until(F.Register)
        assert {n.digest for n in reg.namespaces} == {manager.namespace.digest(), ns2.digest()}
        router.send(ident, F.Ack("c1", True))
        seen = set()
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            _, msg = router.recv()
            if isinstance(msg, F.Snapshot):
                seen.add(msg.namespace)
        assert seen == {manager.namespace.digest(), ns2.digest()}
        agent.remove_namespace(info2.digest)
        _, reg = router.recv_until(F.Register)
        assert [n.digest for n in reg.namespaces] == [manager.namespace.digest()]
    finally:
        agent.close()
        router.close()
        m2.close()


def test_change_queue_coalesces_and_bounds() -> None:
    q = ChangeQueue(max_keys=10)
    ns = b"n" * 32
    k = [bytes([i]) * 32 for i in range(12)]
    q.put(ns, TierChange("s", "cpu", (k[0], k[1]), (None, k[0])))
    q.put(ns, TierChange("s", "cpu", (k[2],), (k[1],)))
    q.put(ns, TierChange("r", "cpu", (k[0],)))
    q.put(ns, TierChange("c", "disk"))
    out = q.drain()
    assert [(c.op, c.tier) for c in out] == [("s", "cpu"), ("r", "cpu"), ("c", "disk")]
    assert F.split_keys(out[0].keys) == k[:3]
    assert F.split_keys(out[0].parents) == [F.NO_PARENT, k[0], k[1]]
    assert len(q) == 0 and not q.overflowed
    q.put(ns, TierChange("s", "cpu", tuple(k[:8]), (None,) * 8))
    q.put(ns, TierChange("s", "cpu", tuple(k[8:12]), (None,) * 4))
    assert q.overflowed and len(q) == 0 and q.dropped_keys == 12
    q.fold()
    assert not q.overflowed



def test_change_queue_never_loses_a_shared_tiers_removals() -> None:
    """A snapshot repairs only the sender's view of a shared tier, so its removals survive a fold,
    an overflow and a failed send, in order, and go before the next snapshot (take_kept); local
    tiers' changes and shared stores are dropped as before. Bounded: beyond max_keys // 8 keys set
    aside, a tier's removals become one clear of it."""
    ns, other = b"n" * 32, b"o" * 32
    k = [bytes([i]) * 32 for i in range(40)]
    q = ChangeQueue(max_keys=16, shared=["remote"])
    q.put(ns, TierChange("s", "remote", (k[0],), (None,)))
    q.put(ns, TierChange("r", "remote", (k[1],)))
    q.put(ns, TierChange("r", "disk", (k[2],)))
    q.put(ns, TierChange("c", "remote"))
    q.fold()  # folded: only the shared tier's removals are kept
    assert len(q) == 2 and q.drain() == []
    kept = q.take_kept()
    assert [(c.op, c.tier, F.split_keys(c.keys)) for c in kept] == [("r", "remote", [k[1]]), ("c", "remote", [])]
    assert q.take_kept() == [] and len(q) == 0
    # overflow: everything pending is dropped but the shared removals (the overflowing one too)
    q.put(ns, TierChange("r", "remote", (k[3],)))
    q.put(ns, TierChange("s", "remote", tuple(k[4:19]), (None,) * 15))
    q.put(ns, TierChange("r", "remote", (k[20],)))
    assert q.overflowed and [F.split_keys(c.keys) for c in q.take_kept()] == [[k[3], k[20]]]
    q.fold()
    # a failed send: its removals of shared tiers come back, the rest does not
    q.requeue([F.Change("s", ns, "remote", k[14]), F.Change("r", ns, "remote", k[15]),
               F.Change("r", ns, "cpu", k[17]), F.Change("c", other, "remote")])
    assert [(c.op, c.namespace, F.split_keys(c.keys)) for c in q.take_kept()] == [
        ("r", ns, [k[15]]), ("c", other, [])]
    # bounded: 16 // 8 = 2 keys set aside at most; beyond, one clear per (namespace, tier)
    q.put(ns, TierChange("r", "remote", (k[21],)))
    q.put(other, TierChange("r", "remote", (k[22], k[23])))
    q.fold()
    assert [(c.op, c.namespace) for c in q.take_kept()] == [("c", ns), ("c", other)]
    # no shared tier: nothing is kept
    plain = ChangeQueue(max_keys=16)
    plain.put(ns, TierChange("c", "remote"))
    plain.fold()
    assert len(plain) == 0 and plain.take_kept() == []

def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        FleetAgent("http://x:1")
    with pytest.raises(ValueError):
        FleetAgent("tcp://127.0.0.1:5555", drop_fraction=2.0)
    a = FleetAgent("tcp://127.0.0.1:5555")
    assert a.instance_id.endswith(f":embedded:{os.getpid()}")
    a.close()


def test_kvtier_server_registers_and_publishes(short_dir) -> None:
    """``kvtier server`` with a controller and a KV events endpoint: the controller gets the
    hosted namespace's real state, a subscriber gets the stores as vLLM BlockStored events."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch
    import msgspec

    router = Router()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    server = start_server(short_dir, controller=router.url, instance_id="srv-1",
                          kv_events_endpoint=f"ipc://{short_dir}/ev.sock")  # owner-only (issue 24)
    try:
        sub.connect(server.fleet.publisher.endpoint)
        ident, reg = _register(router)  # no namespace yet
        assert reg.instance == "srv-1" and reg.role == "server" and reg.namespaces == []
        assert stat.S_IMODE(os.stat(short_dir / "ev.sock").st_mode) == 0o600
        client = connect(short_dir / "s.sock")
        try:
            _, reg = router.recv_until(F.Register)
            assert len(reg.namespaces) == 1
            router.send(ident, F.Ack("c1", True))
            (host,) = server.hosts()
            warm: list[bytes] = []

            def joined() -> bool:  # ZeroMQ's slow joiner: store warm-up chunks until one's event arrives
                warm.append(b"\xf0" + len(warm).to_bytes(31, "little"))
                store(client, warm[-1:])
                return bool(sub.poll(50))

            wait_until(joined, 10, "the SUB socket's join")
            keys = [bytes([i]) * 32 for i in range(1, 4)]
            store(client, keys)
            wait_until(lambda: all(host.manager.cpu.contains(k) for k in keys), 10, "stores")
            seen: set[bytes] = set()
            deadline = time.monotonic() + 5
            while not set(keys) <= seen and time.monotonic() < deadline:
                _, msg = router.recv()
                if isinstance(msg, F.Changes):
                    for ch in msg.changes:
                        if ch.op == "s":
                            seen.update(F.split_keys(ch.keys))
                elif isinstance(msg, F.Heartbeat):
                    router.send(ident, F.Ack("c1", True))
            assert set(keys) <= seen
            dec = msgspec.msgpack.Decoder(KVEventBatch)
            hashes: list = []
            deadline = time.monotonic() + 5
            while len(hashes) < 3 and time.monotonic() < deadline:
                if sub.poll(200):
                    topic, seq, payload = sub.recv_multipart()
                    assert len(seq) == 8
                    for ev in dec.decode(payload).events:
                        if isinstance(ev, BlockStored):
                            assert ev.medium == "CPU" and ev.block_size == host.namespace.chunk_size
                            hashes.extend(h for h in ev.block_hashes if h not in warm)
            assert hashes[:3] == keys
        finally:
            client.close()
    finally:
        t0 = time.monotonic()
        server.close()
        assert server.fleet is not None and not server.fleet.agent._thread.is_alive()
        sub.close(0)
        ctx.term()
        router.close()


def test_embedded_connector_worker_runs_an_agent(tmp_path) -> None:
    """The vLLM connector's worker side (embedded mode, where the StorageManager lives) registers
    with the controller when ``controller`` is set, and stops its agent at shutdown."""
    pytest.importorskip("vllm")
    from kvtier.integrations.vllm.worker import KVTierWorker

    router = Router()
    ns = _namespace()
    cfg = KVTierConfig(chunk_size=CHUNK, cpu_capacity=16 * ns.chunk_bytes, controller=router.url,
                       instance_id="eng-1", controller_token="tok")
    worker = KVTierWorker(cfg, ns, f"fleet-test-{os.getpid()}", kv_events=True)
    try:
        assert worker.agent is not None and worker.tier_feed is not None
        ident, reg = _register(router)
        assert reg.instance == "eng-1" and reg.role == "embedded" and reg.token == "tok"
        assert [n.digest for n in reg.namespaces] == [ns.digest()]
        keys = _store(worker.store, 2)
        state, _ = _snapshot_state(router, ident, tiers_expected=("cpu",))
        seen = set(state["cpu"])
        deadline = time.monotonic() + 5
        while not set(keys) <= seen and time.monotonic() < deadline:
            _, msg = router.recv()
            if isinstance(msg, F.Changes):
                seen.update(k for ch in msg.changes if ch.op == "s" for k in F.split_keys(ch.keys))
            elif isinstance(msg, F.Heartbeat):
                router.send(ident, F.Ack("c1", True))
        assert set(keys) <= seen
        changes = worker.get_kv_cache_events()  # the same stores, for vLLM's KV event publisher
        assert changes is not None and {k for op, t, ks in changes.get_all_events() for k in ks} >= set(keys)
    finally:
        agent = worker.agent
        worker.shutdown()
        router.close()
    assert agent is not None and not agent._thread.is_alive()


@pytest.mark.slow
def test_kvtier_server_process_registers_from_settings(short_dir) -> None:
    """``kvtier server`` (the command) with the ``controller``/``instance_id`` settings registers."""
    import subprocess
    import sys

    router = Router()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update(KVTIER_CONTROLLER=router.url, KVTIER_INSTANCE_ID="srv-proc")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "server", "--socket", str(short_dir / "s.sock"), "--no-metrics",
         "--cpu-capacity", "1MiB"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        ident, reg = router.recv_until(F.Register, timeout_s=60)
        assert reg.instance == "srv-proc" and reg.role == "server" and reg.pid == proc.pid
        router.send(ident, F.Ack("c1", True))
        _, hb = router.recv_until(F.Heartbeat, timeout_s=10)
        assert hb.instance == "srv-proc"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        finally:
            router.close()
    assert proc.returncode == 0


@pytest.mark.slow
def test_refused_registration_is_logged_once_and_retried_later(manager, caplog, monkeypatch) -> None:
    """A controller that refuses the Register (e.g. no token) says why; the instance logs it
    once (not every retry), waits REFUSED_RETRY_S before the next Register, and registers
    normally once the controller accepts."""
    monkeypatch.setattr(FleetAgent, "REFUSED_RETRY_S", 0.6)
    router = Router()
    caplog.set_level("WARNING", logger="kvtier")
    agent, _ = _agent(router, manager)
    try:
        reason = "instance 'inst-1' sent no token; this controller requires one"
        for _ in range(2):
            ident, _ = router.recv_until(F.Register)
            t_refused = time.monotonic()
            router.send(ident, F.Ack("c1", False, refused=reason))
            wait_until(lambda: agent.stats.refusals >= 1)
        # heartbeat_s is 0.05: without the back-off a Register would follow within ~0.1 s
        ident, _ = router.recv_until(F.Register)
        assert time.monotonic() - t_refused >= 0.5 and agent.stats.refusals == 2
        assert [r.getMessage() for r in caplog.records].count(
            f"kvtier fleet agent: the controller at {agent.endpoint} refused this instance: {reason} "
            "(retrying every 1 s)") == 1
        router.send(ident, F.Ack("c1", True))
        wait_until(lambda: agent.registered)
    finally:
        agent.close()
        router.close()
