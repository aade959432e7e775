"""A well-behaved engine of ``kvtier bench soak``: one process, one :class:`ServiceClient`.

Runs a multi-turn chat workload over shared system prompts, as an engine's
connector would drive the cache: per request ``lookup`` (with a lease) ->
load the hit chunks (``open_read_many``, copy out, close) -> release the lease
-> store the missed chunks (``open_write_many``, copy in, ``commit``). Requests
are paced at ``rate`` per second (an engine looks up at its request rate, not in
a tight loop). Records every lookup's wall time (milliseconds) and every way a
call was not served.

Run as ``python -m kvtier.bench.soak_workload --socket S --index I --seconds D
--go GO_FILE --ready READY_FILE --out OUT.json``; it writes ``READY_FILE`` once
connected, starts when ``GO_FILE`` exists, stops after ``D`` seconds (or on
SIGTERM/SIGINT) and writes its results to ``OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvtier.index.keys import ChunkHasher, KeyNamespace, LayoutSignature
from kvtier.service.client import ServiceClient, ServiceUnavailable
from kvtier.storage.types import WriteSkip

#: Tokens per chunk of the soak namespace.
SOAK_CHUNK_TOKENS = 64
#: Shared system prompts, and chunks in each.
SYSTEM_PROMPTS = 8
SYSTEM_PROMPT_CHUNKS = 4
#: Seconds a restarted client may take to register before it counts as refused.
RESTART_CONNECT_S = 10.0
#: Token-id range of the synthetic vocabulary.
VOCAB = 50_000


def soak_namespace(model: str = "bench/soak-tiny") -> KeyNamespace:
    """The soak's namespace: 4 layers x 2 KV heads x 64 dims, fp16, 64-token chunks (131,072 bytes each)."""
    layout = LayoutSignature(
        engine="bench", attn_backend="numpy", kv_layout="LBHNC", block_size=16,
        num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16",
    )
    return KeyNamespace(model, layout, SOAK_CHUNK_TOKENS)


def system_prompts() -> list[np.ndarray]:
    """The shared system prompts (same in every process: seed 0), ``SYSTEM_PROMPT_CHUNKS`` chunks each."""
    rng = np.random.default_rng(0)
    n = SYSTEM_PROMPT_CHUNKS * SOAK_CHUNK_TOKENS
    return [rng.integers(0, VOCAB, n, dtype=np.uint32) for _ in range(SYSTEM_PROMPTS)]


@dataclass
class WorkloadResult:
    """What one well-behaved client saw (written as JSON by the worker).

    Attributes:
        lookup_ms: wall time of every lookup call, milliseconds.
        requests / lookup_tokens / hit_tokens: requests issued; tokens looked up
            (full chunks) and found.
        loaded_chunks / stored_chunks: chunks copied out of / into the pool.
        load_misses: chunks found by lookup but not loadable (evicted between).
        corrupt_loads: loaded chunks whose first 32 bytes were not their key.
        store_no_room / store_in_flight / store_present: write skips by reason.
        counters: the client's :class:`ClientCounters` at the end (calls not
            served: ``connect_failures``, ``error_replies``, ``skipped_calls``,
            ``timeouts``, ``disconnects``; ``lost_stores``).
        connected_s: seconds from process start to the first connection.
        restart_ms / restart_failures: registration time of each restart
            (milliseconds), and restarts not registered within ``RESTART_CONNECT_S``.
    """

    index: int
    lookup_ms: list[float] = field(default_factory=list)
    requests: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    loaded_chunks: int = 0
    stored_chunks: int = 0
    load_misses: int = 0
    corrupt_loads: int = 0
    store_no_room: int = 0
    store_in_flight: int = 0
    store_present: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    connected_s: float = -1.0
    restart_ms: list[float] = field(default_factory=list)
    restart_failures: int = 0
    error: str = ""


class ChatWorkload:
    """Multi-turn conversations over shared system prompts (seeded per client).

    A conversation is a system prompt (chosen with a skew: a few are popular)
    plus 2-6 turns; each turn's prompt is the whole history plus a user message
    of 32-160 tokens, after which an answer of 32-160 tokens joins the history.
    """

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.prompts = system_prompts()
        w = 1.0 / np.arange(1, len(self.prompts) + 1)
        self.weights = w / w.sum()
        self._history: np.ndarray | None = None
        self._turns_left = 0

    def next_prompt(self) -> np.ndarray:
        """Token ids (``uint32``) of the next request's prompt."""
        if self._history is None or self._turns_left <= 0:
            self._history = self.prompts[int(self.rng.choice(len(self.prompts), p=self.weights))]
            self._turns_left = int(self.rng.integers(2, 7))
        user = self.rng.integers(0, VOCAB, int(self.rng.integers(32, 161)), dtype=np.uint32)
        prompt = np.concatenate([self._history, user])
        answer = self.rng.integers(0, VOCAB, int(self.rng.integers(32, 161)), dtype=np.uint32)
        self._history = np.concatenate([prompt, answer])
        self._turns_left -= 1
        return prompt


def one_request(client: ServiceClient, hasher: ChunkHasher, prompt: np.ndarray, owner: str,
                payload: np.ndarray, sink: np.ndarray, res: WorkloadResult) -> None:
    """Lookup -> load hits -> release -> store misses, as the connector does for one request."""
    keys = hasher.keys(prompt)
    t0 = time.perf_counter()
    found = client.lookup_keys(keys, lease_owner=owner)
    res.lookup_ms.append((time.perf_counter() - t0) * 1e3)
    res.requests += 1
    res.lookup_tokens += len(keys) * hasher.chunk_size
    n = len(found.keys)
    res.hit_tokens += n * hasher.chunk_size
    if n:
        parents = [None, *keys[: n - 1]]
        handles = client.open_read_many(list(zip(keys[:n], parents)))
        for key, h in zip(keys[:n], handles):
            if h is None:
                res.load_misses += 1
                continue
            with h:
                sink[:] = h.buffer
            res.loaded_chunks += 1
            if bytes(sink[:32]) != key:
                res.corrupt_loads += 1
        client.release(owner)
    miss = keys[n:]
    if not miss:
        return
    parents = [keys[n - 1] if n else None, *miss[:-1]]
    for key, parent, got in zip(miss, parents, client.open_write_many(miss, parents)):
        if isinstance(got, np.ndarray):
            got[:] = payload
            got[:32] = np.frombuffer(key, dtype=np.uint8)
            client.commit(key, parent)
            res.stored_chunks += 1
        elif got is WriteSkip.PRESENT:
            res.store_present += 1
        elif got is WriteSkip.IN_FLIGHT:
            res.store_in_flight += 1
        else:
            res.store_no_room += 1


def wait_for_file(path: Path, stop: threading.Event, timeout_s: float) -> bool:
    """Poll (10 ms) until ``path`` exists; False on ``stop`` or after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if stop.is_set() or time.monotonic() > deadline:
            return False
        stop.wait(0.01)
    return True


def _new_client(socket_path: str, ns: KeyNamespace, index: int) -> ServiceClient:
    return ServiceClient(socket_path, ns, f"soak-engine-{index}", timeout_s=2.0, connect_timeout_s=30.0)


def run_client(socket_path: str, index: int, seconds: float, rate: float, go: Path, ready: Path,
               restart_every_s: float = 0.0) -> WorkloadResult:
    """One well-behaved client's whole run (see the module docstring).

    ``restart_every_s`` > 0: every so often (staggered) the client is closed and
    a new one registers, as an engine restart does; its registration time is
    recorded and a registration not done within ``RESTART_CONNECT_S`` is a refusal.
    """
    t_start = time.monotonic()
    res = WorkloadResult(index)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ns = soak_namespace()
    hasher = ChunkHasher(ns)
    client = _new_client(socket_path, ns, index)
    totals: dict[str, int] = {}
    try:
        try:
            client.wait_connected(60.0)
        except ServiceUnavailable as exc:
            res.error = str(exc)
            return res
        res.connected_s = time.monotonic() - t_start
        ready.write_text("ok")
        if not wait_for_file(go, stop, 120.0):
            res.error = "no start signal"
            return res
        base = dict(asdict(client.counters))
        wl = ChatWorkload(seed=1000 + index)
        payload = np.full(ns.chunk_bytes, index, dtype=np.uint8)
        sink = np.empty(ns.chunk_bytes, dtype=np.uint8)
        period = 1.0 / rate
        end = time.monotonic() + seconds
        next_t = time.monotonic() + float(wl.rng.uniform(0, period))
        next_restart = time.monotonic() + restart_every_s * float(wl.rng.uniform(0.5, 1.0))
        while not stop.is_set():
            now = time.monotonic()
            if now >= end:
                break
            if restart_every_s > 0 and now >= next_restart:
                _add_counters(totals, client, base)
                client.close()
                t0 = time.perf_counter()
                client = _new_client(socket_path, ns, index)
                base = {}
                try:
                    client.wait_connected(RESTART_CONNECT_S)
                    res.restart_ms.append((time.perf_counter() - t0) * 1e3)
                except ServiceUnavailable:
                    res.restart_failures += 1
                next_restart = time.monotonic() + restart_every_s
                continue
            if next_t > now:
                stop.wait(min(next_t, end, next_restart if restart_every_s > 0 else end) - now)
                continue
            one_request(client, hasher, wl.next_prompt(), f"req-{res.requests}", payload, sink, res)
            next_t = max(next_t + period * float(wl.rng.uniform(0.5, 1.5)), time.monotonic() - period)
        client.flush(5.0)
        _add_counters(totals, client, base)
        res.counters = totals
    except Exception as exc:  # reported, never silent: the soak judges it
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        client.close()
    return res


def _add_counters(totals: dict[str, int], client: ServiceClient, base: dict[str, int]) -> None:
    for k, v in asdict(client.counters).items():
        totals[k] = totals.get(k, 0) + v - base.get(k, 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--rate", type=float, default=20.0, help="Requests per second.")
    ap.add_argument("--restart-every", type=float, default=0.0, help="Seconds between client restarts (0: none).")
    ap.add_argument("--go", type=Path, required=True)
    ap.add_argument("--ready", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    res = run_client(a.socket, a.index, a.seconds, a.rate, a.go, a.ready, a.restart_every)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(res)))
    os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
