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
)

from kvtier.config import KVTierConfig, load_config
from kvtier.config_lmcache import lmcache_connector_settings
from kvtier.integrations.vllm.extras import check_engine_extra_keys
from kvtier.integrations.vllm.kv_events import kv_events_enabled
from kvtier.integrations.vllm.pd import PD_KEYS, PDSettings
from kvtier.integrations.vllm.metrics import KVTierConnectorStats, KVTierPromMetrics, counter_delta, ledger_counters
from kvtier.integrations.vllm.scheduler import KVTierScheduler
from kvtier.integrations.vllm.types import KVTierMetadata
from kvtier.integrations.vllm.worker import KVTierWorker
from kvtier.integrations.vllm_layout import namespace_from_vllm

if TYPE_CHECKING:  # pragma: no cover
    import torch
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


class KVTierConnector(KVConnectorBase_V1):
    """kvtier's vLLM v1 KV connector (CPU tier plus lower tiers, embedded or in a shared server).

    Raises:
        ValueError: tensor-parallel size > 1 in embedded mode, or the engine keys its
            blocks on an input kvtier cannot key (see ``extras.check_engine_extra_keys``).
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
        self._force_recompute_policy()
        self.namespace = namespace_from_vllm(vllm_config, self.config.chunk_size, self.config.model_id)
        self.chunk_size = self.namespace.chunk_size
        engine_id = str(self._kv_transfer_config.engine_id or "default")
        self.scheduler: KVTierScheduler | None = None
        self.worker: KVTierWorker | None = None
        self._reported = ledger_counters({}, {}, 0)  # ledger counters already sent as stats
        kv_events = kv_events_enabled(vllm_config)  # kvtier's tier changes go to vLLM's KV event publisher
        if role == KVConnectorRole.WORKER:
            self.worker = KVTierWorker(self.config, self.namespace, engine_id, kv_events=kv_events, pd=self.pd)
        else:
            self.scheduler = KVTierScheduler(self.config, self.namespace, engine_id, kv_events=kv_events, pd=self.pd)
        log.info(
            "kvtier connector (%s) ready: model=%s layout=%s chunk=%d tokens (%d bytes)",
            role.name,
            self.namespace.model,
            self.namespace.layout,
            self.chunk_size,
            self.namespace.chunk_bytes,
        )

    def _force_recompute_policy(self) -> None:
        """vLLM's default ("fail") fails the whole request when a load fails; for a cache a
        failed load is a miss, so the blocks are recomputed instead. The scheduler reads this
        right after creating its connector (vLLM 0.32)."""
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") == "recompute":
            return
        try:
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
            log.info("kvtier: kv_load_failure_policy set to 'recompute' (a failed load is recomputed)")
        except Exception:  # a frozen config: say what the user must set
            log.warning(
                "kvtier: set kv_transfer_config kv_load_failure_policy='recompute'; with 'fail' a "
                "failed kvtier load fails the request instead of recomputing it"
            )

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

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
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
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVTierPromMetrics:
        """The ``kvtier:*`` series of vLLM's ``/metrics`` (see :mod:`kvtier.integrations.vllm.metrics`)."""
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_events(self) -> Iterable["KVCacheEvent"]:
        """kvtier's tier changes since the last call as vLLM KV events (medium CPU/DISK/REMOTE)."""
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

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors() if self.worker is not None else set()

    def get_kv_connector_kv_cache_events(self) -> Any:
        """This step's tier changes (kvtier keys + tier), carried to the scheduler side by vLLM."""
        return self.worker.get_kv_cache_events() if self.worker is not None else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
