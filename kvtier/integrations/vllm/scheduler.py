"""Scheduler side of the connector: request state, lookup and lease, load and save planning, accounting.

Per request a :class:`_Tracker` lives from its first lookup to
``request_finished``. Invariants (checked by :meth:`KVTierScheduler.check_invariants`
and asserted at each transition):

- **Lease**: ``lease_held`` iff a lookup hit is leased on the index and its load has
  not been handed to the worker (which releases it after the load) nor dropped.
  A tracker whose lookup found nothing usable holds no lease.
- A planned load not yet sent (``pending_load`` or a queued async spec) implies
  ``lease_held``; ``async_inflight`` implies the load was sent as an async load.
- No tracker outlives ``request_finished``; nothing queued for a finished request
  is sent to the worker.
- Loads start at the first block past the engine's (block-aligned) local prefix
  hit: kvtier never writes into blocks vLLM already holds. A PD decode leg's hit
  covers the prompt (async load: vLLM recomputes the last token after it) or all
  but its last token (sync load, ``PDSettings.sync_load_bytes``); either way the
  engine computes exactly that token. Saves cover only full
  prompt chunks computed by the engine, each once, in prompt order.
- Every step's metadata carries its block tables and token ranges
  (``validity.step_blocks``, all requests), from which the worker refuses to store a
  chunk computed over a block that failed to load (``validity.py``). When vLLM
  reports invalid blocks it has rewound each request holding them; chunks past
  a request's new ``num_computed_tokens`` are planned again, so what the worker
  refused is stored once recomputed.

Accounting (:class:`~kvtier.integrations.vllm.accounting.RequestLedger`): engine
hit = ``num_computed_tokens`` at lookup; kvtier hit = tokens of loads sent to the
worker, by tier, minus blocks the worker reported failed (``invalid_block_ids``,
which vLLM delivers after ``request_finished`` for a request that finished in
the same step: such outcomes are settled from ``_unsettled`` at the next output,
or for an async load at the output reporting it finished).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from kvtier.config import KVTierConfig
from kvtier.index.keys import ChunkHasher, KeyNamespace
from kvtier.integrations.vllm.accounting import RequestLedger
from kvtier.integrations.vllm.extras import AdapterFingerprints, UnkeyableRequest, request_extras
from kvtier.integrations.vllm.groups import KVGroups
from kvtier.integrations.vllm.kv_events import FULL_ATTENTION, BlockEventTranslator, GroupSpec, TierChanges
from kvtier.integrations.vllm.modes import LookupIndex, close_scheduler_index, open_scheduler_index
from kvtier.integrations.vllm.pd import PDSettings, RemotePrefill
from kvtier.integrations.vllm.pd_scheduler import PDScheduler
from kvtier.integrations.vllm.types import ChunkCopy, KVTierMetadata, KVTierWorkerMeta, TransferSpec
from kvtier.integrations.vllm.validity import ForeignLoads, step_blocks
from kvtier.integrations.vllm.reset import reset_tiers
from kvtier.integrations.vllm.types import ChunkCopy, KVTierMetadata, TransferSpec
from kvtier.storage.trace_file import TraceRecorder
from kvtier.storage.types import LookupResult

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.vllm")


@dataclass
class _Tracker:
    req_id: str
    tokens: list[int]
    keys: list[bytes]
    block_ids: list[int] = field(default_factory=list)
    saved_chunks: int = 0  # chunks [0, saved_chunks) are stored or known cached
    lookup: LookupResult | None = None
    lease_held: bool = False  # see the module invariants
    pending_load: TransferSpec | None = None  # a sync load to send with this step's metadata
    loaded_blocks: dict[int, int] = field(default_factory=dict)  # engine block id (hybrid: -1 - pos) -> chunk
    load_async: bool = False  # the last lookup asked vLLM for an asynchronous load
    expected_computed: int = 0  # tokens computed when scheduled: the engine's hit, plus kvtier's load
    async_inflight: bool = False  # an async load was sent and its completion not yet seen
    request: Any = field(default=None, repr=False, compare=False)  # vLLM's Request (block hashes for KV events)
    lineage: bytes | None = None  # recorded parent of chunk 0: the salt's lineage marker (index/keys.py)
    # hybrid models (groups.py): block ids of KV cache groups 1.. (``block_ids`` is group 0's)
    more_blocks: list[list[int]] = field(default_factory=list)
    no_more_loads: bool = False  # hybrid: a load of this request failed; later lookups are misses
    # PD (pd_scheduler.py): keys then end with the partial chunk's key (pd_partial tokens)
    pd_prefill: bool = False  # a prefill leg (do_remote_decode)
    pd_marked: bool = False  # its hold was sent to the worker: request_finished keeps the blocks
    pd_remote: RemotePrefill | None = None  # a decode leg: where its KV was prefilled
    pd_confirmed: bool = False  # the prefiller was told it may free the blocks
    pd_partial: int = 0  # tokens of the last partial chunk keyed in ``keys`` (0: none)

    def check(self, queued_async: bool) -> None:
        assert not (self.pending_load is not None and queued_async), f"{self.req_id}: two loads planned"
        if self.pending_load is not None or queued_async:
            assert self.lease_held, f"{self.req_id}: a load is planned without a lease"
        if self.lease_held:
            assert self.lookup is not None and self.lookup.num_tokens > 0, f"{self.req_id}: lease without a hit"
        assert not (self.async_inflight and not self.load_async), f"{self.req_id}: async flag mismatch"
        assert 0 <= self.saved_chunks <= len(self.keys), f"{self.req_id}: saved_chunks out of range"


class KVTierScheduler:
    """The scheduler-role half of :class:`~kvtier.integrations.vllm.KVTierConnector`.

    ``kv_events``: translate the worker's tier changes into vLLM KV events for
    ``take_events`` (:mod:`kvtier.integrations.vllm.kv_events`); the chunks it can
    name are those this scheduler planned to save or found by lookup.
    """

    def __init__(self, config: KVTierConfig, namespace: KeyNamespace, engine_id: str, kv_events: bool = False,
                 pd: PDSettings | None = None, instance: str | None = None,
                 event_groups: Sequence[GroupSpec] = FULL_ATTENTION, groups: KVGroups | None = None):
        self.config = config
        self.groups = groups if groups is not None else KVGroups(block_size=namespace.layout.block_size)
        self.null_block = 0  # vLLM's null block id (connector.bind_gpu_block_pool)
        self.namespace = namespace
        self.engine_id = engine_id
        self.instance = instance  # modes.engine_instance: which worker's tiers this scheduler side uses
        self.chunk_size = namespace.chunk_size
        self.block_size = namespace.layout.block_size
        self.blocks_per_chunk = namespace.blocks_per_chunk
        self.ledger = RequestLedger()
        self._hasher = ChunkHasher(namespace)
        self.pd: PDScheduler | None = None
        if pd is not None and pd.role != "off":
            self.pd = PDScheduler(pd, engine_id, self._hasher, self.blocks_per_chunk, namespace.chunk_bytes)
        self._adapters = AdapterFingerprints()
        self._refused: set[str] = set()  # reasons already logged
        self._index: LookupIndex | None = None
        self._trackers: dict[str, _Tracker] = {}
        self._async_to_send: list[TransferSpec] = []
        self._pd_confirm_next: list[str] = []  # PD decode legs whose sync load left with the last metadata
        # finished requests whose load outcome is not reported yet: req -> (block -> tier, async)
        self._unsettled: dict[str, tuple[dict[int, str], bool]] = {}
        self._foreign = ForeignLoads()  # blocks other connectors load (vLLM's MultiConnector)
        # finished (aborted) requests whose blocks an async load still fills: freed at its finished_sending
        self._held_mid_load: set[str] = set()
        self.events: BlockEventTranslator | None = None
        if kv_events:
            self.events = BlockEventTranslator(self.chunk_size, self.block_size, config.kv_events_map_chunks,
                                               event_groups)
        #: ``trace_capture_path``: every finished request as a Mooncake trace line (None: off).
        self.capture: TraceRecorder | None = None
        if config.trace_capture_path is not None and config.enabled:
            try:
                self.capture = TraceRecorder(config.trace_capture_path, self.chunk_size,
                                             int(config.trace_capture_max_bytes))
            except OSError as exc:  # never take the engine down: no trace, said once
                log.error("kvtier: trace_capture_path %s cannot be created (%s): no trace is recorded",
                          config.trace_capture_path, exc)

    # -- index and leases ----------------------------------------------------------------------
    def _lookup_index(self) -> LookupIndex | None:
        if self._index is None and self.config.enabled:
            self._index = open_scheduler_index(self.config, self.namespace, self.engine_id, self.instance)
        return self._index

    def _drop_lease(self, tr: _Tracker) -> None:
        """End ``tr``'s lease (a failed release is logged: the lease then ends at its TTL)."""
        tr.lease_held = False
        self._release(tr.req_id)

    def _release(self, req_id: str) -> None:
        try:
            index = self._lookup_index()
            if index is not None:
                index.release(req_id)
        except Exception:  # kvtier must never take the engine down
            log.exception("kvtier: releasing the lease of %s failed", req_id)

    # -- request state -------------------------------------------------------------------------
    def _tracker(self, request: "Request") -> _Tracker | None:
        tr = self._trackers.get(request.request_id)
        if tr is None:
            tokens = request.prompt_token_ids
            if tokens is None:  # prompt embeddings only: nothing to key on
                return None
            try:
                extras = request_extras(request, self._adapters)
            except UnkeyableRequest as exc:  # a miss, and nothing stored
                if str(exc) not in self._refused:
                    self._refused.add(str(exc))
                    log.warning("kvtier: requests not cached (%s); first: %s", exc, request.request_id)
                return None
            tokens = list(tokens)
            keys = self._hasher.keys(tokens, request.cache_salt, extras=extras)
            tr = _Tracker(request.request_id, tokens, keys, request=request,
                          lineage=self._hasher.lineage(request.cache_salt))
            if self.pd is not None:
                self.pd.annotate(tr, request, extras)
            self._trackers[request.request_id] = tr
        return tr

    def check_invariants(self) -> None:
        """Assert the module invariants over every live request (cheap; called by tests)."""
        queued = {s.req_id for s in self._async_to_send}
        assert queued <= self._trackers.keys(), f"async loads queued for finished requests: {queued - self._trackers.keys()}"
        for tr in self._trackers.values():
            tr.check(tr.req_id in queued)
        assert not self._unsettled.keys() & self._trackers.keys(), "a live request is also settled as finished"

    # -- vLLM hooks ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        index = self._lookup_index()
        if index is None:
            return 0, False
        tr = None
        try:
            tr = self._tracker(request)
            if tr is None or not self.config.should_load or tr.no_more_loads:
                return 0, False
            assert tr.pending_load is None and not tr.async_inflight, f"{tr.req_id}: looked up with a load planned"
            self.ledger.on_lookup(tr.req_id, len(tr.tokens), num_computed_tokens)
            tr.expected_computed = num_computed_tokens
            # Never the whole prompt: the chunk holding the last token is left out
            # (except for a PD decode leg, whose last token vLLM computes after the load).
            candidates = tr.keys[: max(0, (len(tr.tokens) - 1) // self.chunk_size)]
            if tr.pd_remote is not None and self.pd is not None:
                candidates = tr.keys
            res = index.lookup_keys(candidates, request.request_id)  # replaces an earlier lease of this id
            pd_sync = False
            if tr.pd_remote is not None and self.pd is not None:
                res, pd_sync = self.pd.decode_hit(tr, res, num_computed_tokens)
            tr.lookup = res
            tr.lease_held = res.num_tokens > 0
            tr.saved_chunks = max(tr.saved_chunks, res.num_tokens // self.chunk_size)  # already stored
            if self.events is not None and res.num_tokens:
                self.events.remember(request, tr.keys, range(res.num_tokens // self.chunk_size))
            if res.num_tokens <= num_computed_tokens:
                if tr.lease_held:
                    self._drop_lease(tr)
                if self.pd is not None:
                    self.pd.confirm(tr)  # nothing to load from the prefiller
                return 0, False
            first = num_computed_tokens // self.chunk_size
            tr.load_async = self.config.async_load and any(t != "cpu" for t in res.tiers[first:])
            # Hybrid models: always async, so a failed load is reported as the request (failed_recving)
            tr.load_async = tr.load_async or self.groups.multi
            # PD: WAITING_FOR_REMOTE_KVS, unless the chunks are in memory here and small enough (pd.py)
            tr.load_async = tr.load_async or (tr.pd_remote is not None and not pd_sync)
            return res.num_tokens - num_computed_tokens, tr.load_async
        except Exception:  # kvtier must never take the engine down: a failure is a miss
            log.exception("kvtier lookup failed; treating as a miss")
            if tr is not None:
                tr.lookup = None
                self._drop_lease(tr)
            else:
                self._release(request.request_id)
            return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        tr = self._trackers.get(request.request_id)
        if tr is None:
            return
        if num_external_tokens <= 0 or tr.lookup is None or not tr.lease_held:
            if tr.lease_held:
                self._drop_lease(tr)
            return
        all_ids = blocks.get_block_ids()
        block_ids = all_ids[0]
        more = [self._no_null(ids) for ids in all_ids[1:]] if self.groups.multi else []
        if more:
            block_ids = self._no_null(block_ids)
        hit = tr.lookup.num_tokens
        start = hit - num_external_tokens  # block-aligned local hit
        assert start >= 0 and start % self.block_size == 0, f"{tr.req_id}: load starts at token {start}"
        bpc, bs = self.blocks_per_chunk, self.block_size
        chunks = []
        for ci in range(start // self.chunk_size, -(-hit // self.chunk_size)):  # a PD hit may end mid-chunk
            first = ci * bpc
            offset = max(0, start // bs - first)
            parent = tr.keys[ci - 1] if ci else tr.lineage
            blocks_of_chunk = tuple(block_ids[first + offset : first + bpc])
            more_of_chunk = tuple(tuple(ids[first + offset : first + bpc]) for ids in more)
            chunks.append(ChunkCopy(tr.keys[ci], blocks_of_chunk, offset, parent, more_of_chunk))
        tr.expected_computed = hit
        spec = TransferSpec(request.request_id, chunks, is_async=tr.load_async)
        assert tr.load_async or not self.groups.multi, f"{tr.req_id}: a sync load of a hybrid model"
        if tr.load_async:
            self._async_to_send.append(spec)  # not scheduled until the load completes: send it now
        else:
            tr.pending_load = spec
        tr.saved_chunks = max(tr.saved_chunks, hit // self.chunk_size)

    def _hand_over(self, tr: _Tracker, spec: TransferSpec) -> None:
        """A load leaves with this step's metadata: the worker now owns its lease and outcome."""
        assert tr.lease_held and tr.lookup is not None, f"{tr.req_id}: load sent without a lease"
        tr.lease_held = False
        first = tr.keys.index(spec.chunks[0].key) if spec.chunks else 0  # chunks are consecutive
        hit = tr.lookup.num_tokens
        for ci, ch in enumerate(spec.chunks, start=first):
            assert tr.keys[ci] == ch.key
            if self.groups.multi:  # block ids differ per group (and may be null): key by -(1 + block position)
                pos = ci * self.blocks_per_chunk + ch.offset
                tr.loaded_blocks.update((-1 - (pos + j), ci) for j in range(len(ch.block_ids)))
            else:
                tr.loaded_blocks.update((b, ci) for b in ch.block_ids)
            # Tokens this chunk's blocks load: a PD hit may end mid-block (the prompt's
            # last partial chunk), which must not count as a whole block of hits.
            at = (ci * self.blocks_per_chunk + ch.offset) * self.block_size
            n = min(at + len(ch.block_ids) * self.block_size, hit) - at
            self.ledger.on_load_planned(tr.req_id, tr.lookup.tiers[ci], max(0, n))
        if spec.is_async:
            tr.async_inflight = True
        elif tr.pd_remote is not None:
            self._pd_confirm_next.append(tr.req_id)  # loaded in this step: confirm with its output

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVTierMetadata:
        meta = KVTierMetadata(idle=not getattr(scheduler_output, "total_num_scheduled_tokens", 1))
        if not self.config.enabled:
            return meta
        for spec in self._async_to_send:
            self._hand_over(self._trackers[spec.req_id], spec)
            meta.loads.append(spec)
        self._async_to_send = []
        if self.pd is not None:
            self.pd.end_step(meta)
        if self.config.should_save:
            meta.blocks = step_blocks(scheduler_output)
            meta.blocks.unverified = self._foreign_loads(scheduler_output)
            meta.step = self._foreign.fill(meta.blocks)
        for preempted in scheduler_output.preempted_req_ids or ():
            tr = self._trackers.get(preempted)
            if tr is not None:  # its blocks are freed; it is looked up again on resume
                if tr.pending_load is not None:
                    tr.pending_load = None
                    self._drop_lease(tr)
                tr.block_ids = []
                tr.more_blocks = []
                tr.loaded_blocks = {}
        for new in scheduler_output.scheduled_new_reqs:
            tr = self._trackers.get(new.req_id)
            if tr is None:
                continue
            tr.block_ids = list(new.block_ids[0]) if new.block_ids else []
            tr.more_blocks = [list(ids) for ids in new.block_ids[1:]] if new.block_ids else []
            self._emit(tr, new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0), meta,
                       new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tr = self._trackers.get(req_id)
            if tr is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tr.block_ids = list(new_blocks[0]) if new_blocks else []
                tr.more_blocks = [list(ids) for ids in new_blocks[1:]] if new_blocks else []
            elif new_blocks:
                tr.block_ids.extend(new_blocks[0])
                for g, ids in enumerate(new_blocks[1:]):
                    if g < len(tr.more_blocks):
                        tr.more_blocks[g].extend(ids)
                    else:
                        tr.more_blocks.append(list(ids))
            self._emit(
                tr, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0), meta,
                cached.num_computed_tokens[i],
            )
        return meta

    def _foreign_loads(self, scheduler_output: "SchedulerOutput") -> list[int]:
        """Blocks of requests scheduled (new or resumed) with more computed tokens than the engine's
        hit and kvtier's load: another connector loads them in this step (vLLM's MultiConnector)."""
        out: list[int] = []
        cached = scheduler_output.scheduled_cached_reqs
        starts = [(n.req_id, n.num_computed_tokens, n.block_ids[0] if n.block_ids else [])
                  for n in scheduler_output.scheduled_new_reqs]
        starts += [(r, cached.num_computed_tokens[i], (cached.new_block_ids[i] or ([],))[0])
                   for i, r in enumerate(cached.req_ids) if r in cached.resumed_req_ids]
        bs = self.block_size
        for req_id, computed, table in starts:
            tr = self._trackers.get(req_id)
            if tr is not None and computed > tr.expected_computed:
                out.extend(table[tr.expected_computed // bs : -(-computed // bs)])
        return out


    def _no_null(self, ids: Sequence[int]) -> list[int]:
        """Block ids with vLLM's null block (a slot out of a sliding window) as -1: nothing to copy."""
        return [-1 if b == self.null_block else b for b in ids]

    def _emit(self, tr: _Tracker, computed_after_step: int, meta: KVTierMetadata,
              computed_before_step: int = 0) -> None:
        """Add this step's load and save work for one request to ``meta``."""
        if tr.pending_load is not None:
            self._hand_over(tr, tr.pending_load)
            meta.loads.append(tr.pending_load)
            tr.pending_load = None
        if self.pd is not None:
            self.pd.on_prompt_computed(tr, computed_after_step, self.config.should_save, meta)
        if not self.config.should_save:
            return
        full = min(computed_after_step, len(tr.tokens)) // self.chunk_size
        full = min(full, len(tr.keys), len(tr.block_ids) // self.blocks_per_chunk)
        if self.groups.multi:
            full = self.groups.saveable_chunks((tr.block_ids, *tr.more_blocks), tr.saved_chunks, full,
                                               self.blocks_per_chunk, computed_before_step, self.null_block)
        if full <= tr.saved_chunks:
            return
        bpc = self.blocks_per_chunk
        chunks = [
            ChunkCopy(
                tr.keys[ci], tuple(tr.block_ids[ci * bpc : (ci + 1) * bpc]), parent=tr.keys[ci - 1] if ci else tr.lineage,
                more_blocks=tuple(tuple(ids[ci * bpc : (ci + 1) * bpc]) for ids in tr.more_blocks),
            )
            for ci in range(tr.saved_chunks, full)
        ]
        meta.saves.append(TransferSpec(tr.req_id, chunks))
        if self.events is not None and tr.request is not None:
            self.events.remember(tr.request, tr.keys, range(tr.saved_chunks, full))
        tr.saved_chunks = full

    def update_connector_output(self, connector_output: Any) -> None:
        changes = getattr(connector_output, "kv_cache_events", None)
        if self.events is not None and isinstance(changes, TierChanges):
            self.events.update(changes.get_all_events())
        done = set(connector_output.finished_recving or ()) | set(connector_output.finished_sending or ())
        self._held_mid_load -= set(connector_output.finished_sending or ())
        if self._pd_confirm_next and self.pd is not None:
            # A PD decode leg's sync load ran in the step this output reports (or, with
            # vLLM's async scheduling, the next one): the decoder's own lease keeps the
            # chunks in the store until the worker's load ends, so the prefiller may free.
            for req_id in self._pd_confirm_next:
                tr = self._trackers.get(req_id)
                if tr is not None:
                    self.pd.confirm(tr)
            self._pd_confirm_next = []
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            self._hybrid_load_failed(req_id)
        for req_id in connector_output.finished_recving or ():
            tr = self._trackers.get(req_id)
            if tr is not None:
                tr.async_inflight = False
                if self.pd is not None:
                    self.pd.confirm(tr)  # PD decode leg: the load is over, the prefiller may free
        invalid = set(connector_output.invalid_block_ids or ())
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        self._foreign.on_output(worker_meta.steps if isinstance(worker_meta, KVTierWorkerMeta) else (), invalid)
        if invalid:
            # vLLM has rewound every request that holds an invalid block to recompute
            # from there (a request sharing the blocks as a local prefix hit too, and
            # under async scheduling a step already planned past it); the worker did
            # not store what those requests computed over the gap (validity.py). Save
            # each such chunk again once it is recomputed.
            for tr in self._trackers.values():
                if tr.request is not None:
                    tr.saved_chunks = min(tr.saved_chunks, tr.request.num_computed_tokens // self.chunk_size)
            for tr in self._trackers.values():
                failed = [tr.loaded_blocks[b] for b in invalid if b in tr.loaded_blocks]
                if failed:
                    cut = min(failed)
                    self._account_failure(tr.req_id, {b: tr.lookup.tiers[c] for b, c in tr.loaded_blocks.items()
                                                      if c >= cut} if tr.lookup else {})
                    tr.saved_chunks = min(tr.saved_chunks, cut)
                    tr.loaded_blocks = {b: c for b, c in tr.loaded_blocks.items() if c < cut}
            claimed = {b for tr in self._trackers.values() for b in tr.loaded_blocks}
            for req_id, (tiers_by_block, _) in self._unsettled.items():
                # a block reused by a live request's load is that load's failure
                failed_blocks = {b: t for b, t in tiers_by_block.items() if b in invalid and b not in claimed}
                if failed_blocks:
                    self._account_failure(req_id, failed_blocks)
        # Sync outcomes arrive in the output of the step that ran them; async ones no later
        # than the output reporting the request finished.
        self._unsettled = {r: v for r, v in self._unsettled.items() if v[1] and r not in done}

    def _hybrid_load_failed(self, req_id: str) -> None:
        """A hybrid model's async load failed (``failed_recving``): vLLM recomputes the request from
        its first token (recompute policy); nothing it loaded counts, and it is not looked up again."""
        tr = self._trackers.get(req_id)
        if tr is not None:
            if tr.loaded_blocks and tr.lookup is not None:
                cut = min(tr.loaded_blocks.values())
                self._account_failure(req_id, {b: tr.lookup.tiers[c] for b, c in tr.loaded_blocks.items()})
                tr.saved_chunks = min(tr.saved_chunks, cut)
            tr.loaded_blocks = {}
            tr.no_more_loads = True
        elif req_id in self._unsettled:
            self._account_failure(req_id, dict(self._unsettled[req_id][0]))

    def _account_failure(self, req_id: str, tier_of_failed_block: dict[int, str]) -> None:
        by_tier: dict[str, int] = {}
        for tier in tier_of_failed_block.values():
            by_tier[tier] = by_tier.get(tier, 0) + self.block_size
        self.ledger.on_load_failed(req_id, by_tier)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        tr = self._trackers.pop(request.request_id, None)
        if tr is None:
            return False, None
        if self.capture is not None and len(tr.tokens):
            try:
                n_out = getattr(request, "num_output_tokens", None)  # vLLM's Request; else count the ids
                if n_out is None:
                    n_out = len(getattr(request, "output_token_ids", None) or ())
                self.capture.record(tr.keys, len(tr.tokens), int(n_out))
            except (OSError, ValueError):
                log.exception("kvtier: trace capture failed; stopping it")
                self.capture = None
        self._async_to_send = [s for s in self._async_to_send if s.req_id != tr.req_id]
        if tr.lease_held:  # a hit never handed to the worker
            self._drop_lease(tr)
        if tr.loaded_blocks and tr.lookup is not None:
            tiers = {b: tr.lookup.tiers[c] for b, c in tr.loaded_blocks.items()}
            self._unsettled[tr.req_id] = (tiers, tr.async_inflight)
        params = self.pd.finished(tr, request, block_ids) if self.pd is not None else None
        if tr.async_inflight:
            self._held_mid_load.add(tr.req_id)
        # An async load may still be writing into this request's blocks: keep them
        # until the worker reports the load over (as finished_sending). A PD prefill
        # leg's blocks are kept until the decoder confirms (pd_worker.py).
        return tr.async_inflight or tr.pd_marked, params

    def has_pending_block_frees(self) -> bool:
        """True while a finished request's blocks wait for its async load to end (they come back
        with the worker's ``finished_sending`` for it, within the load's timeout): vLLM then waits
        for them instead of preempting a running request. A PD prefill leg's held blocks do not
        count (they wait on another engine, up to ``pd`` timeouts)."""
        return bool(self._held_mid_load)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict[CacheHitSource, int]:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        tr = self._trackers.get(request.request_id)
        if not num_external_tokens or tr is None or tr.lookup is None:
            return {}
        cs = self.chunk_size
        start = tr.lookup.num_tokens - num_external_tokens
        out: dict[CacheHitSource, int] = {}
        for ci, tier in enumerate(tr.lookup.tiers):
            n = max(0, min((ci + 1) * cs, tr.lookup.num_tokens) - max(ci * cs, start))
            if n:
                src = {"cpu": CacheHitSource.HOST, "disk": CacheHitSource.DISK}.get(
                    tier, CacheHitSource.EXTERNAL_UNSPECIFIED
                )
                out[src] = out.get(src, 0) + n
        return out

    def reset_cache(self) -> bool:
        """Clear what this engine's namespace holds in every tier it owns, or answer False
        (:func:`kvtier.integrations.vllm.reset.reset_tiers`)."""
        if not self.config.enabled:
            return True
        return reset_tiers(self.config, self._lookup_index)

    def take_events(self) -> list[Any]:
        """vLLM KV events of kvtier's tiers since the last call (empty unless ``kv_events``)."""
        return self.events.take() if self.events is not None else []

    def shutdown(self) -> None:
        if self.capture is not None:
            self.capture.close()
        if self.pd is not None:
            self.pd.close()
        if self._index is not None:
            close_scheduler_index(self._index)
        self._index = None

