"""``reset_cache``: what a connector may clear when vLLM resets its prefix cache with the connector's.

vLLM 0.32 calls ``connector.reset_cache()`` from ``Scheduler.reset_prefix_cache(reset_connector=True)``
(``LLM.reset_prefix_cache(reset_connector=True)``, ``POST /reset_prefix_cache?reset_external=true``,
and ``pause_generation(clear_cache=True)``, which raises if the answer is False).

Decision: an engine clears its own model namespace in the tiers it owns, the embedded CPU and
disk tiers. A tier other engines use (a remote tier, a ``kvtier server``) is cleared only with
``reset_shared`` (this model's chunks, for every engine using them); peers are other instances'
caches and are never cleared. When a tier that would still serve this engine's hits is left, the
answer is False and nothing is cleared: a partial clear keeps the hits and only costs the next
requests their local copies.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from kvtier.config import KVTierConfig, mask_url

log = logging.getLogger("kvtier.vllm")


def shared_tiers(config: KVTierConfig) -> list[str]:
    """Tiers holding this engine's chunks that ``reset_cache`` must leave (named for the log)."""
    out = [f"peer {p}" for p in config.peers]
    if config.peer_discovery:
        out.append(f"peers named by {config.peer_discovery}")
    if not config.reset_shared:
        if config.server:
            out.append(f"the kvtier server {config.server}")
        if config.remote_url:
            out.append(f"the remote tier {mask_url(config.remote_url)}")
    return out


def reset_tiers(config: KVTierConfig, index_of: Callable[[], Any]) -> bool:
    """Clear the namespace through the scheduler side's index (``index_of()``: the in-process
    manager, the lookup endpoint's client, or the kvtier server's), unless :func:`shared_tiers`
    names one. Never raises.

    Returns:
        True when every tier that could serve a hit was cleared; False otherwise (logged).
    """
    shared = shared_tiers(config)
    if shared:
        log.warning("kvtier: reset_cache refused, nothing cleared: %s would still serve this engine's chunks "
                    "(set reset_shared to clear a remote tier or kvtier server too; peers are other "
                    "instances' caches)", ", ".join(shared))
        return False
    try:
        index = index_of()
        removed = index.clear() if index is not None else None
    except Exception:  # kvtier must never take the engine down
        log.exception("kvtier: reset_cache failed")
        return False
    if not removed:  # None (lookup endpoint) or {} (kvtier server): the call failed; a clear names "cpu"
        log.warning("kvtier: reset_cache: the tiers did not answer; nothing is known cleared")
        return False
    log.info("kvtier: reset_cache cleared %s", ", ".join(f"{t}: {n} chunks" for t, n in removed.items()))
    return True
