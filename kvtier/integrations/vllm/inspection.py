"""Inspection helpers for engines running in this process (demo, tests, benchmarks)."""

from __future__ import annotations

from typing import Any

from kvtier.integrations.vllm.accounting import active_ledgers
from kvtier.storage import registry


def request_hits(request_id: str) -> dict[str, Any] | None:
    """Where a finished request's prompt tokens came from, or None if unknown.

    Returns ``{"prompt_tokens", "engine_hit_tokens", "kvtier_hit_tokens",
    "computed_tokens", "tiers": {"cpu": tokens, "disk": tokens, ...}, "load_failures"}``
    (tokens). Only sees scheduler-side connectors in this process (an in-process
    engine core: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). ``request_id`` may be the
    id given to vLLM; vLLM's internal id appends ``-<8 characters>`` to it, and the
    newest such record is returned.
    """
    for ledger in active_ledgers():
        rec = ledger.get(request_id)
        if rec is not None:
            return rec.to_dict()
    return None


def flush_all(timeout_s: float | None = 60.0) -> bool:
    """Wait for write-behind of every embedded kvtier manager in this process."""
    return all(m.flush(timeout_s) for m in registry.active_managers())


def stats_all() -> list[dict[str, int | float]]:
    """``StorageManager.stats()`` of every embedded manager in this process."""
    return [m.stats() for m in registry.active_managers()]
