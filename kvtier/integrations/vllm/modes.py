"""Where the connector's tiers live, and how each side reaches them (mode selection).

- **embedded** (default): the worker side owns a :class:`StorageManager`
  (registered by engine id in ``kvtier.storage.registry``) and serves lookups
  to a scheduler side elsewhere on a Unix socket.
- **in-process direct**: the scheduler side shares the worker's process (vLLM's
  in-process engine core) and calls its manager directly.
- **RPC**: the scheduler side runs in another process and reaches the worker's
  manager through the lookup endpoint (``kvtier.service.lookup_endpoint``: the
  service protocol's messages; keys only, never payloads).
- **server** (``server`` set): both sides are clients of a shared ``kvtier
  server`` under the engine id, so the worker's release ends the scheduler's
  lease and a restarted engine keeps the cache.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from kvtier.config import KVTierConfig
from kvtier.index.keys import KeyNamespace
from kvtier.service.lookup_endpoint import LookupClient, LookupServer, socket_path
from kvtier.storage import registry
from kvtier.storage.backend import KVStore
from kvtier.storage.manager import StorageManager
from kvtier.transfer.assembly import open_manager
from kvtier.storage.types import LookupResult


class LookupIndex(Protocol):
    """What the scheduler side needs of the tiers: lookup with a lease, and release."""

    def lookup_keys(self, keys: Sequence[bytes], lease_owner: str | None) -> LookupResult: ...

    def release(self, lease_owner: str) -> None: ...

    def clear(self) -> dict[str, int] | None:
        """Remove this namespace's chunks from every tier; chunks removed per tier (None: failed)."""
        ...

    def close(self) -> None: ...


def engine_instance(engine_id: str, vllm_config: Any) -> str:
    """The name of one engine instance: what its scheduler and worker sides both know, and no
    other engine shares.

    vLLM's ``engine_id`` alone is not enough: two engines may be given the same id (or ids a
    file name would make equal). Added: vLLM's per-config ``instance_id`` (a nanosecond clock
    reading, copied to the engine's worker processes with the config) and the data-parallel
    rank (DP engines share one config). Keys the in-process manager registry and the lookup
    endpoint's socket (:func:`kvtier.service.lookup_endpoint.socket_path`).
    """
    instance_id = str(getattr(vllm_config, "instance_id", "") or "")
    dp_rank = getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_rank", 0)
    return f"{engine_id}\x00{instance_id}\x00dp{dp_rank}"


def service_client(config: KVTierConfig, namespace: KeyNamespace, engine_id: str) -> KVStore:
    """A client of the shared kvtier server, under this engine's id."""
    from kvtier.service.client import ServiceClient

    if not config.server:
        raise ValueError("service_client: config.server is not set")
    return ServiceClient(
        config.server,
        namespace,
        client_id=engine_id,
        timeout_s=config.server_timeout_s,
        token=config.server_token,
        wait_connected_s=min(5.0, 10 * config.server_timeout_s),
        # The worker treats a chunk whose buffer raises as a failed load (recomputed), so the
        # commit checksum is checked here, ahead of the copies, not by the server before it answers.
        verify="client",
    )


def open_worker_store(config: KVTierConfig, namespace: KeyNamespace, engine_id: str,
                      instance: str | None = None) -> tuple[KVStore, Any]:
    """The worker side's store and its lookup server (None in server mode).

    ``instance``: :func:`engine_instance` (None: ``engine_id``), the registry and socket key.
    """
    if config.server:
        return service_client(config, namespace, engine_id), None
    key = engine_id if instance is None else instance
    manager = registry.acquire(key, lambda: open_manager(config, namespace))
    try:
        return manager, LookupServer(manager, socket_path(key))
    except BaseException:
        registry.release(manager)
        raise


def close_worker_store(store: KVStore, lookup_server: Any) -> None:
    """Undo :func:`open_worker_store` (the last engine reference closes an embedded manager)."""
    if lookup_server is not None:
        lookup_server.close()
    if isinstance(store, StorageManager):
        registry.release(store)
    else:
        store.close()


def open_scheduler_index(config: KVTierConfig, namespace: KeyNamespace, engine_id: str,
                         instance: str | None = None) -> LookupIndex:
    """The scheduler side's index: the server, the worker's manager in this process, or an RPC stub.

    ``instance``: as for :func:`open_worker_store` (both sides must pass the same).
    """
    if config.server:
        return service_client(config, namespace, engine_id)
    key = engine_id if instance is None else instance
    local = registry.get(key)
    if local is not None:
        return local
    # The worker's lookup may include one remote existence call and one call per peer.
    timeout = (config.lookup_timeout_s + (config.remote_timeout_s if config.remote_url else 0)
               + config.peer_timeout_s * len(config.peers))
    return LookupClient(socket_path(key), namespace.chunk_size, timeout_s=timeout)


def close_scheduler_index(index: LookupIndex) -> None:
    """Close the index unless it is the worker's manager (the worker closes that)."""
    if not isinstance(index, StorageManager):
        index.close()
