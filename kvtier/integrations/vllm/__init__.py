"""vLLM v1 KV connector: ``KVTierConnector``.

Load it with::

    LLM(model, kv_transfer_config={
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",  # a failed load is recomputed (vLLM's default "fail" errors)
        "kv_connector_extra_config": {"cpu_capacity": "4GiB", "disk_path": "/var/cache/kvtier"},
    })

Modules (the shape of vLLM's ``OffloadingConnector``):

- ``connector``: the facade vLLM instantiates, one per role, delegating every hook;
- ``scheduler``: request state, lookup and lease, per-step load and save planning,
  preemption, async-load bookkeeping, invalid blocks, request accounting;
- ``worker``: KV layout registration, sync and async loads, saves, load errors;
- ``types``: metadata value types (leaf); ``modes``: where the tiers live
  (embedded, in-process direct, RPC, kvtier server); ``extras``: LoRA and
  multimodal key inputs; ``accounting``: per-request hit records;
  ``inspection``: helpers for in-process engines (``request_hits``, ``flush_all``,
  ``stats_all``); ``groups``: KV cache groups of hybrid models (``SupportsHMA``);
  ``reset``: what ``reset_cache`` may clear; ``failure_policy``: what a failed load
  does under vLLM's ``kv_load_failure_policy``; ``kv_events``: tier changes as vLLM KV events.

Scheduler side: looks up the longest cached prefix of each new prompt beyond
what vLLM's own prefix cache holds, leases those chunks, and after block
allocation plans which chunks to load into which blocks and which newly
computed full prompt chunks to save. Worker side: loads planned chunks before
the forward pass (chunks held only by a lower tier asynchronously, while the
request waits in WAITING_FOR_REMOTE_KVS) and saves planned chunks after it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.integrations.vllm.connector import KVTierConnector as KVTierConnector
    from kvtier.integrations.vllm.inspection import flush_all as flush_all
    from kvtier.integrations.vllm.inspection import request_hits as request_hits
    from kvtier.integrations.vllm.inspection import stats_all as stats_all
    from kvtier.integrations.vllm.types import ChunkCopy as ChunkCopy
    from kvtier.integrations.vllm.types import KVTierMetadata as KVTierMetadata
    from kvtier.integrations.vllm.types import RequestHits as RequestHits
    from kvtier.integrations.vllm.types import TransferSpec as TransferSpec

#: public name -> defining module. Imported on first access (PEP 562), so that
#: ``kvtier.integrations.vllm.gpu`` (the paged-KV copy path, which needs only torch) imports on a
#: machine without vLLM; vLLM's ``kv_connector_module_path`` loader does ``getattr(module, name)``,
#: which resolves here.
_EXPORTS = {
    "KVTierConnector": "kvtier.integrations.vllm.connector",
    "flush_all": "kvtier.integrations.vllm.inspection",
    "request_hits": "kvtier.integrations.vllm.inspection",
    "stats_all": "kvtier.integrations.vllm.inspection",
    "ChunkCopy": "kvtier.integrations.vllm.types",
    "KVTierMetadata": "kvtier.integrations.vllm.types",
    "RequestHits": "kvtier.integrations.vllm.types",
    "TransferSpec": "kvtier.integrations.vllm.types",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip this hook
    return value
