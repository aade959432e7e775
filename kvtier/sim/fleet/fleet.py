"""Fleet replay: a trace's requests routed over N simulated instances by kvtier's own router code.

Routing calls the real router modules, offline: :class:`kvtier.router.prefix_index.PrefixIndex`
is fed the instances' KV events (vLLM's wire structs, :mod:`kvtier.events.schema`: engine
blocks as ``GPU``, kvtier's CPU/disk tiers as ``CPU``/``DISK``, with their token ids, exactly
what the HTTP router's event feeds apply), :func:`kvtier.router.scoring.predicted_hit` and
:func:`kvtier.router.scoring.rank` pick the instance (policies ``kv-aware``, ``round-robin``,
``least-loaded``), and :class:`kvtier.router.load.LoadTracker` (on the simulated clock) holds
the load term, begun at routing and ended when the request finishes. Events are applied when
the step that caused them ends (the router sees what a subscriber would).

Token ids of a request come from its hash ids (:func:`kvtier.sim.blocks.block_tokens`), so the
router's blake3 chain keys see the same prefixes as the trace. Reuse is Dynamo's definition:
``1 - computed prefill tokens / input tokens`` (a hit is cached in the routed instance's
engine or kvtier tiers; the last prompt token is always computed).
"""

from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

from kvtier.events.schema import BlockRemoved, BlockStored, KVEventBatch
from kvtier.router.config import Weights
from kvtier.router.load import LoadTracker
from kvtier.router.prefix_index import PrefixIndex
from kvtier.router.scoring import Candidate, predicted_hit, rank
from kvtier.sim.blocks import blocks_tokens
from kvtier.sim.fleet.engine import EngineParams, Instance, KvtierTiers, Request
from kvtier.sim.replay import SimStats, SimTier
from kvtier.storage.trace_file import TraceRecord
from kvtier.tiers.policies import make_policy

ROUTINGS = ("kv-aware", "round-robin", "least-loaded")


@dataclass(frozen=True)
class FleetConfig:
    """One fleet replay.

    Attributes:
        workers: instances.
        routing: one of :data:`ROUTINGS`.
        engine_blocks: engine block cache per instance (blocks of ``block_size`` tokens).
        block_size: tokens per block (the trace's).
        speed: arrival speed-up (timestamps divided by it).
        params: engine timing.
        cpu_blocks, disk_blocks: kvtier tiers per instance (0: none).
        pool_blocks: one shared pool for the fleet (0: none).
        policy: kvtier tiers' eviction policy.
        weights: router score weights.
        assign: the worker of each request, in trace order (a real run's, replayed as it was
            routed); None: ``routing`` decides. ``routing`` still says which events are fed.
    """

    workers: int
    routing: str
    engine_blocks: int
    block_size: int
    speed: float
    params: EngineParams
    cpu_blocks: int = 0
    disk_blocks: int = 0
    pool_blocks: int = 0
    policy: str = "lru"
    weights: Weights = field(default_factory=Weights)
    assign: tuple[int, ...] | None = None


@dataclass
class FleetResult:
    """What one fleet replay measured (times in seconds)."""

    config: dict
    requests: int
    input_tokens: int
    computed_tokens: int
    hit_tokens_by_tier: dict[str, int]
    requests_per_worker: list[int]
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    makespan_s: float
    router_decisions: dict[str, int]
    index_bad_events: int
    rejected: int = 0

    @property
    def reuse(self) -> float:
        return 1 - self.computed_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def max_request_share_ratio(self) -> float:
        mean = sum(self.requests_per_worker) / len(self.requests_per_worker)
        return max(self.requests_per_worker) / mean if mean else 0.0

    def as_dict(self) -> dict:
        return {**self.config, "requests": self.requests, "input_tokens": self.input_tokens,
                "computed_tokens": self.computed_tokens, "reuse": self.reuse,
                "hit_tokens_by_tier": self.hit_tokens_by_tier, "requests_per_worker": self.requests_per_worker,
                "max_request_share_ratio": self.max_request_share_ratio, "ttft_mean_ms": 1e3 * self.ttft_mean_s,
                "ttft_p50_ms": 1e3 * self.ttft_p50_s, "ttft_p99_ms": 1e3 * self.ttft_p99_s,
                "makespan_s": self.makespan_s, "router_decisions": self.router_decisions,
                "index_bad_events": self.index_bad_events}


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


#: A planned step's heap entry: the instance, its prefill chunks, its number of identical steps.
_Step = tuple[Instance, list[tuple[Request, int]], int]


class FleetSim:
    """Event-driven replay of ``records`` on a fleet (see the module doc)."""

    def __init__(self, cfg: FleetConfig) -> None:
        if cfg.routing not in ROUTINGS:
            raise ValueError(f"unknown routing {cfg.routing!r}; choose one of {', '.join(ROUTINGS)}")
        if cfg.workers < 1 or cfg.engine_blocks < 1 or cfg.speed <= 0:
            raise ValueError("workers, engine_blocks and speed must be positive")
        self.cfg = cfg
        self.now = 0.0
        self.names = [f"w{i}" for i in range(cfg.workers)]
        self.index = PrefixIndex(self.names)
        self.load = LoadTracker(self.names, cfg.weights, clock=lambda: self.now)
        pool = SimTier(cfg.pool_blocks, make_policy(cfg.policy), SimStats(cfg.policy, cfg.pool_blocks)) \
            if cfg.pool_blocks else None
        self.instances = [
            Instance(i, cfg.params, cfg.engine_blocks, cfg.block_size,
                     KvtierTiers(cfg.cpu_blocks, cfg.disk_blocks, pool, cfg.policy)
                     if (cfg.cpu_blocks or cfg.disk_blocks or pool) else None, self._event)
            for i in range(cfg.workers)]
        self._pending: list[list] = [[] for _ in range(cfg.workers)]
        self._rr = 0
        self.decisions: dict[str, int] = {}
        self.ttfts: list[float] = []
        #: Per request (trace order): the finished :class:`Request` (worker, hits, first_token);
        #: None when rejected. ``ttft_of[idx]``: its time to first token (seconds).
        self.per_request: list[Request | None] = []
        self.ttft_of: dict[int, float] = {}
        self.served = [0] * cfg.workers
        self.hits: dict[str, int] = {}
        #: Requests larger than an engine's whole block cache (refused, as vLLM does).
        self.rejected = 0

    # -- KV events ----------------------------------------------------------------------
    def _event(self, worker: int, kind: str, ids: list[int], parent: int | None) -> None:
        if self.cfg.routing != "kv-aware":
            return
        if kind == "stored":
            # Token ids as one numpy array (the struct is applied, never encoded, here).
            toks = blocks_tokens(ids, self.cfg.block_size).ravel()
            ev: BlockStored | BlockRemoved = BlockStored(block_hashes=list(ids), parent_block_hash=parent, token_ids=toks,  # type: ignore[arg-type]
                             block_size=self.cfg.block_size, lora_id=None, medium="GPU", lora_name=None)
        else:
            ev = BlockRemoved(block_hashes=list(ids), medium="GPU")
        self._pending[worker].append(ev)

    def _flush_events(self, worker: int) -> None:
        evs = self._pending[worker]
        if evs:
            self.index.apply(self.names[worker], KVEventBatch(ts=self.now, events=evs))
            self._pending[worker] = []

    # -- routing ------------------------------------------------------------------------
    def _route(self, req: Request, tokens: np.ndarray) -> int:
        cfg = self.cfg
        if cfg.assign is not None:
            if req.idx >= len(cfg.assign) or not 0 <= cfg.assign[req.idx] < cfg.workers:
                raise ValueError(f"request {req.idx}: no worker in 0..{cfg.workers - 1} assigned")
            self.decisions["assigned"] = self.decisions.get("assigned", 0) + 1
            return cfg.assign[req.idx]
        keys_by_bs: dict[int, list[bytes]] = {}
        cands = []
        for i, name in enumerate(self.names):
            hit_tokens, hit_score = 0, 0.0
            per_tier: dict[str, int] = {}
            if cfg.routing == "kv-aware":
                hit_tokens, hit_score, per_tier = predicted_hit(self.index, name, tokens, keys_by_bs, cfg.weights)
            cands.append(Candidate(name=name, index=i, hit_tokens=hit_tokens, hit_score=hit_score, per_tier=per_tier,
                                   load_tokens=self.load.load_tokens(name), last_assigned=self.load.last_assigned(name)))
        d = rank(cfg.routing, cands, cfg.weights.load, self._rr)
        if d.policy == "round-robin":
            self._rr = (d.choice.index + 1) % cfg.workers
        self.decisions[d.reason] = self.decisions.get(d.reason, 0) + 1
        return d.choice.index

    # -- the event loop -----------------------------------------------------------------
    def run(self, records: Iterable[TraceRecord]) -> FleetResult:
        cfg = self.cfg
        bs = cfg.block_size
        heap: list[tuple[float, int, int, Request | _Step]] = []  # (time, order, kind 0=arrival 1=step, data)
        seq = 0
        it = iter(records)
        n_in = 0
        reqs_done = 0
        arrival_at = [float("inf")]  # time of the one pending arrival

        def push(t: float, kind: int, data: Request | _Step) -> None:
            nonlocal seq
            heapq.heappush(heap, (t, seq, kind, data))
            seq += 1

        def next_arrival() -> None:
            nonlocal n_in
            rec = next(it, None)
            if rec is None:
                return
            ids = list(rec.hash_ids[: rec.input_length // bs])
            req = Request(idx=n_in, arrival=rec.timestamp_ms / 1000 / cfg.speed, input_length=rec.input_length,
                          output_length=max(1, rec.output_length), ids=ids,
                          blocks=-(-(rec.input_length + max(1, rec.output_length)) // bs))
            req._rec = rec  # type: ignore[attr-defined]
            self.per_request.append(None)
            n_in += 1
            arrival_at[0] = req.arrival
            push(req.arrival, 0, req)

        def keys_of(req: Request) -> list[bytes]:
            return [_key(i) for i in req.ids]

        def on_first(req: Request) -> None:
            ttft = req.first_token - req.arrival + cfg.params.first_token_overhead_s  # type: ignore[operator]
            self.ttfts.append(ttft)
            self.per_request[req.idx] = req
            self.ttft_of[req.idx] = ttft
            inst = self.instances[req.worker]
            if inst.tiers is not None:
                inst.tiers.store(keys_of(req))
            for t, n in req.hit_tiers.items():
                self.hits[t] = self.hits.get(t, 0) + n
            self.hits["engine"] = self.hits.get("engine", 0) + req.hit_engine

        def on_done(req: Request) -> None:
            nonlocal reqs_done
            self.load.end(self.names[req.worker], req.input_length)
            reqs_done += 1

        def start_step(inst: Instance) -> None:
            if not inst.has_work():
                inst.busy = False
                return
            inst.busy = True
            if not inst.waiting and not inst.prefilling:
                k, dt = inst.decode_only_steps(min(arrival_at[0], self.now + 3600.0), self.now)
                push(self.now + dt, 1, (inst, [], k))
                return
            dt, chunks = inst.plan_step(keys_of)
            if not chunks and not inst.decoding:  # blocked on blocks with nothing running: cannot happen
                raise RuntimeError(f"instance {inst.idx}: a request needs more blocks than the cache has")
            push(self.now + dt, 1, (inst, chunks, 1))

        next_arrival()
        while heap:
            if heap[0][2] == 0:
                arrival_at[0] = float("inf")
            t, _, kind, data = heapq.heappop(heap)
            self.now = t
            if isinstance(data, Request):  # (kind 0)
                req = data
                rec = req._rec  # type: ignore[attr-defined]
                if req.blocks > cfg.engine_blocks:  # vLLM refuses a request its KV cache cannot hold
                    self.rejected += 1
                    next_arrival()
                    continue
                tokens = blocks_tokens(rec.hash_ids, bs).ravel()[: rec.input_length] \
                    if cfg.routing == "kv-aware" else np.zeros(0, dtype=np.uint32)
                w = self._route(req, tokens)
                req.worker = w
                self.served[w] += 1
                self.load.begin(self.names[w], req.input_length)
                inst = self.instances[w]
                inst.waiting.append(req)
                inst.input_tokens += req.input_length
                if not inst.busy:
                    start_step(inst)
                next_arrival()
            else:
                inst, chunks, k = data
                inst.finish_step(self.now, chunks, k, on_first, on_done)
                self._flush_events(inst.idx)
                start_step(inst)
        computed = sum(i.computed_tokens for i in self.instances)
        total_in = sum(i.input_tokens for i in self.instances)
        tt = sorted(self.ttfts)
        bad = sum(s["bad_events"] + s["orphans"] for s in self.index.stats().values())
        return FleetResult(
            config={"workers": cfg.workers, "routing": cfg.routing, "engine_blocks": cfg.engine_blocks,
                    "block_size": cfg.block_size, "speed": cfg.speed, "engine": cfg.params.name,
                    "cpu_blocks": cfg.cpu_blocks, "disk_blocks": cfg.disk_blocks, "pool_blocks": cfg.pool_blocks,
                    "policy": cfg.policy},
            requests=reqs_done, input_tokens=total_in, computed_tokens=computed,
            hit_tokens_by_tier=dict(self.hits), requests_per_worker=list(self.served),
            ttft_mean_s=statistics.fmean(tt) if tt else 0.0, ttft_p50_s=_pct(tt, 0.5), ttft_p99_s=_pct(tt, 0.99),
            makespan_s=self.now, router_decisions=dict(self.decisions), index_bad_events=bad, rejected=self.rejected)


def _pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


def unbounded_reuse(records: Iterable[TraceRecord], block_size: int) -> float:
    """Reuse of one unbounded cache of full blocks (the last prompt token always computed)."""
    seen: set[int] = set()
    total = hit = 0
    for rec in records:
        ids = rec.hash_ids[: rec.input_length // block_size]
        p = 0
        while p < len(ids) and ids[p] in seen:
            p += 1
        hit += min(p * block_size, rec.input_length - 1)
        total += rec.input_length
        seen.update(ids)
    return hit / total if total else 0.0


def take(records: Iterable[TraceRecord], n: int | None) -> Iterator[TraceRecord]:
    for i, r in enumerate(records):
        if n is not None and i >= n:
            return
        yield r
