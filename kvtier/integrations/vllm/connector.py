"""``KVTierConnector``: the thin facade vLLM instantiates; delegates to the scheduler or worker half.

vLLM builds one connector per role: ``SCHEDULER`` (in the engine core's
scheduler) and ``WORKER`` (in each model worker). Each instance creates only
its half: :class:`~kvtier.integrations.vllm.scheduler.KVTierScheduler` or
:class:`~kvtier.integrations.vllm.worker.KVTierWorker`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvtier.config import KVTierConfig, load_config
from kvtier.config_lmcache import lmcache_connector_settings
from kvtier.integrations.vllm.extras import check_engine_extra_keys
from kvtier.integrations.vllm.failure_policy import log_failure_policy
from kvtier.integrations.vllm.groups import kv_groups
from kvtier.integrations.vllm.kv_events import group_specs, kv_events_enabled
from kvtier.integrations.vllm.pd import PD_KEYS, PDSettings
from kvtier.integrations.vllm.modes import engine_instance
from kvtier.integrations.vllm.metrics import KVTierConnectorStats, KVTierPromMetrics, counter_delta, ledger_counters
from kvtier.integrations.vllm.scheduler import KVTierScheduler
from kvtier.integrations.vllm.types import KVTierMetadata
from kvtier.integrations.vllm.worker import KVTierWorker
from kvtier.integrations.vllm_layout import namespace_from_vllm

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.vllm")


def _ensure_log_handler(level: str) -> None:
    """Set kvtier's log level; give its logger a stderr handler when nothing would print it.

    vLLM configures only its own ``vllm`` logger, so in ``vllm serve`` (or any process
    without logging set up) kvtier's INFO lines would be dropped. A handler set up by
    the application (on ``kvtier`` or the root logger) is left alone.
    """
    logger = logging.getLogger("kvtier")
    logger.setLevel(level)
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvtier] %(message)s", "%m-%d %H:%M:%S"))
    logger.addHandler(handler)


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """kvtier's vLLM v1 KV connector (CPU tier plus lower tiers, embedded or in a shared server).

    Supports vLLM's hybrid KV cache manager (``SupportsHMA``): models with full-attention and
    sliding-window KV cache groups keep it on, and a hit restores every group exactly
    (:mod:`kvtier.integrations.vllm.groups`).

    Raises:
        ValueError: tensor-parallel size > 1 in embedded mode, the engine keys its blocks on an
            input kvtier cannot key (see ``extras.check_engine_extra_keys``), or a KV cache
            group kvtier cannot restore (Mamba / linear attention state; PD or CUDA KV with
            several groups).
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        role_name = getattr(self._kv_transfer_config, "kv_role", None)
        if role_name in ("kv_both", "kv_producer", "kv_consumer"):
            # vLLM's kv_role gates kvtier too: a producer only saves, a consumer only loads.
            extra.setdefault("kv_role", role_name)
        pd_extra = {k: extra.pop(k) for k in PD_KEYS if k in extra}  # PD keys (pd.py) are not kvtier config keys
        self.config: KVTierConfig = load_config(extra)
        if self.config.lmcache_config_file is not None and "pd_role" not in pd_extra:
            # An LMCache PD config (enable_pd + pd_role) gives the role; the connector's own keys win.
            pd_extra = {**lmcache_connector_settings(self.config.lmcache_config_file), **pd_extra}
        self.pd = PDSettings.pop_from(pd_extra)
        _ensure_log_handler(self.config.log_level)
        if vllm_config.parallel_config.world_size > 1:
            raise ValueError(
                "kvtier embedded mode runs the tiers inside the engine-core process and needs "
                "tensor_parallel_size=1 (one worker in that process)"
            )
        check_engine_extra_keys()
        self.namespace = namespace_from_vllm(vllm_config, self.config.chunk_size, self.config.model_id)
        self.chunk_size = self.namespace.chunk_size
        self.groups = kv_groups(kv_cache_config, self.namespace.layout.block_size)
        if self.groups.multi and self.pd.role != "off":
            raise ValueError("kvtier: PD (pd_role) is not supported for hybrid models (several KV cache groups)")
        engine_id = str(self._kv_transfer_config.engine_id or "default")
        self.scheduler: KVTierScheduler | None = None
        self.worker: KVTierWorker | None = None
        self._reported = ledger_counters({}, {}, 0)  # ledger counters already sent as stats
        kv_events = kv_events_enabled(vllm_config)  # kvtier's tier changes go to vLLM's KV event publisher
        instance = engine_instance(engine_id, vllm_config)  # both sides of this engine, no other engine
        if role == KVConnectorRole.WORKER:
            self.worker = KVTierWorker(self.config, self.namespace, engine_id, kv_events=kv_events, pd=self.pd,
                                       instance=instance, groups=self.groups)
        else:
            self.scheduler = KVTierScheduler(self.config, self.namespace, engine_id, kv_events=kv_events, pd=self.pd,
                                             instance=instance, event_groups=group_specs(kv_cache_config),
                                             groups=self.groups)
        if role == KVConnectorRole.SCHEDULER:
            log_failure_policy(self._kv_transfer_config)
        log.info(
            "kvtier connector (%s) ready: model=%s layout=%s chunk=%d tokens (%d bytes)",
            role.name,
            self.namespace.model,
            self.namespace.layout,
            self.chunk_size,
            self.namespace.chunk_bytes,
        )

    @property
    def requires_kv_delivery(self) -> bool:
        """False: kvtier is a best-effort cache (a save that does not happen is a later miss), so a
        request vLLM preempts under async scheduling keeps its in-flight output (vLLM's base class
        says so for caches; its CPU offload connectors answer False too)."""
        return False

    @property
    def manager(self) -> Any:
        """The worker side's store (None on the scheduler side or when disabled)."""
        return self.worker.store if self.worker is not None else None

    # ================================ scheduler side ================================
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(connector_output)
        invalid = connector_output.invalid_block_ids
        manager = getattr(self, "_kv_cache_manager", None)
        if invalid and manager is not None:
            # Under the recompute policy vLLM keeps blocks that failed to load in its
            # prefix cache for the request that recomputes them; if that request ends
            # first (aborted), a later request would take the unfilled blocks as a
            # local hit and compute over them. Take them out of the prefix cache: the
            # requests holding them keep them; anyone else misses (kvtier may hit).
            try:
                manager.evict_blocks(set(invalid))
            except Exception:  # never take the engine down
                log.exception("kvtier: evicting %d blocks that failed to load from the prefix cache failed",
                              len(invalid))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: the request finished in every KV cache group (kvtier keeps every group's
        blocks together: an async load still writing into them holds them all)."""
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, list(block_ids[0]) if block_ids else [])

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """Learn the null block's id (vLLM fills sliding-window slots out of the window with it)."""
        null = getattr(getattr(gpu_block_pool, "null_block", None), "block_id", None)
        if self.scheduler is not None and isinstance(null, int):
            self.scheduler.null_block = null

    def reset_cache(self) -> bool:
        """Clear this engine's namespace in every tier it owns, or answer False (see
        :meth:`KVTierScheduler.reset_cache`; the worker side has nothing to reset)."""
        return self.scheduler.reset_cache() if self.scheduler is not None else True

    def has_pending_block_frees(self) -> bool:
        """True while kvtier holds blocks of requests finished (aborted) mid-load (see the scheduler side)."""
        return self.scheduler is not None and self.scheduler.has_pending_block_frees()

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict[CacheHitSource, int]:
        assert self.scheduler is not None
        return self.scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def get_kv_connector_stats(self) -> KVTierConnectorStats | None:
        """Scheduler side: the ledger's hit/failure counts since the last call (None if unchanged).

        vLLM 0.32 calls this after every step and ships the data to ``/metrics``
        (:class:`~kvtier.integrations.vllm.metrics.KVTierPromMetrics`).
        """
        if self.scheduler is None:
            return None
        now = ledger_counters(*self.scheduler.ledger.counters())
        delta = counter_delta(now, self._reported)
        self._reported = now
        stats = KVTierConnectorStats(data=delta)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierConnectorStats:
        return KVTierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVTierPromMetrics:
        """The ``kvtier:*`` series of vLLM's ``/metrics`` (see :mod:`kvtier.integrations.vllm.metrics`)."""
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_events(self) -> Iterable["KVCacheEvent"]:
        """kvtier's tier changes since the last call as vLLM KV events (media CPU/STORAGE, see kv_events)."""
        return self.scheduler.take_events() if self.scheduler is not None else ()

    def check_invariants(self) -> None:
        """Assert the scheduler side's request-state invariants (no-op on the worker side)."""
        if self.scheduler is not None:
            self.scheduler.check_invariants()

    # ================================= worker side ==================================
    def _step_meta(self) -> KVTierMetadata | None:
        if self.worker is None or not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KVTierMetadata) else None

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        if self.worker is not None:
            self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._step_meta()
        if meta is not None:
            self.worker.start_load_kv(meta)  # type: ignore[union-attr]

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: CUDA KV is loaded and saved layer by layer (``wait_for_layer_load`` /
        ``save_kv_layer``), which full CUDA graph replay would skip (vLLM then uses PIECEWISE)."""
        return True

    def wait_for_layer_load(self, layer_name: str) -> None:
        # CPU KV: loads complete in start_load_kv. CUDA KV: waits for this layer's copies only.
        if self.worker is not None and self.worker.layerwise:
            self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        # CPU KV: whole chunks are saved in wait_for_save. CUDA KV: this layer's copies start now.
        if self.worker is not None and self.worker.layerwise:
            self.worker.save_kv_layer(self._step_meta(), layer_name)

    def wait_for_save(self) -> None:
        meta = self._step_meta()
        if meta is not None:
            self.worker.wait_for_save(meta)  # type: ignore[union-attr]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        meta = self._step_meta()
        return self.worker.get_finished(finished_req_ids, idle=meta is not None and meta.idle)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """``get_finished`` plus, for hybrid models, the async loads that failed (``failed_recving``:
        vLLM 0.32 takes no block-level errors with several KV cache groups)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        sending, recving = self.get_finished(finished_req_ids)
        failed = self.worker.take_failed_recving(recving, sending) if self.worker is not None else set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> Any:
        """The step this output reports (the scheduler side matches failures to steps by it)."""
        return self.worker.build_worker_meta() if self.worker is not None else None

    def get_kv_connector_kv_cache_events(self) -> Any:
        """This step's tier changes (kvtier keys + tier), carried to the scheduler side by vLLM."""
        return self.worker.get_kv_cache_events() if self.worker is not None else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
