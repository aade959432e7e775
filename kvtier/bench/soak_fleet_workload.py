"""A well-behaved engine of ``kvtier bench soak-fleet``: chats whose turns move between the instances.

One process holds one :class:`~kvtier.service.client.ServiceClient` per ``kvtier server`` of the
fleet. A conversation (over the shared system prompts of :mod:`kvtier.bench.soak_workload`, a
tenant salt of :data:`SALTS` each) sends its turns to the instances in turn, so each turn's prefix
was written on another instance: the lookup misses locally, the instance asks the controller which
member holds it (``peer_discovery``) and pulls it over the authenticated TCP peer link, and the
load that follows arrives via P2P (``source`` ``peer``). Per request: lookup (with a lease) -> load
the hit chunks -> release -> store the missed chunks.

**Every load is audited.** A chunk's bytes are a function of its key and a per-run secret seed
(:func:`chunk_bytes`, blake2b-keyed): every honest writer writes exactly those bytes, and every load
is compared with them byte for byte. A chunk a stranger wrote, a poisoned peer's bytes, another
tenant's or another key's chunk cannot match (the hostile client does not know the seed). Each
mismatch is recorded (instance, source tier, key).

Run as ``python -m kvtier.bench.soak_fleet_workload --plan PLAN.json --index I --seconds D --rate R
--go GO --ready READY --out OUT.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.soak_workload import VOCAB, soak_namespace, system_prompts, wait_for_file
from kvtier.index.keys import ChunkHasher
from kvtier.service.client import ServiceClient, ServiceUnavailable
from kvtier.storage.types import WriteSkip

#: Tenant salts of the conversations (None: no salt).
SALTS: tuple[str | None, ...] = (None, "tenant-a", "tenant-b")
#: Expected payloads kept per process (the popular system-prompt chunks are loaded again and again).
EXPECTED_CACHE = 96
#: Mismatches recorded in detail (all are counted).
MAX_MISMATCH_DETAILS = 32


def chunk_bytes(seed: bytes, key: bytes, nbytes: int) -> np.ndarray:
    """The bytes every honest writer stores for ``key``: ``uint8 [nbytes]`` from a PCG64 stream
    seeded by ``blake2b(key, key=seed)`` (128 bits). Without ``seed`` they cannot be forged."""
    h = hashlib.blake2b(key, key=seed, digest_size=16).digest()
    return np.frombuffer(np.random.default_rng(int.from_bytes(h, "little")).bytes(nbytes), dtype=np.uint8)


class Expected:
    """:func:`chunk_bytes` with a small LRU cache."""

    def __init__(self, seed: bytes, nbytes: int, size: int = EXPECTED_CACHE):
        self.seed, self.nbytes, self.size = seed, nbytes, size
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def __call__(self, key: bytes) -> np.ndarray:
        got = self._cache.get(key)
        if got is None:
            got = chunk_bytes(self.seed, key, self.nbytes)
            self._cache[key] = got
            if len(self._cache) > self.size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return got


@dataclass
class FleetWorkloadResult:
    """What one well-behaved client saw (JSON). Latencies in milliseconds.

    Attributes:
        lookup_ms: ``[monotonic time, wall time]`` of every instance lookup (a local miss includes
            the controller's ``/locate`` and the peer's ``contains``).
        loads / loads_by_source: chunks loaded and audited, per tier that served them (``cpu``,
            ``peer``...).
        mismatches / mismatch_details: audited loads whose bytes were not the writer's.
        load_misses: chunks a lookup found that could not be loaded (evicted between).
        stored: chunks stored; store_skips: skipped stores per reason.
        per_instance_requests: requests sent to each instance.
    """

    index: int
    lookup_ms: list[list[float]] = field(default_factory=list)  # [monotonic t, ms]
    requests: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    loads: int = 0
    loads_by_source: dict[str, int] = field(default_factory=dict)
    mismatches: int = 0
    mismatch_details: list[dict[str, Any]] = field(default_factory=list)
    load_misses: int = 0
    stored: int = 0
    store_skips: dict[str, int] = field(default_factory=dict)
    per_instance_requests: list[int] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    error: str = ""


class MovingChats:
    """Conversations over the shared system prompts; each has a salt and a first instance, and its
    turn ``t`` goes to instance ``(first + t) % n``."""

    def __init__(self, seed: int, instances: int):
        self.rng = np.random.default_rng(seed)
        self.prompts = system_prompts()
        w = 1.0 / np.arange(1, len(self.prompts) + 1)
        self.weights = w / w.sum()
        self.n = instances
        self._history = np.empty(0, np.uint32)
        self._turn = self._turns = 0
        self._first = 0
        self.salt: str | None = None

    def next(self) -> tuple[int, str | None, np.ndarray]:
        """(instance index, salt, prompt token ids ``uint32``) of the next request."""
        if self._turn >= self._turns:
            self._history = self.prompts[int(self.rng.choice(len(self.prompts), p=self.weights))]
            self._turns, self._turn = int(self.rng.integers(2, 7)), 0
            self._first = int(self.rng.integers(self.n))
            self.salt = SALTS[int(self.rng.integers(len(SALTS)))]
        user = self.rng.integers(0, VOCAB, int(self.rng.integers(32, 161)), dtype=np.uint32)
        prompt = np.concatenate([self._history, user])
        answer = self.rng.integers(0, VOCAB, int(self.rng.integers(32, 161)), dtype=np.uint32)
        self._history = np.concatenate([prompt, answer])
        inst = (self._first + self._turn) % self.n
        self._turn += 1
        return inst, self.salt, prompt


def one_request(client: ServiceClient, inst: int, hasher: ChunkHasher, salt: str | None, prompt: np.ndarray,
                owner: str, expected: Expected, sink: np.ndarray, res: FleetWorkloadResult) -> None:
    """Lookup -> load and audit the hits -> release -> store the misses (the writer's bytes)."""
    keys = hasher.keys(prompt, cache_salt=salt)
    root = hasher.lineage(salt)
    t0 = time.perf_counter()
    found = client.lookup_keys(keys, lease_owner=owner)
    res.lookup_ms.append([time.monotonic(), (time.perf_counter() - t0) * 1e3])
    res.requests += 1
    res.per_instance_requests[inst] += 1
    res.lookup_tokens += len(keys) * hasher.chunk_size
    n = len(found.keys)
    res.hit_tokens += n * hasher.chunk_size
    if n:
        parents = [root, *keys[: n - 1]]
        for key, h in zip(keys[:n], client.open_read_many(list(zip(keys[:n], parents)))):
            if h is None:
                res.load_misses += 1
                continue
            with h:
                np.copyto(sink, h.buffer)
                source = h.source
            res.loads += 1
            res.loads_by_source[source] = res.loads_by_source.get(source, 0) + 1
            if not np.array_equal(sink, expected(key)):
                res.mismatches += 1
                if len(res.mismatch_details) < MAX_MISMATCH_DETAILS:
                    res.mismatch_details.append({"t": time.monotonic(), "instance": inst, "source": source, "key": key.hex(),
                                                 "salt": salt, "first_bytes": bytes(sink[:16]).hex()})
        client.release(owner)
    miss = keys[n:]
    if not miss:
        return
    parents = [keys[n - 1] if n else root, *miss[:-1]]
    for key, parent, got in zip(miss, parents, client.open_write_many(miss, parents)):
        if isinstance(got, np.ndarray):
            np.copyto(got, expected(key))
            client.commit(key, parent)
            res.stored += 1
        else:
            name = got.name.lower() if isinstance(got, WriteSkip) else str(got)
            res.store_skips[name] = res.store_skips.get(name, 0) + 1


def run_client(plan: dict[str, Any], index: int, seconds: float, rate: float, go: Path, ready: Path) -> FleetWorkloadResult:
    """One client's whole run (module docstring); every failure is reported in the result."""
    res = FleetWorkloadResult(index)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ns = soak_namespace()
    hasher = ChunkHasher(ns)
    nodes = plan["instances"]
    res.per_instance_requests = [0] * len(nodes)
    clients = [ServiceClient(n["socket"], ns, f"soak-fleet-{index}", timeout_s=2.0, connect_timeout_s=30.0)
               for n in nodes]
    try:
        try:
            for c in clients:
                c.wait_connected(60.0)
        except ServiceUnavailable as exc:
            res.error = str(exc)
            return res
        ready.write_text("ok")
        if not wait_for_file(go, stop, 120.0):
            res.error = "no start signal"
            return res
        expected = Expected(bytes.fromhex(plan["seed"]), ns.chunk_bytes)
        sink = np.empty(ns.chunk_bytes, dtype=np.uint8)
        chats = MovingChats(2000 + index, len(nodes))
        period = 1.0 / rate
        end = time.monotonic() + seconds
        next_t = time.monotonic() + float(chats.rng.uniform(0, period))
        while not stop.is_set() and (now := time.monotonic()) < end:
            if next_t > now:
                stop.wait(min(next_t, end) - now)
                continue
            inst, salt, prompt = chats.next()
            one_request(clients[inst], inst, hasher, salt, prompt, f"req-{res.requests}", expected, sink, res)
            next_t = max(next_t + period * float(chats.rng.uniform(0.5, 1.5)), time.monotonic() - period)
        for c in clients:
            c.flush(5.0)
            for k, v in asdict(c.counters).items():
                res.counters[k] = res.counters.get(k, 0) + v
    except Exception as exc:  # reported, never silent: the soak judges it
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        for c in clients:
            c.close()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", type=Path, required=True)
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--rate", type=float, default=8.0, help="Requests per second.")
    ap.add_argument("--go", type=Path, required=True)
    ap.add_argument("--ready", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    res = run_client(json.loads(a.plan.read_text()), a.index, a.seconds, a.rate, a.go, a.ready)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(res)))
    os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
