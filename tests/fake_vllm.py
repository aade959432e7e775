"""Fake vLLM v1 objects and a miniature engine loop that drives ``KVTierConnector`` without a model.

The fakes carry only the attributes the connector API reads (names as in vLLM
0.32: ``SchedulerOutput``, ``NewRequestData``, ``CachedRequestData``,
``KVCacheBlocks``, ``Request``, ``VllmConfig``). :class:`FakeEngine` mimics the
v1 scheduler and model runner call order per step:

scheduler ``get_num_new_matched_tokens`` -> ``update_state_after_alloc`` (skipped
when allocation fails; the lookup is then repeated next step) ->
``build_connector_meta`` -> worker ``bind_connector_metadata`` ->
``start_load_kv`` (before the forward when the step has synchronous loads, after
it otherwise) -> forward -> ``wait_for_save`` -> ``get_transfer_results`` ->
``get_block_ids_with_load_errors`` -> ``clear_connector_metadata`` -> scheduler:
``request_finished`` for requests finished in the step, then
``update_connector_output`` (vLLM's order), then the connector's
``check_invariants``; ``request_finished`` also on aborts between steps. Preemption
frees a request's blocks and sends it back to the waiting queue (looked up again
later); asynchronous loads (``load_kv_async=True``) park the request in
``WAITING_FOR_REMOTE_KVS`` until the worker reports it in ``finished_recving``.

KV model (the "forward"): the KV of token ``t`` of a request is a deterministic
pattern of ``(cache salt, token ids[0..t], t, layer, head, lane)`` (see
:func:`expected_kv`). A forward writes the pattern for the tokens it computes
only if every earlier token of the request holds its correct pattern at that
moment; otherwise it writes a *poisoned* pattern (one mantissa bit flipped),
the way a real model's KV depends on everything before it. Fresh blocks are
filled with ``GARBAGE`` (a NaN never produced by the pattern), so a block that
a load should have filled but did not is never accidentally right.

Checks (an :class:`AssertionError` at once, naming request, block and step):

- every block of a planned load holds exactly the expected pattern when the
  load is over (end of step for sync loads, ``finished_recving`` for async
  ones), or was reported by ``get_block_ids_with_load_errors``;
- no forward runs over a wrong context unless the wrong block was reported
  in that step (vLLM then rewinds ``num_computed_tokens`` to the first reported
  block, as ``Scheduler._update_requests_with_invalid_blocks`` does);
- a lookup never promises the whole prompt nor a non-block-aligned count;
- reported block ids belong to requests that had a load planned;
- requests whose ``request_finished`` returned ``True`` are eventually
  reported finished by the worker (their blocks are held until then).
"""

from __future__ import annotations

import random
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput

# Request states (names as vLLM's RequestStatus).
WAITING = "WAITING"
PREEMPTED = "PREEMPTED"
WAITING_FOR_REMOTE_KVS = "WAITING_FOR_REMOTE_KVS"
RUNNING = "RUNNING"
FINISHED = "FINISHED"

#: Steps without any request submitted, finished or freed after which :meth:`FakeEngine.run` gives up.
STALL_STEPS = 3_000

#: bf16 bit pattern written into freshly allocated blocks: a NaN, never a pattern value.
GARBAGE = 0xFFFF


# -- configuration --------------------------------------------------------------------------
@dataclass(frozen=True)
class Geometry:
    """Engine KV geometry: bf16 paged KV ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` per layer."""

    num_layers: int = 2
    num_kv_heads: int = 1
    head_dim: int = 8
    block_size: int = 16
    num_blocks: int = 48

    @property
    def token_bytes(self) -> int:
        """KV bytes per token over all layers (bf16)."""
        return self.num_layers * self.num_kv_heads * 2 * self.head_dim * 2


@dataclass
class FakeModelConfig:
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype = torch.bfloat16
    model: str = "fake/tiny-model"
    revision: str | None = None
    quantization: str | None = None

    def get_head_size(self) -> int:
        return self.head_size

    def get_num_layers(self, parallel_config: Any = None) -> int:
        return self.num_layers

    def get_num_kv_heads(self, parallel_config: Any = None) -> int:
        return self.num_kv_heads


@dataclass
class FakeCacheConfig:
    block_size: int
    cache_dtype: str = "auto"


@dataclass
class FakeParallelConfig:
    world_size: int = 1


@dataclass
class FakeKVTransferConfig:
    kv_connector_extra_config: dict[str, Any]
    engine_id: str
    kv_connector: str = "KVTierConnector"
    kv_connector_module_path: str = "kvtier.integrations.vllm"
    kv_role: str = "kv_both"
    kv_load_failure_policy: str = "recompute"
    is_kv_producer: bool = True
    is_kv_consumer: bool = True


@dataclass
class FakeVllmConfig:
    model_config: FakeModelConfig
    cache_config: FakeCacheConfig
    parallel_config: FakeParallelConfig
    kv_transfer_config: FakeKVTransferConfig


def make_vllm_config(geometry: Geometry, extra: dict[str, Any], engine_id: str) -> FakeVllmConfig:
    """A fake ``VllmConfig`` whose ``kv_connector_extra_config`` is ``extra``.

    Set ``extra["model_id"]`` to skip weight fingerprinting (there are no weights).
    """
    return FakeVllmConfig(
        FakeModelConfig(geometry.num_layers, geometry.num_kv_heads, geometry.head_dim),
        FakeCacheConfig(geometry.block_size),
        FakeParallelConfig(1),
        FakeKVTransferConfig(dict(extra), engine_id),
    )


# -- requests and scheduler output ----------------------------------------------------------------
@dataclass(eq=False)
class FakeRequest:
    """A vLLM ``Request`` as the connector sees it.

    ``planned_output`` are the token ids it will "sample" (deterministic, so the
    expected KV of every position is known up front); it finishes after
    ``max_tokens`` of them.
    """

    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None
    planned_output: list[int]
    max_tokens: int
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: str = WAITING
    num_preemptions: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    prompt_embeds: Any = None
    lora_request: "FakeLoRARequest | None" = None
    mm_features: "list[FakeMMFeature] | None" = None

    @property
    def kv_context(self) -> tuple[str | None, tuple[tuple[int, str], ...]]:
        """Everything besides the tokens that decides this request's KV: (salt and adapter, that
        affect every position; images, that affect their placeholder positions and after)."""
        seed = self.cache_salt
        if self.lora_request is not None:
            seed = f"{seed or ''}|lora:{self.lora_request.lora_name}:{self.lora_request.weights_tag}"
        images = tuple(sorted((f.mm_position.offset, f.identifier) for f in self.mm_features or ()))
        return seed, images

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def is_finished(self) -> bool:
        return self.status == FINISHED


@dataclass(frozen=True)
class FakeLoRARequest:
    """vLLM's ``LoRARequest`` as the connector reads it. ``weights_tag`` stands for the
    adapter's weights in the KV pattern (a reload with new weights changes it)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    weights_tag: str = ""


@dataclass(frozen=True)
class FakePlaceholderRange:
    offset: int
    length: int


@dataclass(frozen=True)
class FakeMMFeature:
    """vLLM's ``MultiModalFeatureSpec``: ``identifier`` is the item's content hash."""

    identifier: str
    mm_position: FakePlaceholderRange
    modality: str = "image"


@dataclass
class FakeKVCacheBlocks:
    """``KVCacheBlocks`` of a single KV cache group."""

    block_ids: list[int]

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...]:
        return (list(self.block_ids),)


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_token_ids: list[list[int]] = field(default_factory=list)
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class FakeSchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str]
    finished_req_ids: set[str]
    has_sync_kv_loads: bool
    kv_connector_metadata: Any = None


# -- the KV pattern -------------------------------------------------------------------------
_BF16_BITS = (
    torch.arange(256, dtype=torch.float32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy()
)


def expected_kv(
    tokens: list[int], cache_salt: str | None, geometry: Geometry, images: tuple[tuple[int, str], ...] = ()
) -> np.ndarray:
    """The correct KV of ``tokens``: bf16 bit patterns, ``uint16 [len(tokens), layers, heads, 2 * head_dim]``.

    Position ``t`` depends on a rolling hash of ``tokens[0..t]``, on ``t``, on
    the cache salt (and adapter) and on every image placed at or before ``t``
    (``images``: (placeholder offset, identifier)), so equal tokens after
    different prefixes (or for another tenant, adapter or image) have different
    KV. Values are integers 0..250, exact in bf16.
    """
    g = geometry
    h = zlib.crc32((cache_salt or "").encode()) or 1
    at = {off: zlib.crc32(ident.encode()) for off, ident in images}
    prefix = np.empty(len(tokens), dtype=np.int64)
    for t, tok in enumerate(tokens):
        h = (h * 1_000_003 + tok * 7 + t + 1 + at.get(t, 0)) & 0xFFFFFFFF
        prefix[t] = h
    layer = np.arange(g.num_layers)[None, :, None, None] * 37
    head = np.arange(g.num_kv_heads)[None, None, :, None] * 11
    lane = np.arange(2 * g.head_dim)[None, None, None, :] * 5
    vals = (prefix[:, None, None, None] + layer + head + lane) % 251
    return _BF16_BITS[vals]


def poisoned(kv: np.ndarray) -> np.ndarray:
    """KV computed over a wrong context: every value differs from the correct one."""
    return kv ^ np.uint16(1)


# -- connectors ----------------------------------------------------------------------------------
@dataclass
class ConnectorPair:
    """Scheduler- and worker-role connectors of one in-process engine, and its paged KV."""

    scheduler: Any
    worker: Any
    kv_caches: dict[str, torch.Tensor]  # per layer: bf16 [num_blocks, heads, block_size, 2 * head_dim]
    layers: list[np.ndarray]  # the same memory, per layer, as uint16

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()


#: How the fake engine allocates its per-layer KV tensors (vLLM's CPU backend: "stacked").
KV_LAYOUTS = ("stacked", "padded", "separate")


def make_kv_caches(geometry: Geometry, layout: str = "stacked") -> dict[str, torch.Tensor]:
    """Per-layer bf16 KV tensors ``[num_blocks, heads, block_size, 2 * head_dim]``, all GARBAGE.

    ``layout``: "stacked" (views of one storage, layer after layer, as vLLM's CPU
    backend), "padded" (one storage, a gap between layers) or "separate" (one
    allocation per layer).
    """
    g = geometry
    shape = (g.num_blocks, g.num_kv_heads, g.block_size, 2 * g.head_dim)
    per_layer = int(np.prod(shape))
    if layout == "stacked":
        flat = torch.empty(g.num_layers * per_layer, dtype=torch.bfloat16)
        tensors = [flat[i * per_layer : (i + 1) * per_layer].view(shape) for i in range(g.num_layers)]
    elif layout == "padded":
        step = per_layer + 4 * g.block_size * 2 * g.head_dim  # a gap of a few blocks' worth
        flat = torch.empty(g.num_layers * step, dtype=torch.bfloat16)
        tensors = [flat[i * step : i * step + per_layer].view(shape) for i in range(g.num_layers)]
    elif layout == "separate":
        tensors = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(g.num_layers)]
    else:
        raise ValueError(f"unknown KV layout {layout!r}; choose one of {KV_LAYOUTS}")
    for t in tensors:
        t.view(torch.int16).fill_(-1)  # GARBAGE everywhere
    return {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(tensors)}


def make_connectors(geometry: Geometry, extra: dict[str, Any], engine_id: str, kv_layout: str = "stacked") -> ConnectorPair:
    """Build the worker connector (it owns the tiers), register its KV caches, then the scheduler one.

    The scheduler side finds the worker's manager through ``kvtier.storage.registry``
    (same process), as in vLLM's in-process engine core.
    """
    from kvtier.integrations.vllm import KVTierConnector

    cfg = make_vllm_config(geometry, extra, engine_id)
    worker = KVTierConnector(cfg, KVConnectorRole.WORKER, None)
    kv_caches = make_kv_caches(geometry, kv_layout)
    worker.register_kv_caches(kv_caches)
    scheduler = KVTierConnector(cfg, KVConnectorRole.SCHEDULER, None)
    layers = [t.view(torch.int16).numpy().view(np.uint16) for t in kv_caches.values()]
    return ConnectorPair(scheduler, worker, kv_caches, layers)


# -- the engine --------------------------------------------------------------------------------------
@dataclass
class Knobs:
    """Probabilities and sizes of the fake engine's random choices."""

    max_running: int = 5
    token_budget: int = 192
    prefill_chunks: tuple[int, ...] = (16, 32, 48, 64, 96, 10_000)
    target_waiting: int = 6
    p_alloc_fail: float = 0.1  # an allocation that "fails" although blocks are free
    p_preempt: float = 0.03  # per step: preempt a random running request
    p_abort: float = 0.04  # per step: abort a random live request between steps
    p_abort_mid_step: float = 0.01  # per step: abort a scheduled request before the worker runs
    p_abort_after_failed_alloc: float = 0.1  # abort the request whose allocation just failed
    p_local_hit: float = 0.3  # the engine's own prefix cache holds some leading blocks
    #: KV depends on the context, as in a real model: a forward over a wrong block writes
    #: poisoned KV. False: each token's KV is right whatever precedes it (isolates other checks).
    context_dependent: bool = True


@dataclass
class LoadRecord:
    """One finished load of a request: token window, the blocks it covered, those reported failed."""

    req_id: str
    first: int  # tokens [first, end) were to be loaded
    end: int
    block_ids: list[int]  # engine blocks of that window, in order
    reported: set[int]  # of those, the ones reported by get_block_ids_with_load_errors
    is_async: bool


@dataclass
class EngineStats:
    steps: int = 0
    submitted: int = 0
    finished: int = 0
    aborted_waiting_no_lookup: int = 0
    aborted_waiting_after_lookup: int = 0
    aborted_holding_a_hit: int = 0  # of those, the lookup had promised tokens (a lease)
    aborted_waiting_async_load: int = 0
    aborted_running: int = 0
    aborted_mid_step: int = 0
    preemptions: int = 0
    alloc_failures: int = 0
    lookups: int = 0
    local_hit_tokens: int = 0
    external_tokens: int = 0
    loads: int = 0
    async_loads: int = 0
    loaded_blocks_verified: int = 0
    error_blocks: int = 0
    rewinds: int = 0


class FakeEngine:
    """A single-process stand-in for vLLM's scheduler + model runner around one connector pair.

    Args:
        pair: the connectors and paged KV (see :func:`make_connectors`).
        geometry: the KV geometry the pair was built with.
        prompts: ``(token ids, cache salt)`` pairs requests are drawn from, or triples with a
            dict of more ``FakeRequest`` fields (``lora_request``, ``mm_features``).
        seed: seed of every random choice.
        knobs: probabilities and sizes.
        weights: relative popularity of each prompt (default uniform).
    """

    def __init__(
        self,
        pair: ConnectorPair,
        geometry: Geometry,
        prompts: list[tuple[Any, ...]],
        seed: int,
        knobs: Knobs | None = None,
        weights: list[float] | None = None,
    ):
        self.sched = pair.scheduler
        self.worker = pair.worker
        self.layers = pair.layers  # per layer: uint16 [NB, H, BS, 2D]
        self.g = geometry
        self.bs = geometry.block_size
        self.prompts = prompts
        self.weights = weights
        self.rng = random.Random(seed)
        self.knobs = knobs or Knobs()
        self.stats = EngineStats()
        self.free: list[int] = list(range(geometry.num_blocks))
        self.blocks: dict[str, list[int]] = {}
        self.requests: dict[str, FakeRequest] = {}  # live (not finished)
        self.waiting: deque[FakeRequest] = deque()
        self.running: list[FakeRequest] = []
        self.delayed_free: dict[str, FakeRequest] = {}  # finished, blocks held for the connector
        self.finished_recving: set[str] = set()
        self.finished_since_schedule: set[str] = set()
        self.looked_up: dict[str, int] = {}  # looked up since their last allocation -> tokens promised
        self.alloc_failed: FakeRequest | None = None  # the request whose allocation failed this step
        self.load_window: dict[str, tuple[int, int]] = {}  # req -> [first, end) tokens of its load
        self.async_loading: set[str] = set()  # requests whose load window is an async load
        self.load_log: list[LoadRecord] = []  # every verified load, in order
        self.reported: dict[str, set[int]] = {}  # req -> its blocks reported as load errors
        self._expected: dict[tuple[tuple[int, ...], str | None], np.ndarray] = {}
        self._next_id = 0
        #: request id -> blocks the engine's own prefix cache holds (instead of a random choice)
        self.force_local_blocks: dict[str, int] = {}
        #: called each step after ``build_connector_meta``, before the worker runs (fault injection)
        self.before_execute: Callable[[FakeEngine], None] | None = None

    # -- helpers -------------------------------------------------------------------------------
    def expected(self, r: FakeRequest) -> np.ndarray:
        key = (tuple(r.prompt_token_ids), r.kv_context)
        kv = self._expected.get(key)
        if kv is None:
            kv = expected_kv(r.prompt_token_ids + r.planned_output, r.kv_context[0], self.g, r.kv_context[1])
            self._expected[key] = kv
        return kv

    def _positions(self, r: FakeRequest, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        pos = np.arange(start, end)
        ids = np.asarray(self.blocks[r.request_id], dtype=np.int64)
        return ids[pos // self.bs], pos % self.bs

    def read(self, r: FakeRequest, start: int, end: int) -> np.ndarray:
        """KV of tokens ``[start, end)`` as held in the request's blocks: ``uint16 [n, L, H, 2D]``."""
        bids, slots = self._positions(r, start, end)
        return np.stack([layer[bids, :, slots, :] for layer in self.layers], axis=1)  # [n, L, H, 2D]

    def write(self, r: FakeRequest, start: int, end: int, values: np.ndarray) -> None:
        bids, slots = self._positions(r, start, end)
        for i, layer in enumerate(self.layers):
            layer[bids, :, slots, :] = values[:, i]

    def first_bad(self, r: FakeRequest, start: int, end: int) -> int | None:
        """First position in ``[start, end)`` whose KV is not the expected one, or None."""
        if end <= start:
            return None
        ok = (self.read(r, start, end) == self.expected(r)[start:end]).reshape(end - start, -1).all(axis=1)
        if ok.all():
            return None
        return start + int(np.argmin(ok))

    def _alloc(self, n: int) -> list[int]:
        got = [self.free.pop() for _ in range(n)]
        if got:
            for layer in self.layers:
                layer[got] = GARBAGE
        return got

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.bs)

    def _free_blocks(self, req_id: str) -> None:
        self.free.extend(self.blocks.pop(req_id, []))

    def live(self) -> int:
        return len(self.requests) + len(self.delayed_free)

    # -- requests --------------------------------------------------------------------------------
    def submit(
        self, tokens: list[int] | None = None, salt: str | None = None, max_tokens: int | None = None, **fields: Any
    ) -> FakeRequest:
        """Queue a request (a random prompt of the set unless ``tokens`` is given).

        ``fields``: more ``FakeRequest`` attributes (``lora_request``, ``mm_features``,
        ``prompt_embeds``).
        """
        if tokens is None:
            tokens, salt, *more = self.rng.choices(self.prompts, weights=self.weights)[0]
            fields = {**(more[0] if more else {}), **fields}
        rid = f"req-{self._next_id}"
        self._next_id += 1
        h = zlib.crc32(bytes(str(tokens[-8:]), "ascii"))
        planned = [(h + i * 7919) % 32_000 for i in range(3)]
        r = FakeRequest(rid, list(tokens), salt, planned, max_tokens or self.rng.randint(1, 3), **fields)
        self.requests[rid] = r
        self.waiting.append(r)
        self.stats.submitted += 1
        return r

    def abort(self, r: FakeRequest) -> None:
        """Finish ``r`` (abort or stop): ``request_finished``, then free or hold its blocks."""
        rid = r.request_id
        delay = False
        if r.status == WAITING_FOR_REMOTE_KVS:
            delay = rid not in self.finished_recving  # vLLM holds blocks of an in-flight async load
            self.finished_recving.discard(rid)
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        r.status = FINISHED
        held, _ = self.sched.request_finished(r, list(self.blocks.get(rid, [])))
        del self.requests[rid]
        self.finished_since_schedule.add(rid)
        self.looked_up.pop(rid, None)
        if delay or held:
            self.delayed_free[rid] = r
        else:
            self._free_blocks(rid)
            self.load_window.pop(rid, None)
            self.reported.pop(rid, None)

    def _random_abort(self) -> None:
        cands = list(self.requests.values())
        if not cands:
            return
        self._abort_counted(self.rng.choice(cands))

    def _abort_counted(self, r: FakeRequest) -> None:
        s = self.stats
        if r.status == RUNNING:
            s.aborted_running += 1
        elif r.status == WAITING_FOR_REMOTE_KVS:
            s.aborted_waiting_async_load += 1
        elif r.request_id in self.looked_up:
            s.aborted_waiting_after_lookup += 1
            s.aborted_holding_a_hit += self.looked_up[r.request_id] > 0
        else:
            s.aborted_waiting_no_lookup += 1
        self.abort(r)

    def _preempt(self, r: FakeRequest, preempted: set[str]) -> None:
        self.running.remove(r)
        self._free_blocks(r.request_id)
        self.load_window.pop(r.request_id, None)
        self.reported.pop(r.request_id, None)
        r.status = PREEMPTED
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        self.waiting.appendleft(r)
        preempted.add(r.request_id)
        self.stats.preemptions += 1

    def _local_hit(self, r: FakeRequest) -> int:
        if r.request_id in self.force_local_blocks:
            return self.force_local_blocks[r.request_id] * self.bs
        max_blocks = (r.num_tokens - 1) // self.bs
        if max_blocks <= 0 or self.rng.random() >= self.knobs.p_local_hit:
            return 0
        return self.rng.randint(1, min(max_blocks, 4)) * self.bs

    def _verify_load(self, r: FakeRequest, end: int | None = None) -> None:
        """Blocks of ``r``'s planned load hold the right KV, or were reported."""
        first, last = self.load_window.pop(r.request_id)
        reported = self.reported.pop(r.request_id, set())
        is_async = r.request_id in self.async_loading
        self.async_loading.discard(r.request_id)
        ids = self.blocks[r.request_id]
        window = ids[first // self.bs : last // self.bs]
        self.load_log.append(LoadRecord(r.request_id, first, last, list(window), reported & set(window), is_async))
        exp = self.expected(r)
        for b in range(first // self.bs, last // self.bs):
            lo, hi = b * self.bs, (b + 1) * self.bs
            bid = ids[b]
            got = np.stack([layer[bid] for layer in self.layers]).transpose(2, 0, 1, 3)  # [BS, L, H, 2D]
            if np.array_equal(got, exp[lo:hi]):
                self.stats.loaded_blocks_verified += 1
            elif bid in reported:
                self.stats.error_blocks += 1
            else:
                raise AssertionError(
                    f"step {self.stats.steps}: {r.request_id} block #{b} (id {bid}, tokens {lo}..{hi}) "
                    f"of its load [{first}, {last}) holds wrong KV and was not reported as a load error"
                )

    # -- one engine step ----------------------------------------------------------------------------
    def step(self) -> None:
        k, rng = self.knobs, self.rng
        while len(self.waiting) < k.target_waiting and self._submitting():
            self.submit()
        if rng.random() < k.p_abort:
            self._random_abort()
        self.alloc_failed = None
        so, scheduled = self._schedule()
        meta = self.sched.build_connector_meta(so)
        so.kv_connector_metadata = meta
        mid_abort: list[tuple[FakeRequest, bool]] = []
        if scheduled and rng.random() < k.p_abort_mid_step:
            # Async scheduling: an abort may arrive after the step was scheduled, before it runs.
            r = rng.choice(scheduled)[0]
            held, _ = self.sched.request_finished(r, list(self.blocks.get(r.request_id, [])))
            mid_abort.append((r, bool(held)))
            self.stats.aborted_mid_step += 1
        if self.before_execute is not None:
            self.before_execute(self)
        out, ctx_bad = self._execute(so, scheduled)
        self._update(so, out, scheduled, ctx_bad, mid_abort)
        self.sched.check_invariants()
        self.stats.steps += 1
        r = self.alloc_failed
        if r is not None and r.request_id in self.requests and rng.random() < k.p_abort_after_failed_alloc:
            self._abort_counted(r)
        if not scheduled and (self.async_loading or self.delayed_free):
            time.sleep(0.0005)  # only transfers in flight: let the connector's threads run

    #: set by :meth:`run`: how many requests to submit in all
    _limit: int = 0

    def _submitting(self) -> bool:
        return self.stats.submitted < self._limit

    def _schedule(self) -> tuple[FakeSchedulerOutput, list[tuple[FakeRequest, int, int]]]:
        k, rng = self.knobs, self.rng
        preempted: set[str] = set()
        budget = k.token_budget
        scheduled: list[tuple[FakeRequest, int, int]] = []
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        num_sched: dict[str, int] = {}
        has_sync = False

        if self.running and rng.random() < k.p_preempt:
            self._preempt(rng.choice(self.running), preempted)

        # running requests first (as vLLM), preempting from the back on block shortage
        for r in list(self.running):
            if r not in self.running or budget <= 0:
                continue
            nc = r.num_computed_tokens
            n = min(r.num_tokens - nc, rng.choice(k.prefill_chunks), budget)
            if n <= 0:
                continue
            need = self._blocks_for(nc + n) - len(self.blocks[r.request_id])
            while need > len(self.free) and r in self.running:
                self._preempt(self.running[-1], preempted)
            if r not in self.running:
                break
            new = self._alloc(max(0, need))
            self.blocks[r.request_id].extend(new)
            cached.req_ids.append(r.request_id)
            cached.new_block_ids.append((new,) if new else None)
            cached.num_computed_tokens.append(nc)
            cached.num_output_tokens.append(len(r.output_token_ids))
            num_sched[r.request_id] = n
            scheduled.append((r, nc, n))
            budget -= n

        skipped: list[FakeRequest] = []
        while not preempted and self.waiting and len(self.running) < k.max_running and budget > 0:
            r = self.waiting[0]
            rid = r.request_id
            if r.status == WAITING_FOR_REMOTE_KVS:
                if rid not in self.finished_recving:
                    skipped.append(self.waiting.popleft())
                    continue
                self._promote(r)
            local = ext = 0
            is_async = False
            if r.num_computed_tokens == 0:
                local = self._local_hit(r)
                ext, is_async = self.sched.get_num_new_matched_tokens(r, local)
                self.stats.lookups += 1
                self.looked_up[rid] = ext or 0
                if ext is None:
                    skipped.append(self.waiting.popleft())
                    continue
                assert ext >= 0, ext
                if ext:
                    assert (local + ext) % self.bs == 0, f"{rid}: hit of {local}+{ext} tokens is not block aligned"
                    assert local + ext <= r.num_tokens - 1, (
                        f"{rid}: lookup promised {local}+{ext} of {r.num_tokens} tokens: the engine must compute one"
                    )
                computed = local + ext
            else:
                computed = r.num_computed_tokens
            n = min(r.num_tokens - computed, rng.choice(k.prefill_chunks), budget)
            have = self.blocks.get(rid, [])
            need = self._blocks_for(computed + n) - len(have)
            if rng.random() < k.p_alloc_fail or need > len(self.free):
                self.stats.alloc_failures += 1
                self.alloc_failed = r
                break  # vLLM stops admitting waiting requests for this step
            if rid not in self.blocks:
                self.blocks[rid] = []
                self.stats.local_hit_tokens += local
            self.blocks[rid].extend(self._alloc(need))
            if local:
                exp = self.expected(r)
                self.write(r, 0, local, exp[:local])  # the engine's own prefix cache content
            self.sched.update_state_after_alloc(r, FakeKVCacheBlocks(self.blocks[rid]), ext)
            self.looked_up.pop(rid, None)
            if ext:
                self.load_window[rid] = (local, local + ext)
                self.reported[rid] = set()
                self.stats.external_tokens += ext
                self.stats.loads += 1
            if is_async and ext:
                self.stats.async_loads += 1
                self.async_loading.add(rid)
                r.status = WAITING_FOR_REMOTE_KVS
                r.num_computed_tokens = computed
                skipped.append(self.waiting.popleft())
                continue
            self.waiting.popleft()
            self.running.append(r)
            r.num_computed_tokens = computed
            has_sync = has_sync or ext > 0
            if r.status == WAITING:
                new_reqs.append(NewRequestData(rid, list(r.prompt_token_ids), (list(self.blocks[rid]),), computed))
            else:
                assert r.status == PREEMPTED, r.status
                cached.req_ids.append(rid)
                cached.resumed_req_ids.add(rid)
                cached.new_block_ids.append((list(self.blocks[rid]),))
                cached.num_computed_tokens.append(computed)
                cached.num_output_tokens.append(len(r.output_token_ids))
                cached.all_token_ids[rid] = r.all_token_ids
            r.status = RUNNING
            num_sched[rid] = n
            scheduled.append((r, computed, n))
            budget -= n
        for r in reversed(skipped):
            self.waiting.appendleft(r)

        finished, self.finished_since_schedule = self.finished_since_schedule, set()
        so = FakeSchedulerOutput(
            new_reqs, cached, num_sched, sum(num_sched.values()), preempted, finished, has_sync
        )
        return so, scheduled

    def _promote(self, r: FakeRequest) -> None:
        """An async load finished: verify it, and let the request be scheduled (vLLM's
        ``_update_waiting_for_remote_kv``)."""
        rid = r.request_id
        self.finished_recving.discard(rid)
        if rid in self.load_window:
            self._verify_load(r)
        if r.num_computed_tokens == 0:
            self._free_blocks(rid)  # nothing valid: start over (a new lookup)
        elif r.num_computed_tokens == r.num_tokens:
            r.num_computed_tokens -= 1
        r.status = PREEMPTED if r.num_preemptions else WAITING

    def _execute(
        self, so: FakeSchedulerOutput, scheduled: list[tuple[FakeRequest, int, int]]
    ) -> tuple[KVConnectorOutput, dict[str, int | None]]:
        w = self.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        if so.has_sync_kv_loads:
            w.start_load_kv(None)
        ctx_bad: dict[str, int | None] = {}
        for r, nc, n in scheduled:  # the forward
            bad = self.first_bad(r, 0, nc)
            ctx_bad[r.request_id] = bad
            exp = self.expected(r)[nc : nc + n]
            wrong = bad is not None and self.knobs.context_dependent
            self.write(r, nc, nc + n, poisoned(exp) if wrong else exp)
        if not so.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        res = w.get_transfer_results(so.finished_req_ids)
        invalid = set(w.get_block_ids_with_load_errors() or ())
        w.clear_connector_metadata()
        out = KVConnectorOutput(
            finished_sending=set(res.finished_sending or ()),
            finished_recving=set(res.finished_recving or ()),
            invalid_block_ids=invalid,
            failed_recving=set(getattr(res, "failed_recving", ()) or ()),
        )
        return out, ctx_bad

    def _update(
        self,
        so: FakeSchedulerOutput,
        out: KVConnectorOutput,
        scheduled: list[tuple[FakeRequest, int, int]],
        ctx_bad: dict[str, int | None],
        mid_abort: list[tuple[FakeRequest, bool]],
    ) -> None:
        invalid = out.invalid_block_ids
        if invalid:
            owners: set[int] = set()
            for rid in self.load_window:
                owners.update(self.blocks.get(rid, ()))
            stray = invalid - owners
            assert not stray, f"step {self.stats.steps}: load errors reported for blocks {sorted(stray)} no load used"
        # async loads: rewind to the first failed block (vLLM, evict_blocks=False)
        for r in list(self.waiting) + list(self.delayed_free.values()):
            rid = r.request_id
            if rid in self.load_window and (invalid or rid in out.failed_recving):
                ids = self.blocks.get(rid, [])
                mine = invalid.intersection(ids)
                self.reported[rid] |= mine
                if r.status == WAITING_FOR_REMOTE_KVS:
                    if rid in out.failed_recving:
                        r.num_computed_tokens = 0
                    for idx in range(self._blocks_for(r.num_computed_tokens)):
                        if ids[idx] in mine:
                            r.num_computed_tokens = idx * self.bs
                            self.stats.rewinds += 1
                            break
        # sync loads and forwards
        aborted = {r.request_id for r, _ in mid_abort}
        for r, nc, n in scheduled:
            rid = r.request_id
            ids = self.blocks[rid]
            first = None
            for idx in range(self._blocks_for(nc)):
                if ids[idx] in invalid:
                    first = idx
                    break
            if rid in self.load_window:
                self.reported[rid] |= invalid.intersection(ids)
                self._verify_load(r)
            bad = ctx_bad[rid]
            if bad is not None and (first is None or first * self.bs > bad):
                raise AssertionError(
                    f"step {self.stats.steps}: {rid} computed tokens {nc}..{nc + n} over wrong KV at token "
                    f"{bad} (block id {ids[bad // self.bs]}) that no load error reported"
                )
            if first is not None:
                r.num_computed_tokens = first * self.bs
                self.stats.rewinds += 1
                continue
            r.num_computed_tokens = nc + n
            if r.num_computed_tokens >= r.num_tokens and r.status == RUNNING and rid not in aborted:
                r.output_token_ids.append(r.planned_output[len(r.output_token_ids)])
                if len(r.output_token_ids) >= r.max_tokens:
                    self.stats.finished += 1
                    self.abort(r)
        for r, held in mid_abort:  # request_finished was called before the step ran
            rid = r.request_id
            if rid in self.requests:
                if r in self.running:
                    self.running.remove(r)
                r.status = FINISHED
                del self.requests[rid]
                self.finished_since_schedule.add(rid)
                if held:
                    self.delayed_free[rid] = r
                else:
                    self._free_blocks(rid)
                    self.load_window.pop(rid, None)
                    self.reported.pop(rid, None)
        # vLLM calls the connector here (Scheduler._update_from_kv_xfer_finished), after the
        # requests finished in this step were reported through request_finished.
        self.sched.update_connector_output(out)
        for rid in out.finished_recving or ():
            if rid in self.requests and self.requests[rid].status == WAITING_FOR_REMOTE_KVS:
                self.finished_recving.add(rid)
        for rid in (out.finished_recving or set()) | (out.finished_sending or set()):
            r = self.delayed_free.pop(rid, None)
            if r is not None:
                self._free_blocks(rid)
                self.load_window.pop(rid, None)
                self.reported.pop(rid, None)

    # -- driving ---------------------------------------------------------------------------------------
    def run(self, num_requests: int, max_steps: int) -> EngineStats:
        """Submit ``num_requests`` requests in all and step until every one has finished.

        Raises:
            AssertionError: a data check failed, or ``max_steps`` passed first.
        """
        self._limit = num_requests
        stalled, last = 0, None
        while self.stats.submitted < num_requests or self.live():
            state = (self.stats.submitted, self.live(), self.stats.finished, len(self.free))
            stalled = stalled + 1 if state == last else 0
            last = state
            if self.stats.steps >= max_steps or stalled > STALL_STEPS:
                raise AssertionError(
                    f"not done after {self.stats.steps} steps ({stalled} without progress): "
                    f"{len(self.requests)} live requests, {len(self.delayed_free)} finished ones "
                    "still held by the connector"
                )
            self.step()
        assert sorted(self.free) == list(range(self.g.num_blocks)), "the fake engine leaked blocks"
        return self.stats

    def serve(
        self, tokens: list[int], salt: str | None = None, local_blocks: int = 0, max_steps: int = 10_000,
        **fields: Any,
    ) -> FakeRequest:
        """Submit one request and step until it has finished (for scripted scenarios)."""
        r = self.submit(tokens, salt, max_tokens=1, **fields)
        self.force_local_blocks[r.request_id] = local_blocks
        self._limit = self.stats.submitted
        for _ in range(max_steps):
            if r.request_id not in self.requests and r.request_id not in self.delayed_free:
                return r
            self.step()
        raise AssertionError(f"{r.request_id} not finished after {max_steps} steps")

    def idle_steps(self, n: int) -> None:
        """Run ``n`` steps that schedule nothing new (lets the worker report finished transfers)."""
        saved, self._limit = self._limit, self.stats.submitted
        knobs, self.knobs = self.knobs, Knobs(p_abort=0, p_abort_mid_step=0, p_preempt=0, p_alloc_fail=0)
        try:
            for _ in range(n):
                self.step()
        finally:
            self._limit, self.knobs = saved, knobs
