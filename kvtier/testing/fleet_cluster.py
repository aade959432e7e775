"""An in-process fleet: one controller and N real kvtier instances (for tests and benchmarks).

Each instance is a real :class:`~kvtier.storage.manager.StorageManager` (CPU tier plus at
most one lower tier), wrapped by :class:`~kvtier.storage.instance_ops.InstanceOps` and
reported by a real :class:`~kvtier.fleet.agent.FleetAgent` over ZMQ to one
:class:`~kvtier.controller.server.Controller` (HTTP and ZMQ on ephemeral loopback ports).

Lower-tier kinds (``kind``): ``"cpu"`` (none), ``"disk"`` (one directory per instance),
``"fs"`` (one directory shared by every instance), ``"redis"`` (one URL and key prefix
shared by every instance), as in production. Chunks are tiny (a 16-token chunk of a
1-layer, 1-head, 8-dim float16 layout: 512 bytes) so a fleet starts in well under a second.

Ground truth is read from the tiers themselves (:meth:`FleetInstance.held`), never from
the controller: CPU and disk indexes, the fs directory listing, a Redis ``SCAN``.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import numpy as np

from kvtier.config import KVTierConfig
from kvtier.controller.server import Controller
from kvtier.fleet.agent import FleetAgent, namespace_info, tier_infos
from kvtier.index.keys import KeyNamespace, LayoutSignature
from kvtier.storage.instance_ops import InstanceOps
from kvtier.storage.leases import PIN_PREFIX
from kvtier.storage.manager import StorageManager
from kvtier.transfer.assembly import open_manager

#: Tokens per chunk of the tiny namespace (one 16-token engine block).
CHUNK = 16
#: Lower-tier kinds a cluster can be built with.
KINDS = ("cpu", "disk", "fs", "redis")
#: Tier label of each kind's lower tier (None: CPU only).
LOWER_LABEL = {"cpu": None, "disk": "disk", "fs": "remote", "redis": "remote"}
DEFAULT_REDIS = "redis://127.0.0.1:6399/0"


def tiny_namespace(model: str = "kvtier/conformance-tiny") -> KeyNamespace:
    """A 16-token-chunk namespace of 512-byte float16 chunks."""
    layout = LayoutSignature(engine="test", attn_backend="TEST_ATTN", kv_layout="LBHNC", block_size=CHUNK,
                             num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")
    return KeyNamespace(model=model, layout=layout, chunk_size=CHUNK)


def payload(key: bytes, nbytes: int) -> np.ndarray:
    """Deterministic uint8 ``[nbytes]`` payload of ``key``: normal float16 values (lossy codecs have
    something to quantize, lossless ones something to compress)."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.standard_normal(nbytes // 2).astype(np.float16).view(np.uint8).copy()


def wait_until(pred: Callable[[], bool], timeout_s: float = 3.0, step_s: float = 0.01) -> float:
    """Seconds until ``pred()`` held.

    Raises:
        TimeoutError: it did not hold within ``timeout_s``.
    """
    t0 = time.monotonic()
    while True:
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"condition not met within {timeout_s} s")
        time.sleep(step_s)


@dataclass
class FleetInstance:
    """One instance: its manager, operations and agent (``agent`` None while killed)."""

    name: str
    manager: StorageManager
    ops: InstanceOps
    agent: FleetAgent | None
    redis_prefix: bytes | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def lower_label(self) -> str | None:
        lower = self.manager.lower
        return lower[0].kind if lower else None

    # -- writing through the real path ----------------------------------------------------------
    def store(self, tokens: Sequence[int], flush: bool = True) -> list[bytes]:
        """Store the chunks of ``tokens`` as the connector does (``open_write``, fill with
        :func:`payload`, ``commit``), then flush the write-behind; returns the chunk keys."""
        m = self.manager
        keys = m.keys(tokens)
        for i, k in enumerate(keys):
            parent = keys[i - 1] if i else None
            buf = m.open_write(k, parent)
            if buf is None:
                continue
            buf[:] = payload(k, m.chunk_bytes)
            m.commit(k, parent)
        if flush:
            m.flush(10.0)
        return keys

    # -- real state -----------------------------------------------------------------------------
    def remote_keys(self) -> set[bytes]:
        """Chunk keys in the shared remote store, listed without the tier's own code (fs: the
        namespace directory's files; Redis: ``SCAN`` of the namespace's key prefix)."""
        tier = self.manager.remote
        if tier is None:
            return set()
        d = getattr(tier, "dir", None)
        if d is not None:
            return {bytes.fromhex(p.name[: -len(".kvc")]) for p in Path(d).glob("??/*.kvc")}
        import redis

        url = self.extra["redis_url"]
        r = redis.Redis.from_url(url.split("?")[0])
        try:
            prefix = tier.namespace_prefix  # type: ignore[attr-defined]
            return {bytes.fromhex(k[len(prefix):].decode()) for k in r.scan_iter(match=prefix + b"*", count=1000)}
        finally:
            r.close()

    def remote_sizes(self, keys: Sequence[bytes]) -> list[int]:
        """Stored bytes of each key in the remote store, read without the tier's own code
        (fs: the file's size; Redis: ``STRLEN`` of its key); 0 where absent."""
        tier = self.manager.remote
        if tier is None:
            return [0] * len(keys)
        if getattr(tier, "dir", None) is not None:
            paths = [tier.path_of(k) for k in keys]  # type: ignore[attr-defined]
            return [p.stat().st_size if p.exists() else 0 for p in paths]
        import redis

        r = redis.Redis.from_url(self.extra["redis_url"].split("?")[0])
        try:
            return [int(r.strlen(tier.redis_key(k))) for k in keys]  # type: ignore[attr-defined]
        finally:
            r.close()

    def held(self, tier: str, keys: Sequence[bytes]) -> list[bool]:
        """Per key: does ``tier`` (``cpu``/``disk``/``remote``) really hold it (its own index or listing)."""
        if tier == "cpu":
            return [self.manager.cpu.contains(k) for k in keys]
        if tier == "disk":
            disk = self.manager.disk
            return [False] * len(keys) if disk is None else disk.contains_many(keys)
        raw = self.remote_keys()
        return [k in raw for k in keys]

    def load(self, tier: str, key: bytes) -> np.ndarray | None:
        """The bytes ``tier`` holds for ``key`` (a copy), or None."""
        m = self.manager
        if tier == "cpu":
            buf = m.cpu.acquire(key)
            if buf is None:
                return None
            try:
                return buf.copy()
            finally:
                m.cpu.release(key)
        t = m.disk if tier == "disk" else m.remote
        out = np.empty(m.chunk_bytes, dtype=np.uint8)
        return out if t is not None and t.get_many_into([(key, out)])[0] else None

    def load_via_manager(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """Read ``keys`` through the manager's read path (promotion from lower tiers included)."""
        out: list[np.ndarray | None] = []
        parents = [keys[i - 1] if i else None for i in range(len(keys))]
        for h in self.manager.open_read_many(list(zip(keys, parents))):
            if h is None:
                out.append(None)
                continue
            try:
                out.append(np.array(h.buffer, dtype=np.uint8, copy=True))
            finally:
                h.close()
        return out


class FleetCluster:
    """A controller and ``n`` instances of one lower-tier kind (see the module docstring).

    Args:
        kind: ``cpu``, ``disk``, ``fs`` or ``redis``.
        root: a scratch directory (disk and fs tiers live under it).
        n: instances (named ``inst-0``, ``inst-1``...).
        cpu_chunks: CPU capacity of each instance, in chunks.
        redis_url: Redis for ``kind="redis"`` (a unique key prefix is added).
        op_deadline_s: the controller's operation deadline (seconds).
        keys: fleet keys (:func:`kvtier.testing.fleet_keys.make_fleet`): the controller (member
            ``controller``) runs CURVE and each instance registers with its own key (added when
            missing); None: an open, loopback controller.

    Raises:
        ValueError: unknown ``kind``.
    """

    def __init__(self, kind: str, root: Path, n: int = 3, cpu_chunks: int = 16, redis_url: str = DEFAULT_REDIS,
                 op_deadline_s: float = 5.0, namespace: KeyNamespace | None = None, keys: Any = None):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.kind = kind
        self.root = Path(root)
        self.ns = namespace or tiny_namespace()
        self.cpu_chunks = cpu_chunks
        self.op_deadline_s = op_deadline_s
        self.redis_prefix = f"kvt-conf-{uuid.uuid4().hex[:12]}:"
        self.redis_url = f"{redis_url}?key_prefix={self.redis_prefix}"
        self.keys = keys
        if keys is not None and "controller" not in keys.keys:
            keys.add("controller")
        self.controller = Controller(http_port=0, zmq_endpoint="tcp://127.0.0.1:0", op_deadline_s=op_deadline_s,
                                     credentials=self._controller_credentials())
        self.instances: list[FleetInstance] = []
        self._n = n

    def _controller_credentials(self) -> Any:
        return self.keys.credentials("controller") if self.keys is not None else None

    # -- lifecycle -----------------------------------------------------------------------------------
    def config(self, i: int, remote_url: str | None = None) -> KVTierConfig:
        """Instance ``i``'s config (``remote_url`` overrides the kind's shared URL)."""
        cb = self.ns.chunk_bytes
        fields: dict[str, Any] = {"chunk_size": self.ns.chunk_size, "cpu_capacity": self.cpu_chunks * cb}
        if self.kind == "disk":
            fields.update(disk_path=self.root / f"disk-{i}", disk_capacity=1 << 22)
        elif self.kind == "fs":
            fields["remote_url"] = remote_url or f"fs://{self.root / 'shared-fs'}"
        elif self.kind == "redis":
            fields.update(remote_url=remote_url or self.redis_url, remote_timeout_s=0.5)
        return KVTierConfig(**fields)

    def start(self, timeout_s: float = 5.0) -> Self:
        """Start the controller and the instances; returns when all are registered and indexed."""
        self.controller.start()
        for i in range(self._n):
            self.instances.append(self.add_instance(f"inst-{i}"))
        wait_until(lambda: len(self.controller.ops.instances()) == self._n, timeout_s)
        return self

    def add_instance(self, name: str, remote_url: str | None = None) -> FleetInstance:
        """Open one more instance (not added to :attr:`instances`) and start its agent."""
        m = open_manager(self.config(len(self.instances), remote_url), self.ns)
        ops = InstanceOps(m)
        inst = FleetInstance(name, m, ops, None, self.redis_prefix.encode() if self.kind == "redis" else None,
                             {"redis_url": remote_url or self.redis_url})
        self.start_agent(inst)
        return inst

    def start_agent(self, inst: FleetInstance) -> FleetAgent:
        """(Re)start ``inst``'s agent (a new epoch), connected to the current controller."""
        secure: dict[str, Any] = {}
        if self.keys is not None:
            if inst.name not in self.keys.keys:
                self.keys.add(inst.name)
            secure = {"credentials": self.keys.credentials(inst.name), "controller_key": self.keys.public("controller")}
        agent = FleetAgent(self.controller.zmq_url, inst.name, "embedded",
                           {self.ns.digest(): (namespace_info(self.ns), inst.ops)}, tier_infos(inst.manager), **secure)
        inst.agent = agent.start()
        return agent

    def kill_agent(self, inst: FleetInstance) -> None:
        """Close ``inst``'s agent without a goodbye (its heartbeats stop; the manager lives on)."""
        if inst.agent is not None:
            inst.agent.close()
            inst.agent = None

    def restart_controller(self, timeout_s: float = 10.0) -> None:
        """Stop the controller and start a new one on the same HTTP and ZMQ ports."""
        port, zmq_url = self.controller.http_port, self.controller.zmq_url
        self.controller.stop()
        end = time.monotonic() + timeout_s
        while True:
            ctl = Controller(http_port=port, zmq_endpoint=zmq_url, op_deadline_s=self.op_deadline_s,
                             credentials=self._controller_credentials())
            try:
                self.controller = ctl.start()
                return
            except OSError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.05)

    def reset(self) -> None:
        """Clear every tier of every instance through the managers (not the controller)."""
        for inst in self.instances:
            for owner in list(inst.manager.leases.owners(PIN_PREFIX)):
                inst.manager.leases.release(owner)
            inst.manager.clear()

    def settle(self, timeout_s: float = 3.0) -> None:
        """Wait until the controller applied every change each live agent has sent (same ``seq``,
        nothing queued): changes made before this call can no longer arrive after later ones."""
        state = self.controller.state

        def done() -> bool:
            for inst in self.instances:
                a = inst.agent
                if a is None:
                    continue
                with state.lock:
                    applied = state.index.applied_seq(inst.name)
                if len(a.changes) or not a.registered or applied != a.seq:
                    return False
            return True

        wait_until(done, timeout_s)

    def close(self) -> None:
        """Stop agents, clear and close managers (shared stores emptied), stop the controller."""
        for inst in self.instances:
            self.kill_agent(inst)
        for inst in self.instances:
            try:
                inst.manager.clear()
            finally:
                inst.manager.close()
        self.controller.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- ground truth ----------------------------------------------------------------------------
    def tiers(self) -> list[str]:
        """Tier labels of every instance, fastest first."""
        low = LOWER_LABEL[self.kind]
        return ["cpu"] + ([low] if low else [])

    def truth(self, tokens: Sequence[int], inst: FleetInstance) -> dict[str, int]:
        """``{longest_matched, CPU, DISK, REMOTE}`` in tokens, read from ``inst``'s tiers themselves."""
        keys = inst.manager.keys(tokens)
        row = {"longest_matched": 0, "CPU": 0, "DISK": 0, "REMOTE": 0}
        any_held = [False] * len(keys)
        for label in self.tiers():
            held = inst.held(label, keys)
            row[label.upper()] = _leading(held) * self.ns.chunk_size
            any_held = [a or b for a, b in zip(any_held, held)]
        row["longest_matched"] = _leading(any_held) * self.ns.chunk_size
        return row


def _leading(flags: Sequence[bool]) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n

