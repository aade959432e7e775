"""vLLM v1 KV connector: ``KVTierConnector``.

Load it with::

    LLM(model, kv_transfer_config={
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_capacity": "4GiB", "disk_path": "/var/cache/kvtier"},
    })

Scheduler side (``get_num_new_matched_tokens`` ... ``request_finished``): looks up
the longest cached prefix of each new prompt beyond what vLLM's own prefix cache
holds, leases those chunks, and after block allocation plans, per step, which
chunks to load into which blocks and which newly computed full prompt chunks to
save. Worker side: loads planned chunks before the forward pass and saves
planned chunks after it (``wait_for_save``), copying whole paged blocks.

Loads of chunks held only by a lower tier (disk, remote) are asynchronous
(``async_load``): the request waits in vLLM's WAITING_FOR_REMOTE_KVS state while a
worker thread promotes the chunks and fills its blocks, the engine keeps running
other requests, and ``get_finished`` reports completion. CPU hits load inline.

Invariants:
- Loads start at the first block past the engine's (block-aligned) local
  prefix hit: kvtier never writes into blocks vLLM already holds.
- A load either fills every planned block or reports the unfilled ones through
  ``get_block_ids_with_load_errors`` so vLLM recomputes them: never a short or
  silent wrong load.
- Every lease taken by a lookup ends: on load, when the engine needs nothing
  from us, on request finish/abort, on a repeated lookup, or at its TTL.
- Blocks being filled by an asynchronous load are never freed under it: a
  request finished or aborted mid-load is held (``request_finished`` returns
  True) until the worker reports it in ``finished_sending`` after the load ends.
- Embedded mode (default) keeps the tiers in the worker process, which owns
  them. The scheduler side calls the worker's manager directly when both share
  a process (``kvtier.storage.registry``), else over the lookup RPC
  (``kvtier.integrations.lookup_rpc``). One worker (tensor-parallel size 1).
- Server mode (``server`` set) keeps the tiers in a shared ``kvtier server``:
  both sides are clients of it under the engine id, so the worker's release
  ends the scheduler's lease, and a restarted engine keeps the cache.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier.config import KVTierConfig, load_config
from kvtier.index.keys import ChunkHasher
from kvtier.integrations.block_copy import load_blocks, save_blocks
from kvtier.integrations.lookup_rpc import LookupClient, LookupServer, socket_path
from kvtier.integrations.vllm_layout import namespace_from_vllm, paged_views, stacked_view
from kvtier.storage import registry
from kvtier.storage.backend import KVStore
from kvtier.storage.manager import LookupResult, RequestRecord, StorageManager

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.vllm")


# -- metadata: scheduler -> worker, one per step ------------------------------------
@dataclass
class ChunkCopy:
    """One chunk to move between a kvtier slot and engine blocks.

    ``block_ids`` are the engine blocks for the chunk's blocks ``offset ..
    blocks_per_chunk - 1`` (``offset > 0`` when vLLM already holds the first
    blocks of the chunk in its own prefix cache).
    """

    key: bytes
    block_ids: tuple[int, ...]
    offset: int = 0
    parent: bytes | None = None  # key of the previous chunk of the prompt


@dataclass
class TransferSpec:
    """All chunk copies of one request in one step, in prompt order."""

    req_id: str
    chunks: list[ChunkCopy]
    is_async: bool = False  # load on a worker thread, report through get_finished


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[TransferSpec] = field(default_factory=list)
    saves: list[TransferSpec] = field(default_factory=list)


# -- scheduler-side per-request state ----------------------------------------------
@dataclass
class _Tracker:
    req_id: str
    tokens: list[int]
    cache_salt: str | None
    keys: list[bytes]
    block_ids: list[int] = field(default_factory=list)
    saved_chunks: int = 0  # chunks [0, saved_chunks) are stored or known cached
    lookup: LookupResult | None = None
    pending_load: TransferSpec | None = None
    loaded_blocks: dict[int, int] = field(default_factory=dict)  # engine block id -> chunk index loaded
    load_async: bool = False  # the last lookup asked vLLM for an asynchronous load
    async_inflight: bool = False  # an async load was sent and its completion not yet seen


class KVTierConnector(KVConnectorBase_V1):
    """kvtier's vLLM v1 KV connector (embedded CPU + disk tiers)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.config: KVTierConfig = load_config(extra)
        if vllm_config.parallel_config.world_size > 1:
            raise ValueError(
                "kvtier embedded mode runs the tiers inside the engine-core process and needs "
                "tensor_parallel_size=1 (one worker in that process)"
            )
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            # vLLM's default ("fail") fails the whole request when a load fails; for a
            # cache a failed load is a miss, so the blocks are recomputed instead. The
            # scheduler reads this right after creating its connector (vLLM 0.32).
            try:
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
                log.info("kvtier: kv_load_failure_policy set to 'recompute' (a failed load is recomputed)")
            except Exception:  # a frozen config: say what the user must set
                log.warning(
                    "kvtier: set kv_transfer_config kv_load_failure_policy='recompute'; with 'fail' a "
                    "failed kvtier load fails the request instead of recomputing it"
                )
        self.namespace = namespace_from_vllm(vllm_config, self.config.chunk_size, self.config.model_id)
        self.block_size = self.namespace.layout.block_size
        self.chunk_size = self.namespace.chunk_size
        self.blocks_per_chunk = self.namespace.blocks_per_chunk
        self._engine_id = str(self._kv_transfer_config.engine_id or "default")
        self._hasher = ChunkHasher(self.namespace)
        # worker side: owns the tiers and serves lookups to a scheduler elsewhere
        self.manager: KVStore | None = None
        self._server: LookupServer | None = None
        self._layers: list[np.ndarray] = []
        self._kv: np.ndarray | list[np.ndarray] = []  # stacked view if possible, else _layers
        self._load_errors: set[int] = set()
        self._worker_lock = threading.Lock()  # guards the async-load sets below
        self._loader: ThreadPoolExecutor | None = None
        self._async_active: set[str] = set()  # submitted, completion not yet reported
        self._async_done: set[str] = set()  # finished, to report in get_finished
        self._finished_while_loading: set[str] = set()  # vLLM finished them mid-load
        self._failed_sync_loads: set[str] = set()  # requests whose load failed in this step
        # scheduler side: the worker's manager (same process) or an RPC stub
        self._async_to_send: list[TransferSpec] = []
        self._index: KVStore | LookupClient | None = None
        self._trackers: dict[str, _Tracker] = {}
        if self.config.enabled and role == KVConnectorRole.WORKER:
            if self.config.server:
                self.manager = self._service_client()
            else:
                self.manager = registry.acquire(
                    self._engine_id, lambda: StorageManager(self.config, self.namespace)
                )
                self._server = LookupServer(self.manager, socket_path(self._engine_id))
        log.info(
            "kvtier connector (%s) ready: model=%s layout=%s chunk=%d tokens (%d bytes)",
            role.name,
            self.namespace.model,
            self.namespace.layout,
            self.chunk_size,
            self.namespace.chunk_bytes,
        )

    # ================================ scheduler side ================================
    def _service_client(self) -> KVStore:
        """A client of the shared kvtier server, under this engine's id."""
        from kvtier.service.client import ServiceClient

        return ServiceClient(
            self.config.server,
            self.namespace,
            client_id=self._engine_id,
            timeout_s=self.config.server_timeout_s,
            token=self.config.server_token,
            wait_connected_s=min(5.0, 10 * self.config.server_timeout_s),
        )

    def _lookup_index(self) -> KVStore | LookupClient | None:
        """The server, the worker's manager in this process, or an RPC stub (resolved once)."""
        if self._index is None and self.config.enabled:
            if self.config.server:
                self._index = self._service_client()
                return self._index
            local = registry.get(self._engine_id)
            # The worker's lookup may include one remote existence call.
            timeout = self.config.lookup_timeout_s + (self.config.remote_timeout_s if self.config.remote_url else 0)
            self._index = local or LookupClient(socket_path(self._engine_id), self.chunk_size, timeout_s=timeout)
        return self._index

    def _release(self, req_id: str) -> None:
        index = self._lookup_index()
        if index is not None:
            index.release(req_id)

    def _tracker(self, request: "Request") -> _Tracker | None:
        tr = self._trackers.get(request.request_id)
        if tr is None:
            tokens = request.prompt_token_ids
            if tokens is None:  # prompt embeddings: nothing to key on
                return None
            tokens = list(tokens)
            keys = self._hasher.keys(tokens, request.cache_salt)
            tr = _Tracker(request.request_id, tokens, request.cache_salt, keys)
            self._trackers[request.request_id] = tr
        return tr

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        index = self._lookup_index()
        if index is None:
            return 0, False
        try:
            tr = self._tracker(request)
            if tr is None or not self.config.load:
                return 0, False
            # Never the whole prompt: the chunk holding the last token is left out.
            candidates = tr.keys[: max(0, (len(tr.tokens) - 1) // self.chunk_size)]
            if isinstance(index, LookupClient):
                res = index.lookup_keys(candidates, request.request_id, len(tr.tokens), num_computed_tokens)
            else:
                index.record_request(
                    request.request_id, RequestRecord(len(tr.tokens), engine_hit_tokens=num_computed_tokens)
                )
                res = index.lookup_keys(candidates, lease_owner=request.request_id)
            tr.lookup = res
            tr.saved_chunks = max(tr.saved_chunks, res.num_tokens // self.chunk_size)  # already stored
            if res.num_tokens <= num_computed_tokens:
                self._release(request.request_id)
                return 0, False
            first = num_computed_tokens // self.chunk_size
            tr.load_async = self.config.async_load and any(t != "cpu" for t in res.tiers[first:])
            return res.num_tokens - num_computed_tokens, tr.load_async
        except Exception:  # kvtier must never take the engine down: a failure is a miss
            log.exception("kvtier lookup failed; treating as a miss")
            self._release(request.request_id)
            return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        tr = self._trackers.get(request.request_id)
        if tr is None:
            return
        if num_external_tokens <= 0 or tr.lookup is None:
            self._release(request.request_id)
            return
        block_ids = blocks.get_block_ids()[0]
        hit = tr.lookup.num_tokens
        start = hit - num_external_tokens  # block-aligned local hit
        bpc, bs = self.blocks_per_chunk, self.block_size
        chunks = []
        for ci in range(start // self.chunk_size, hit // self.chunk_size):
            first = ci * bpc
            offset = max(0, start // bs - first)
            parent = tr.keys[ci - 1] if ci else None
            blocks_of_chunk = tuple(block_ids[first + offset : first + bpc])
            chunks.append(ChunkCopy(tr.keys[ci], blocks_of_chunk, offset, parent))
            tr.loaded_blocks.update((b, ci) for b in blocks_of_chunk)
        spec = TransferSpec(request.request_id, chunks, is_async=tr.load_async)
        if tr.load_async:
            # The request is not scheduled until the load completes: send it now.
            self._async_to_send.append(spec)
            tr.async_inflight = True
        else:
            tr.pending_load = spec
        tr.saved_chunks = max(tr.saved_chunks, hit // self.chunk_size)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVTierMetadata()
        if not self.config.enabled:
            return meta
        meta.loads.extend(self._async_to_send)
        self._async_to_send = []
        for preempted in scheduler_output.preempted_req_ids or ():
            tr = self._trackers.get(preempted)
            if tr is not None:  # its blocks are freed; it is looked up again on resume
                tr.block_ids = []
                tr.pending_load = None
                tr.loaded_blocks = {}
        for new in scheduler_output.scheduled_new_reqs:
            tr = self._trackers.get(new.req_id)
            if tr is None:
                continue
            tr.block_ids = list(new.block_ids[0]) if new.block_ids else []
            self._emit(tr, new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tr = self._trackers.get(req_id)
            if tr is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tr.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                tr.block_ids.extend(new_blocks[0])
            self._emit(
                tr, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0), meta
            )
        return meta

    def _emit(self, tr: _Tracker, computed_after_step: int, meta: KVTierMetadata) -> None:
        """Add this step's load and save work for one request to ``meta``."""
        if tr.pending_load is not None:
            meta.loads.append(tr.pending_load)
            tr.pending_load = None
        if not self.config.save:
            return
        full = min(computed_after_step, len(tr.tokens)) // self.chunk_size
        full = min(full, len(tr.keys), len(tr.block_ids) // self.blocks_per_chunk)
        if full <= tr.saved_chunks:
            return
        bpc = self.blocks_per_chunk
        chunks = [
            ChunkCopy(
                tr.keys[ci], tuple(tr.block_ids[ci * bpc : (ci + 1) * bpc]), parent=tr.keys[ci - 1] if ci else None
            )
            for ci in range(tr.saved_chunks, full)
        ]
        meta.saves.append(TransferSpec(tr.req_id, chunks))
        tr.saved_chunks = full

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_recving or ():
            tr = self._trackers.get(req_id)
            if tr is not None:
                tr.async_inflight = False
        invalid = connector_output.invalid_block_ids or ()
        if invalid:
            # vLLM recomputes from the first unfilled block; those chunks are not
            # stored anywhere after all, so save them once they are recomputed.
            for tr in self._trackers.values():
                failed = [tr.loaded_blocks[b] for b in invalid if b in tr.loaded_blocks]
                if failed:
                    tr.saved_chunks = min(tr.saved_chunks, min(failed))
                    tr.loaded_blocks = {b: c for b, c in tr.loaded_blocks.items() if c < min(failed)}

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        tr = self._trackers.pop(request.request_id, None)
        if tr is None:
            return False, None
        self._async_to_send = [s for s in self._async_to_send if s.req_id != request.request_id]
        if tr.lookup is not None and tr.lookup.keys:
            self._release(request.request_id)
        # An async load may still be writing into this request's blocks: keep them
        # until the worker reports the load over (as finished_sending).
        return tr.async_inflight, None

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
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

    # ================================= worker side ==================================
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        if self.manager is None:
            return
        try:
            self._layers = paged_views(kv_caches, self.namespace.layout)
            stacked = stacked_view(kv_caches, self.namespace.layout)
            self._kv = stacked if stacked is not None else self._layers
        except ValueError as exc:
            log.error("kvtier disabled: the engine's KV cache does not match the expected layout: %s", exc)
            self.shutdown()

    def _chunk_view(self, buf: np.ndarray) -> np.ndarray:
        """A slot as ``uint8 [num_layers, blocks_per_chunk, block_bytes]``."""
        return buf.reshape(len(self._layers), self.blocks_per_chunk, -1)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.manager is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVTierMetadata):
            return
        self._failed_sync_loads.clear()
        for spec in meta.loads:
            if spec.is_async:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")
                with self._worker_lock:
                    self._async_active.add(spec.req_id)
                self._loader.submit(self._load_async, spec)
                continue
            try:
                if not self._load_request(spec):
                    self._failed_sync_loads.add(spec.req_id)
            finally:
                self.manager.release(spec.req_id)

    def _load_async(self, spec: TransferSpec) -> None:
        try:
            self._load_request(spec)
        except Exception:  # _load_request already reports failed blocks
            log.exception("kvtier: async load for %s failed", spec.req_id)
        finally:
            if self.manager is not None:
                self.manager.release(spec.req_id)
            with self._worker_lock:
                self._async_done.add(spec.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Async loads that ended: ``(freed-after-abort ids, loaded ids)``.

        A request vLLM finished while its load ran is reported as "sending" (its
        blocks may be freed now); the others as "recving" (ready to schedule).
        """
        if self._async_active:
            # vLLM polls here in a tight loop while a request waits for its load; give
            # the GIL to the loader thread once per step, or each of its GIL hand-offs
            # (file reads, checksums, copies) waits out the 5 ms switch interval.
            time.sleep(0)
        with self._worker_lock:
            self._finished_while_loading |= finished_req_ids & self._async_active
            done, self._async_done = self._async_done, set()
            self._async_active -= done
            sending = done & self._finished_while_loading
            self._finished_while_loading -= sending
            recving = done - sending
        return (sending or None), (recving or None)

    def _load_request(self, spec: TransferSpec) -> bool:
        """Fill the request's planned blocks; False (blocks reported) if a chunk is unavailable.

        All chunks are opened in one call (remote hits come in one batched round
        trip, bounded by the remote timeout), then copied in prompt order.
        """
        try:
            handles = self.manager.open_read_many([(ch.key, ch.parent) for ch in spec.chunks])
        except Exception:
            log.exception("kvtier: opening %d chunks for %s failed", len(spec.chunks), spec.req_id)
            handles = [None] * len(spec.chunks)
        failed_at: int | None = None
        try:
            for i, (ch, handle) in enumerate(zip(spec.chunks, handles)):
                if handle is None:
                    failed_at = i
                    break
                try:
                    load_blocks(self._chunk_view(handle.buffer), self._kv, ch.block_ids, ch.offset)
                except Exception:
                    log.exception("kvtier: loading chunk %s failed", ch.key.hex()[:16])
                    failed_at = i
                    break
                self.manager.record_load(spec.req_id, handle.source, len(ch.block_ids) * self.block_size)
        finally:
            for handle in handles:
                if handle is not None:
                    handle.close()
        if failed_at is None:
            return True
        # Everything from this chunk on is unfilled: vLLM recomputes it.
        with self._worker_lock:
            for later in spec.chunks[failed_at:]:
                self._load_errors.update(later.block_ids)
        self.manager.record_load_failure()
        log.warning(
            "kvtier: request %s: chunk %d of %d unavailable, %d blocks reported for recompute",
            spec.req_id,
            failed_at,
            len(spec.chunks),
            sum(len(c.block_ids) for c in spec.chunks[failed_at:]),
        )
        return False

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the first layer runs

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole chunks are saved after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        if self.manager is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVTierMetadata):
            return
        for spec in meta.saves:
            if spec.req_id in self._failed_sync_loads:
                # This step's forward ran over unfilled blocks: what it computed
                # past them is wrong, so it is not stored (vLLM recomputes it).
                continue
            self._save_request(spec)

    def _save_request(self, spec: TransferSpec) -> None:
        """Store a request's newly computed chunks (slots reserved in one call).

        Stops at the first chunk that cannot be stored unless that chunk is already
        stored: later chunks of the prompt would be unreachable without it.
        """
        bufs = self.manager.open_write_many([ch.key for ch in spec.chunks])
        stop = False
        for ch, buf in zip(spec.chunks, bufs):
            if buf is None:
                if not stop and not self.manager.contains(ch.key):
                    stop = True  # no room (or a failure): drop the rest of the chain
                continue
            if stop:
                self.manager.abort(ch.key)
                continue
            try:
                save_blocks(self._kv, self._chunk_view(buf), ch.block_ids)
            except Exception:
                log.exception("kvtier: saving chunk %s failed", ch.key.hex()[:16])
                self.manager.abort(ch.key)
                stop = True
                continue
            self.manager.commit(ch.key, ch.parent)

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Errors of an async load are recorded before its id joins _async_done, so
        # they are reported no later than the pass that reports it finished.
        with self._worker_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.manager is not None:
            if isinstance(self.manager, StorageManager):
                registry.release(self.manager)
            else:
                self.manager.close()
            self.manager = None
        if self._index is not None and not isinstance(self._index, StorageManager):
            self._index.close()
        self._index = None


# -- inspection helpers for in-process engines (demo, tests) --------------------------
def request_hits(request_id: str) -> dict[str, Any] | None:
    """Where a finished request's prompt tokens came from, or None if unknown.

    Returns ``{"prompt_tokens", "engine_hit_tokens", "kvtier_hit_tokens", "tiers":
    {"cpu": tokens, "disk": tokens}}``. Only sees engines in this process.
    ``request_id`` may be the id given to vLLM; vLLM's internal id appends
    ``-<8 characters>`` to it, and the newest such record is returned.
    """
    for m in registry.active_managers():
        rec = m.requests.get(request_id)
        if rec is None:
            prefix = request_id + "-"
            for rid in reversed(m.requests):
                if rid.startswith(prefix) and len(rid) == len(prefix) + 8:
                    rec = m.requests[rid]
                    break
        if rec is not None:
            return {
                "prompt_tokens": rec.prompt_tokens,
                "engine_hit_tokens": rec.engine_hit_tokens,
                "kvtier_hit_tokens": rec.kvtier_hit_tokens,
                "tiers": dict(rec.tiers),
            }
    return None


def flush_all(timeout_s: float | None = 60.0) -> bool:
    """Wait for write-behind of every kvtier manager in this process."""
    return all(m.flush(timeout_s) for m in registry.active_managers())


def stats_all() -> list[dict[str, int | float]]:
    """``StorageManager.stats()`` of every manager in this process."""
    return [m.stats() for m in registry.active_managers()]
