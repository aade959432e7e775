"""Worker side of the connector: KV layout registration, sync and async loads, saves, shutdown.

Invariants:
- A load either fills every planned block or reports the unfilled ones (every
  block from the first unavailable chunk on) through
  ``get_block_ids_with_load_errors`` so vLLM recomputes them: never a short or
  silent wrong load. Errors of an async load are recorded before its id is
  reported finished, so they reach vLLM no later than that report.
- Every load ends its request's lease (``release``), whatever its outcome.
- No chunk computed over a block whose load failed is stored, whichever request
  computed it and whenever the scheduler side learns of the failure
  (:mod:`~kvtier.integrations.vllm.validity`): saves are cut before the first
  chunk whose request's blocks up to it may hold wrong KV.
- Blocks being filled by an asynchronous load are never freed under it: a
  request vLLM finished mid-load is reported in ``finished_sending`` only after
  the load ends (the scheduler side held its blocks).
- Saves stop a prompt's chain only where a later chunk would become unreachable:
  at ``NO_ROOM`` or a failed copy. A chunk already stored (``PRESENT``) or being
  written by another writer (``IN_FLIGHT``) does not stop it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.config import KVTierConfig
from kvtier.index.keys import KeyNamespace
from kvtier.integrations.block_copy import load_blocks, load_handle, load_handle_grouped, save_blocks, save_blocks_grouped
from kvtier.integrations.vllm.groups import KVGroups
from kvtier.integrations.vllm.kv_events import TierChanges, WorkerTierFeed
from kvtier.integrations.vllm.modes import close_worker_store, open_worker_store
from kvtier.integrations.vllm.pd import PDSettings
from kvtier.integrations.vllm.types import KVTierMetadata, KVTierWorkerMeta, TransferSpec
from kvtier.integrations.vllm.validity import BlockValidity
from kvtier.integrations.vllm_layout import paged_views, stacked_view
from kvtier.storage.backend import KVStore
from kvtier.storage.manager import StorageManager
from kvtier.storage.types import WriteSkip

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("kvtier.vllm")


class KVTierWorker:
    """The worker-role half of :class:`~kvtier.integrations.vllm.KVTierConnector` (owns the store).

    In embedded mode (the store is this process's :class:`StorageManager`):

    - ``kv_events``: its tier changes are handed to the scheduler side each step
      (:meth:`get_kv_cache_events`, :mod:`kvtier.integrations.vllm.kv_events`);
    - ``config.controller``: a :class:`~kvtier.fleet.agent.FleetAgent` (role
      ``"embedded"``) registers this instance with the controller; closed at shutdown.

    With a shared ``kvtier server`` the server does both itself.
    """

    #: Longest wait of an idle step for an async load to end (seconds); see :meth:`get_finished`.
    IDLE_WAIT_S = 0.025

    def __init__(self, config: KVTierConfig, namespace: KeyNamespace, engine_id: str, kv_events: bool = False,
                 pd: PDSettings | None = None, instance: str | None = None, groups: KVGroups | None = None):
        self.config = config
        # Hybrid models: each layer's blocks come from its KV cache group's table (groups.py)
        self.groups = groups if groups is not None else KVGroups(block_size=namespace.layout.block_size)
        self._layer_groups: list[int] = []
        self.namespace = namespace
        self.block_size = namespace.layout.block_size
        self.blocks_per_chunk = namespace.blocks_per_chunk
        self.store: KVStore | None = None
        self._lookup_server: Any = None
        self.tier_feed: WorkerTierFeed | None = None
        self.agent: Any = None  # kvtier.fleet.agent.FleetAgent with config.controller (embedded mode)
        if config.enabled:
            self.store, self._lookup_server = open_worker_store(config, namespace, engine_id, instance)
            self._start_fleet(kv_events)
        self._layers: list[np.ndarray] = []
        self._kv: np.ndarray | list[np.ndarray] = []  # stacked view if possible, else _layers
        self._load_errors: set[int] = set()
        self._validity = BlockValidity(self.block_size)  # blocks that may hold wrong KV (guarded by _lock)
        self._step_seen: KVTierMetadata | None = None  # the metadata whose block changes were applied
        self._step_reported_last: KVTierMetadata | None = None  # the last step echoed to the scheduler side
        self._lock = threading.Lock()  # guards the async-load sets, _load_errors and _validity
        self._load_ended = threading.Condition(self._lock)  # notified when an async load ends
        self._loader: ThreadPoolExecutor | None = None
        self._async_active: set[str] = set()  # submitted, completion not yet reported
        self._async_done: set[str] = set()  # finished, to report in get_finished
        self._finished_while_loading: set[str] = set()  # vLLM finished them mid-load
        self._failed_async: set[str] = set()  # hybrid models: async loads that failed, for failed_recving
        self._pd_orphans: set[str] = set()  # PD holds with no PD worker: reported once finished
        self._torch: Any = None  # gpu.steps.TorchSteps: torch copies, layer by layer (CUDA engines)
        self._torch_saving = False  # this step's saves were handed to _torch
        self.pd: Any = None  # pd_worker.PDWorker of a prefiller (PD holds and the confirm socket)
        if pd is not None and pd.prefills and self.store is not None:
            from kvtier.integrations.vllm.pd_worker import PDWorker

            self.pd = PDWorker(pd, engine_id, self.store)

    def _start_fleet(self, kv_events: bool) -> None:
        """The KV event feed and the fleet agent (embedded mode only; a failure disables them, never the engine)."""
        manager = self.store
        if not isinstance(manager, StorageManager):
            if kv_events or self.config.controller:
                log.info("kvtier: with a kvtier server, the server registers with the controller and publishes "
                         "its own tier events (kv_events_endpoint); the connector adds none")
            return
        if kv_events:
            self.tier_feed = WorkerTierFeed(manager)
        if self.config.controller:
            try:
                from kvtier.fleet.agent import FleetAgent, namespace_info, tier_infos
                from kvtier.protocol.trust import credentials_from_config
                from kvtier.storage.instance_ops import InstanceOps

                info = namespace_info(self.namespace)
                self.agent = FleetAgent(
                    self.config.controller, self.config.instance_id, "embedded",
                    {info.digest: (info, InstanceOps(manager))}, tier_infos(manager),
                    token=self.config.controller_token, credentials=credentials_from_config(self.config),
                    controller_key=self.config.controller_key,
                ).start()
                log.info("kvtier: registering with controller %s as %s", self.config.controller, self.agent.instance_id)
            except Exception:
                log.exception("kvtier: cannot start the fleet agent; running without the controller")
                self.agent = None

    def get_kv_cache_events(self) -> TierChanges | None:
        """This step's tier changes for the scheduler side (None if none or not enabled)."""
        return self.tier_feed.take() if self.tier_feed is not None else None

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"], torch_path: bool | None = None) -> None:
        """Map the engine's paged KV tensors (per layer) as numpy views; disable kvtier on a mismatch.

        KV on a non-CPU device (or ``torch_path=True``) takes the torch path instead
        (:mod:`kvtier.integrations.vllm.gpu`: layout read from vLLM, layer-wise copies on a copy stream).
        """
        if self.store is None:
            return
        try:
            if self.groups.multi:  # hybrid model: per-layer views, each copied with its group's block ids
                if torch_path or any(t.device.type != "cpu" for t in kv_caches.values()):
                    raise ValueError("hybrid models (several KV cache groups) are supported on CPU KV only")
                self._layers = paged_views(kv_caches, self.namespace.layout)
                self._kv = self._layers
                self._layer_groups = self.groups.groups_of(list(kv_caches))
                return
            if torch_path if torch_path is not None else any(t.device.type != "cpu" for t in kv_caches.values()):
                from kvtier.integrations.vllm.gpu.steps import torch_steps_for

                self._torch = torch_steps_for(kv_caches, self.namespace, self.store, self._report_load_errors)
                self._layers, self._kv = [], []  # numpy views are not used on this path
                return
            self._layers = paged_views(kv_caches, self.namespace.layout)
            stacked = stacked_view(kv_caches, self.namespace.layout)
            self._kv = stacked if stacked is not None else self._layers
        except ValueError as exc:
            log.error("kvtier disabled: the engine's KV cache does not match the expected layout: %s", exc)
            self.shutdown()

    def _chunk_view(self, buf: np.ndarray) -> np.ndarray:
        """A slot as ``uint8 [num_layers, blocks_per_chunk, block_bytes]``."""
        return buf.reshape(len(self._layers), self.blocks_per_chunk, -1)

    # -- block validity ------------------------------------------------------------------------
    def _begin_step(self, meta: KVTierMetadata) -> None:
        """Apply this step's block-table changes (once; vLLM may call the hooks in either order)."""
        if meta is self._step_seen:
            return
        self._step_seen = meta
        if meta.blocks is not None:
            with self._lock:
                self._validity.begin_step(meta.blocks)

    def _clean_saves(self, meta: KVTierMetadata) -> list[TransferSpec]:
        """This step's saves, less every chunk computed over a block that may hold wrong KV."""
        self._begin_step(meta)
        if meta.blocks is None or not meta.saves:
            return meta.saves
        with self._lock:
            return self._validity.clean(meta.saves)

    def build_worker_meta(self) -> KVTierWorkerMeta | None:
        """This step's number, once, for the scheduler side (None when nothing is saved)."""
        meta = self._step_seen
        if meta is None or meta is self._step_reported_last or meta.blocks is None:
            return None
        self._step_reported_last = meta
        return KVTierWorkerMeta((meta.step,))

    def mirrored_table(self, req_id: str) -> list[int] | None:
        """The block table of ``req_id`` as the validity check knows it (for tests)."""
        with self._lock:
            return self._validity.table(req_id)

    # -- loads ---------------------------------------------------------------------------------
    def start_load_kv(self, meta: KVTierMetadata) -> None:
        """Run this step's sync loads; submit its async loads to the loader thread."""
        if self.store is None:
            return
        self._begin_step(meta)
        if self._torch is not None:  # sync loads: issued layer by layer, finished by wait_for_save
            sync = [s for s in meta.loads if not s.is_async]
            with self._lock:  # failures reported by begin_loads mark their blocks bad again
                self._validity.loaded(b for s in sync for ch in s.chunks for b in ch.block_ids)
            self._torch.begin_loads(sync)
        for spec in meta.loads:
            if spec.is_async:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")
                with self._lock:
                    self._async_active.add(spec.req_id)
                self._loader.submit(self._load_async, spec)
                continue
            if self._torch is not None:
                continue
            try:
                self._load_request(spec)
            finally:
                self.store.release(spec.req_id)

    def _load_async(self, spec: TransferSpec) -> None:
        try:
            self._load_request(spec)
        except Exception:  # _load_request already reports failed blocks
            log.exception("kvtier: async load for %s failed", spec.req_id)
        finally:
            if self.store is not None:
                self.store.release(spec.req_id)
            with self._lock:
                self._async_done.add(spec.req_id)
                self._load_ended.notify_all()

    def get_finished(self, finished_req_ids: set[str], idle: bool = False) -> tuple[set[str] | None, set[str] | None]:
        """Async loads that ended: ``(freed-after-finish ids, loaded ids)``.

        A request vLLM finished while its load ran is reported as "sending" (its
        blocks may be freed now); the others as "recving" (ready to schedule).

        ``idle``: this step scheduled no tokens (the engine is only waiting for loads,
        or, on a PD prefiller, for decoders' confirms). Then, while a load runs and
        none has ended, this call blocks up to ``IDLE_WAIT_S`` seconds for one to end:
        the engine has nothing else to do, and its idle loop would otherwise hold the
        GIL (and, with one pinned core, the CPU) that the loader thread needs,
        stretching a 10 ms load to 100+ ms and adding a step's latency before vLLM
        hears of it. Likewise a prefiller holding finished requests blocks up to
        ``IDLE_WAIT_S`` for a confirm instead of spinning steps. A step with work never waits.
        """
        if self._async_active:
            # vLLM polls here in a tight loop while a request waits for its load; give
            # the GIL to the loader thread once per step, or each of its GIL hand-offs
            # (file reads, checksums, copies) waits out the 5 ms switch interval.
            time.sleep(0)
        with self._lock:
            if idle and self._async_active and not self._async_done:
                self._load_ended.wait(self.IDLE_WAIT_S)
            self._finished_while_loading |= finished_req_ids & self._async_active
            done, self._async_done = self._async_done, set()
            self._async_active -= done
            sending = done & self._finished_while_loading
            self._finished_while_loading -= sending
            recving = done - sending
        if self.pd is not None:
            if idle and not finished_req_ids and not self._async_active and self.pd.waiting_for_confirms():
                # A prefiller with nothing to run but finished requests it holds for their
                # decoders: vLLM would spin steps (1 ms sleeps) on its core until the
                # confirms arrive; wait for one instead (bounded, as for loads above).
                self.pd.wait_for_confirm(self.IDLE_WAIT_S)
            sending |= self.pd.finished_sending(finished_req_ids)
        if self._pd_orphans & finished_req_ids:
            sending |= self._pd_orphans & finished_req_ids
            self._pd_orphans -= finished_req_ids
        return (sending or None), (recving or None)

    def _load_request(self, spec: TransferSpec) -> bool:
        """Fill the request's planned blocks; False (blocks reported) if a chunk is unavailable.

        All chunks are opened in one call (remote hits come in one batched round
        trip, bounded by the remote timeout), then copied in prompt order.
        """
        assert self.store is not None
        try:
            handles = self.store.open_read_many([(ch.key, ch.parent) for ch in spec.chunks])
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
                    if self._torch is not None:
                        self._torch.copy_chunk_in(handle.buffer, tuple(ch.block_ids), ch.offset)
                    elif self.groups.multi:
                        load_handle_grouped(handle, self._chunk_view, self._layers, self._layer_groups,
                                            (ch.block_ids, *ch.more_blocks), ch.offset, skip=-1)
                    else:
                        load_handle(handle, self._chunk_view, self._kv, ch.block_ids, ch.offset)
                except Exception:
                    log.exception("kvtier: loading chunk %s failed", ch.key.hex()[:16])
                    failed_at = i
                    break
        finally:
            for handle in handles:
                if handle is not None:
                    handle.close()
        filled = spec.chunks if failed_at is None else spec.chunks[:failed_at]
        with self._lock:
            self._validity.loaded(b for ch in filled for b in ch.block_ids)
            if failed_at is not None:
                # Everything from this chunk on is unfilled: vLLM recomputes it.
                if self.groups.multi:
                    # vLLM 0.32 cannot map block ids back to requests with several KV cache groups
                    # (it raises): the request is reported in failed_recving and recomputed whole.
                    self._failed_async.add(spec.req_id)
                for later in spec.chunks[failed_at:]:
                    if not self.groups.multi:
                        self._load_errors.update(later.block_ids)
                    self._validity.load_failed(later.block_ids)
        if failed_at is None:
            return True
        log.warning(
            "kvtier: request %s: chunk %d of %d unavailable, %d blocks reported for recompute",
            spec.req_id,
            failed_at,
            len(spec.chunks),
            sum(len(c.block_ids) for c in spec.chunks[failed_at:]),
        )
        return False

    def _report_load_errors(self, block_ids: Any) -> None:
        blocks = list(block_ids)
        with self._lock:
            self._load_errors.update(blocks)
            self._validity.load_failed(blocks)

    @property
    def layerwise(self) -> bool:
        """True when the KV is copied layer by layer (the torch/CUDA path)."""
        return self._torch is not None

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Torch path: order the layer's attention after its load copies (else a no-op)."""
        if self._torch is not None:
            self._torch.wait_for_layer_load(layer_name)

    def save_kv_layer(self, meta: KVTierMetadata | None, layer_name: str) -> None:
        """Torch path: copy this layer's blocks of this step's saves (else a no-op; saves run in wait_for_save)."""
        if self._torch is None or meta is None:
            return
        if not self._torch_saving:
            self._torch_saving = True
            self._torch.set_saves(self._clean_saves(meta))
        self._torch.save_layer(layer_name)

    def take_failed_recving(self, recving: set[str] | None, sending: set[str] | None = None) -> set[str]:
        """Hybrid models: of the async loads reported finished (``recving``), those that failed
        (vLLM's ``KVConnectorTransferResults.failed_recving``); empty with one KV cache group.
        A request finished mid-load (reported in ``sending``) is included: vLLM ignores it (it is
        not waiting), the scheduler side settles its accounting."""
        done = set(recving or ()) | set(sending or ())
        if not done:
            return set()
        with self._lock:
            failed = self._failed_async & done  # a finished request's: only kvtier's accounting reads it
            self._failed_async -= done
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves ---------------------------------------------------------------------------------
    def wait_for_save(self, meta: KVTierMetadata) -> None:
        """Store this step's newly computed chunks (after the forward pass)."""
        if self.pd is None and meta.pd_holds:  # no PD worker (kvtier disabled): free them when finished
            self._pd_orphans.update(h.req_id for h in meta.pd_holds)
        if self.store is None:
            return
        if self._torch is not None:
            self._torch.end_loads()
            if not self._torch_saving:
                self._torch.set_saves(self._clean_saves(meta))
            self._torch_saving = False
            self._torch.end_saves()
        # Chunks computed over a failed load (by any request, in this step or since)
        # are not stored: vLLM recomputes them and the scheduler side saves them then.
        for spec in self._clean_saves(meta) if self._torch is None else ():
            self._save_request(spec)
        if self.pd is not None and (meta.pd_holds or meta.pd_releases):
            self.pd.on_step(meta.pd_holds, meta.pd_releases)

    def _save_request(self, spec: TransferSpec) -> None:
        """Store a request's newly computed chunks (slots reserved in one call).

        Goes on past chunks already stored or being written by another writer
        (the chain stays reachable); stops at ``NO_ROOM`` or a failed copy,
        aborting the reservations after it (later chunks would be unreachable).
        """
        assert self.store is not None
        bufs = self.store.open_write_many([ch.key for ch in spec.chunks], [ch.parent for ch in spec.chunks])
        stop = False
        for ch, buf in zip(spec.chunks, bufs):
            if not isinstance(buf, np.ndarray):
                if not stop and not self._skip_keeps_chain(buf):
                    stop = True  # no room (or a failure): drop the rest of the chain
                continue
            if stop:
                self.store.abort(ch.key)
                continue
            try:
                if self.groups.multi:
                    save_blocks_grouped(self._layers, self._layer_groups, self._chunk_view(buf),
                                        (ch.block_ids, *ch.more_blocks))
                else:
                    save_blocks(self._kv, self._chunk_view(buf), ch.block_ids)
            except Exception:
                log.exception("kvtier: saving chunk %s failed", ch.key.hex()[:16])
                self.store.abort(ch.key)
                stop = True
                continue
            self.store.commit(ch.key, ch.parent)

    @staticmethod
    def _skip_keeps_chain(skip: WriteSkip) -> bool:
        """True if the chunk ``open_write_many`` skipped stays reachable without this writer:
        stored already, or another writer's reservation (it commits or aborts it)."""
        return skip in (WriteSkip.PRESENT, WriteSkip.IN_FLIGHT)

    def shutdown(self) -> None:
        if self.pd is not None:
            self.pd.close()
            self.pd = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        if self.tier_feed is not None:
            self.tier_feed.close()
            self.tier_feed = None
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        if self._torch is not None and self.store is not None:
            self._torch.close()
        if self.store is not None:
            store, self.store = self.store, None
            close_worker_store(store, self._lookup_server)
            self._lookup_server = None
            log.info("kvtier: worker shut down (write-behind flushed, tiers closed)")
