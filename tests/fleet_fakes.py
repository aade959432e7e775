"""A fake kvtier instance agent for controller tests: the agent side of kvtier.protocol.fleet
over a real DEALER socket, with tiers held in memory (``key -> parent`` dicts).

Ground truth for the tests is :meth:`FakeAgent.truth` (what the fake's tiers really hold),
never the controller's replies. Fault injection: ``drop_changes`` (probability that a
``Changes`` message is lost after its ``seq`` was taken), ``silent`` (ops get no answer),
:meth:`kill` (the process dies: no goodbye, no more heartbeats).
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
from typing import Any, Optional

import zmq

from kvtier.index.keys import ChunkHasher, KeyNamespace, LayoutSignature
from kvtier.protocol import fleet
from kvtier.protocol.fleet import (
    Ack, Change, Changes, Heartbeat, NamespaceInfo, OpRequest, OpResult, Register, Snapshot, TierInfo,
)

CHUNK = 16


def make_namespace(model: str = "fake-model", chunk_size: int = CHUNK) -> KeyNamespace:
    layout = LayoutSignature(engine="vllm", attn_backend="CPU_ATTN/vec", kv_layout="LBHNC", block_size=16,
                             num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    return KeyNamespace(model=model, layout=layout, chunk_size=chunk_size)


class SharedStore:
    """A tier several fakes see (a Redis URL): one dict under one lock."""

    def __init__(self, name: str = "redis://fake:6379/0"):
        self.name = name
        self.entries: dict[bytes, Optional[bytes]] = {}
        self.lock = threading.RLock()


class FakeAgent:
    """One fake instance (see the module docstring).

    Args:
        instance: instance id (ZMQ identity).
        url: the controller's ZMQ endpoint.
        tiers: local tier labels (e.g. ``("cpu", "disk")``).
        shared: a shared ``remote`` tier, or None.
        token: ``Register.token``.
        drop_changes: probability a ``Changes`` message is lost.
    """

    def __init__(self, instance: str, url: str, tiers: tuple[str, ...] = ("cpu", "disk"),
                 shared: Optional[SharedStore] = None, token: str = "", drop_changes: float = 0.0,
                 seed: int = 0, namespace: Optional[KeyNamespace] = None):
        self.instance = instance
        self.url = url
        self.ns = namespace or make_namespace()
        self.hasher = ChunkHasher(self.ns)
        self.digest = self.ns.digest()
        self.shared = shared
        self.token = token
        self.drop_changes = drop_changes
        self.rng = random.Random(seed)
        self.epoch = os.urandom(8).hex()
        self.lock = threading.RLock()
        self.local: dict[str, dict[bytes, Optional[bytes]]] = {t: {} for t in tiers}
        self.pinned: set[bytes] = set()
        self.pins: dict[str, set[bytes]] = {}
        self.codecs: dict[bytes, str] = {}
        self.ops_seen: list[OpRequest] = []
        self.silent = False
        self.seq = 0
        self.dropped = 0
        self.heartbeat_s = fleet.DEFAULT_HEARTBEAT_S
        self._resync_id = 0
        self._out: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fake-agent-{instance}", daemon=True)

    # -- state --------------------------------------------------------------------

    def tier(self, label: str) -> dict[bytes, Optional[bytes]]:
        if label == "remote" and self.shared is not None:
            return self.shared.entries
        return self.local[label]

    def labels(self) -> list[str]:
        return list(self.local) + (["remote"] if self.shared is not None else [])

    def keys(self, tokens: list[int], salt: Optional[str] = None) -> list[bytes]:
        return self.hasher.keys(tokens, cache_salt=salt)

    def truth(self, tokens: list[int], salt: Optional[str] = None) -> dict[str, int]:
        """Per tier, leading tokens of ``tokens`` really held (plus ``longest_matched``)."""
        ks = self.keys(tokens, salt)
        with self.lock, self._shared_lock():
            out = {}
            for label in self.labels():
                t = self.tier(label)
                n = 0
                while n < len(ks) and ks[n] in t:
                    n += 1
                out[label.upper()] = n * self.ns.chunk_size
            n = 0
            while n < len(ks) and any(ks[n] in self.tier(lab) for lab in self.labels()):
                n += 1
            out["longest_matched"] = n * self.ns.chunk_size
        return out

    def _shared_lock(self):
        return self.shared.lock if self.shared is not None else threading.RLock()

    def _emit(self, changes: list[Change]) -> None:
        """Number and send (or, injected, lose) one Changes message. Caller holds the lock."""
        if not changes:
            return
        self.seq += 1
        if self.drop_changes and self.rng.random() < self.drop_changes:
            self.dropped += 1
            return
        self._out.put(fleet.encode(Changes(self.instance, self.epoch, self.seq, changes)))

    def store(self, tokens: list[int], tier: str = "cpu", salt: Optional[str] = None,
              lineage: bool = True) -> list[bytes]:
        """Store a prompt's chunks; the first chunk's parent is the salt's lineage marker, as the
        real connector records it (``lineage=False``: None, as a writer without lineage does)."""
        ks = self.keys(tokens, salt)
        parents = [self.hasher.lineage(salt) if lineage else None] + ks[:-1]
        with self.lock, self._shared_lock():
            t = self.tier(tier)
            for k, p in zip(ks, parents):
                t[k] = p
            self._emit([Change("s", self.digest, tier, b"".join(ks), fleet.join_parents(parents))])
        return ks

    def remove(self, keys: list[bytes], tier: str = "cpu") -> None:
        with self.lock, self._shared_lock():
            t = self.tier(tier)
            gone = [k for k in keys if k in t]
            for k in gone:
                del t[k]
            self._emit([Change("r", self.digest, tier, b"".join(keys))])
            self.pinned.difference_update(gone)

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> "FakeAgent":
        self._thread.start()
        return self

    def kill(self) -> None:
        """Stop abruptly: no more messages of any kind."""
        self._stop.set()
        self._thread.join(5.0)

    # -- thread -------------------------------------------------------------------

    def _register_msg(self) -> bytes:
        tiers = [TierInfo(kind=t, name=f"{self.instance}/{t}", capacity_bytes=1 << 30) for t in self.local]
        if self.shared is not None:
            tiers.append(TierInfo(kind="remote", name=self.shared.name, shared=True))
        ns = NamespaceInfo(self.digest, self.ns.canonical_bytes(), self.ns.chunk_size, self.ns.chunk_bytes)
        return fleet.encode(Register(self.instance, self.epoch, fleet.FLEET_PROTOCOL_VERSION, "embedded",
                                     "127.0.0.1", os.getpid(), [ns], tiers, token=self.token))

    def _snapshot(self) -> None:
        with self.lock, self._shared_lock():
            self._resync_id += 1
            for label in self.labels():
                items = list(self.tier(label).items())
                parts = [items[i:i + 1000] for i in range(0, len(items), 1000)] or [[]]
                for j, part in enumerate(parts):
                    pinned = b"".join(k for k, _ in part if k in self.pinned)
                    self._out.put(fleet.encode(Snapshot(
                        self.instance, self.epoch, self._resync_id, self.digest, label,
                        b"".join(k for k, _ in part), fleet.join_parents([p for _, p in part]),
                        last=j == len(parts) - 1, seq=self.seq, pinned=pinned)))

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.instance.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 20)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 100)
        sock.connect(self.url)
        sock.send(self._register_msg())
        next_hb = time.monotonic() + self.heartbeat_s
        try:
            while not self._stop.is_set():
                if sock.poll(5):
                    msg = fleet.decode_controller_message(sock.recv())
                    if isinstance(msg, Ack):
                        self.heartbeat_s = msg.heartbeat_s
                        if not msg.known:
                            sock.send(self._register_msg())
                        elif msg.resync:
                            self._snapshot()
                    elif isinstance(msg, OpRequest):
                        self.ops_seen.append(msg)
                        if not self.silent:
                            self._out.put(fleet.encode(self._answer(msg)))
                while True:
                    try:
                        sock.send(self._out.get_nowait())
                    except queue.Empty:
                        break
                if time.monotonic() >= next_hb:
                    next_hb = time.monotonic() + self.heartbeat_s
                    with self.lock:
                        seq = self.seq
                    sock.send(fleet.encode(Heartbeat(self.instance, self.epoch, seq,
                                                     health={t: {"reachable": True} for t in self.labels()})))
        finally:
            sock.close(0)
            ctx.term()

    def _answer(self, req: OpRequest) -> OpResult:
        """Dispatch like kvtier.fleet.agent: key binaries become key lists, then ``fn(**args)`` with
        InstanceOps' exact signatures, so an argument the real ops would refuse fails here too."""
        args = dict(req.args)
        for name in ("keys", "parents"):
            if isinstance(args.get(name), bytes):
                ks = fleet.split_keys(args[name])
                args[name] = [None if (name == "parents" and k == fleet.NO_PARENT) else k for k in ks]
        fn = {"import": self.op_import}.get(req.op) or getattr(self, f"op_{req.op}", None)
        try:
            if fn is None:
                raise ValueError(f"op: unknown operation {req.op!r}")
            with self.lock, self._shared_lock():
                result = fn(**args)
        except (KeyError, ValueError, TypeError) as exc:
            return OpResult(req.op_id, False, error=f"{type(exc).__name__}: {exc}")
        return OpResult(req.op_id, True, result)

    # -- InstanceOps look-alikes (same names and keyword arguments) ----------------

    def _labels(self, tier: Optional[str]) -> list[str]:
        if tier is None:
            return self.labels()
        if tier not in self.labels():
            raise ValueError(f"tier: no tier {tier!r}")
        return [tier]

    def op_clear(self, tier: Optional[str] = None) -> dict[str, int]:
        labels = self._labels(tier)
        n = 0
        for lab in labels:
            n += len(self.tier(lab))
            self.tier(lab).clear()
        self._emit([Change("c", self.digest, lab) for lab in labels])
        return {"chunks": n, "bytes": n * self.ns.chunk_bytes}

    def op_delete(self, keys: list[bytes], tier: Optional[str] = None) -> dict[str, int]:
        n = 0
        changes = []
        for lab in self._labels(tier):
            for k in keys:
                n += self.tier(lab).pop(k, 0) != 0
            changes.append(Change("r", self.digest, lab, b"".join(keys)))
        self._emit(changes)
        return {"chunks": n}

    def op_pin(self, keys: list[bytes], pin_id: str, ttl_s: Optional[float] = None) -> dict[str, int]:
        held = [k for k in keys if any(k in self.tier(lab) for lab in self.labels())]
        self.pins[pin_id] = set(held)
        self.pinned = set().union(*self.pins.values())
        return {"pinned": len(held)}

    def op_unpin(self, pin_id: str) -> dict[str, int]:
        n = len(self.pins.pop(pin_id, ()))
        self.pinned = set().union(*self.pins.values())
        return {"unpinned": n}

    def _copy(self, keys: list[bytes], parents: Optional[list], src: dict, dst: dict) -> list[tuple[bytes, Any]]:
        parents = parents if parents is not None else [keys[i - 1] if i else None for i in range(len(keys))]
        moved = [(k, p) for k, p in zip(keys, parents) if k in src]
        for k, p in moved:
            dst[k] = p
        return moved

    def op_move_local(self, keys: list[bytes], parents: Optional[list], src: str, dst: str,
                      copy: bool = False) -> dict[str, int]:
        if src == dst:
            raise ValueError("dst: same tier as src")
        moved = self._copy(keys, parents, self.tier(src), self.tier(dst))
        changes = [Change("s", self.digest, dst, b"".join(k for k, _ in moved), fleet.join_parents([p for _, p in moved]))]
        if not copy:
            for k, _ in moved:
                self.tier(src).pop(k, None)
            changes.append(Change("r", self.digest, src, b"".join(k for k, _ in moved)))
        self._emit(changes)
        return {"moved": len(moved)}

    def op_export(self, keys: list[bytes], parents: Optional[list] = None, tier: str = "remote") -> dict[str, int]:
        if tier == "cpu":
            raise ValueError("tier: export goes to a lower tier")
        union: dict[bytes, Any] = {}
        for lab in self.labels():
            union.update(self.tier(lab))
        moved = self._copy(keys, parents, union, self.tier(tier))
        self._emit([Change("s", self.digest, tier, b"".join(k for k, _ in moved),
                           fleet.join_parents([p for _, p in moved]))])
        return {"exported": sum(1 for k in keys if k in self.tier(tier))}

    def op_import(self, keys: list[bytes], parents: Optional[list] = None, dst: str = "cpu") -> dict[str, int]:
        if dst not in ("cpu", "disk"):
            raise ValueError(f"dst: import goes into 'cpu' or 'disk', not {dst!r}")
        union: dict[bytes, Any] = {}
        for lab in self.labels():
            if lab != dst:
                union.update(self.tier(lab))
        moved = self._copy(keys, parents, union, self.tier(dst))
        self._emit([Change("s", self.digest, dst, b"".join(k for k, _ in moved),
                           fleet.join_parents([p for _, p in moved]))])
        return {"imported": sum(1 for k in keys if k in self.tier(dst))}

    def op_verify(self, keys: list[bytes], tier: Optional[str] = None) -> dict[str, Any]:
        labels = self._labels(tier)
        missing = sum(1 for k in keys if not any(k in self.tier(lab) for lab in labels))
        return {"verified": len(keys) - missing, "missing": missing, "corrupt": 0}

    def op_compress(self, keys: list[bytes], tier: str, codec: str) -> dict[str, Any]:
        if tier == "cpu":
            raise ValueError("tier: compress works on lower tiers")
        n = 0
        for k in keys:
            if k in self.tier(tier):
                self.codecs[k] = codec
                n += 1
        return {"chunks": n, "lossless": codec != "int8", "max_abs_error": 0.0}

    def op_decompress(self, keys: list[bytes], tier: str) -> dict[str, Any]:
        return self.op_compress(keys, tier, "raw")

    def op_health(self, probe: bool = False) -> dict[str, Any]:
        return {t: {"reachable": True, "read_errors": 0} for t in self.labels()}
