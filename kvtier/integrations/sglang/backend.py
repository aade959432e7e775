"""``KVTierHiCacheStorage``: kvtier as an SGLang HiCache storage backend (L3).

Load it in SGLang with the dynamic backend::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang", "class_name": "KVTierHiCacheStorage",
        "kvtier": {"cpu_capacity": "8GiB", "disk_path": "/mnt/nvme/kvtier"}}'

SGLang constructs it as ``cls(storage_config, kwargs)`` and then calls
``register_mem_pool_host(host_pool)``; the kvtier store (an embedded
:class:`~kvtier.storage.manager.StorageManager`, or a ``kvtier server`` client when the
``kvtier`` settings name ``server``) opens there, once the page layout is known (see
:mod:`.namespace`). ``kvtier`` settings go through :func:`kvtier.config.load_config`
(``KVTIER_*`` variables and config files apply); ``chunk_size`` is the page size.
``model_id`` (optional) overrides ``storage_config.model_name`` as the model identity.

Interface (SGLang's ``HiCacheStorage``): ``get``/``set``/``exists``, ``batch_get``/
``batch_set``, ``batch_exists`` (the count of consecutive stored pages from the first),
the zero-copy ``batch_get_v1``/``batch_set_v1`` (keys plus host-pool token indices,
``page_size`` per key; the page at index ``host_indices[i * page_size]``), ``clear`` and
``get_stats``. The v2 multi-pool calls are not implemented (the base raises
``NotImplementedError``). A failing tier is a miss (``False``/``None``/a shorter count),
never an exception on SGLang's I/O threads; misuse (no host pool, wrong index count) is
logged and answered as a failure.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import numpy as np
import torch

from kvtier.config import load_config
from kvtier.index.keys import KeyNamespace
from kvtier.integrations.sglang.compat import SGLANG_BASE, as_tensor, page_bytes
from kvtier.integrations.sglang.compat import HiCacheStorageBase as _Base
from kvtier.integrations.sglang.namespace import PageKeys, namespace_for_pool
from kvtier.storage.backend import KVStore
from kvtier.storage.types import ReadHandle, WriteSkip

log = logging.getLogger("kvtier.sglang")

#: extra_config keys SGLang's dynamic loader reads (ignored here).
LOADER_KEYS = frozenset({"backend_name", "module_path", "class_name"})
#: extra_config keys this backend reads.
OWN_KEYS = frozenset({"kvtier", "model_id"})


class KVTierHiCacheStorage(_Base):
    """SGLang ``HiCacheStorage`` on kvtier's tiers (see the module docstring).

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig`` (``tp_rank``, ``tp_size``,
            ``pp_rank``, ``pp_size``, ``is_mla_model``, ``model_name``, ``extra_config``).
        kwargs: extra arguments of SGLang's factory (unused).
        store: an open kvtier store to use instead of opening one (tests; must be of the
            namespace :func:`~kvtier.integrations.sglang.namespace.namespace_for_pool` gives).

    Raises:
        ValueError: unknown ``extra_config`` keys, or invalid ``kvtier`` settings.
    """

    def __init__(self, storage_config: Any, kwargs: dict | None = None, *, store: KVStore | None = None):
        self.storage_config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        unknown = set(extra) - LOADER_KEYS - OWN_KEYS
        if unknown:
            raise ValueError(f"unknown kvtier HiCache extra_config keys {sorted(unknown)}; known: {sorted(OWN_KEYS)}")
        self._settings = dict(extra.get("kvtier") or {})
        self._model_id = extra.get("model_id")
        load_config(self._settings)  # refuse bad settings now, not on the first page
        self._given_store = store
        self.store: KVStore | None = None
        self.namespace: KeyNamespace | None = None
        self._keys: PageKeys | None = None
        self.mem_pool_host: Any = None
        self._lock = threading.Lock()
        self.counters = {"get_pages": 0, "get_hits": 0, "set_pages": 0, "set_stored": 0, "exists_calls": 0, "errors": 0}

    # -- setup ---------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Attach SGLang's host pool and open the kvtier store for its page layout.

        Raises:
            ValueError: the pool's pages cannot be stored (see ``namespace_for_pool``), or a
                given store has another namespace.
        """
        ns = namespace_for_pool(mem_pool_host, self.storage_config, self._model_id)
        with self._lock:
            if self.store is not None and self.namespace != ns:
                raise ValueError("a host pool of another layout is already registered")
            self.mem_pool_host = mem_pool_host
            if self.store is None:
                if self._given_store is not None:
                    if getattr(self._given_store, "namespace", None) != ns:
                        raise ValueError(f"the given store's namespace is not the host pool's {ns}")
                    self.store = self._given_store
                else:
                    self.store = self._open(ns)
                self.namespace, self._keys = ns, PageKeys(ns)
        self.page_size = ns.chunk_size

    def _open(self, ns: KeyNamespace) -> KVStore:
        settings = {**self._settings, "chunk_size": ns.chunk_size}
        config = load_config(settings)
        if config.server:
            from kvtier.service.client import ServiceClient

            return ServiceClient(config.server, ns, timeout_s=config.server_timeout_s, token=config.server_token,
                                 wait_connected_s=min(5.0, 10 * config.server_timeout_s))
        from kvtier.transfer.assembly import open_manager

        return open_manager(config, ns)

    def _ready(self) -> bool:
        if self.store is None or self._keys is None:
            log.error("kvtier HiCache storage used before register_mem_pool_host; answering a miss")
            self.counters["errors"] += 1
            return False
        return True

    def _dtype(self) -> torch.dtype:
        return self.mem_pool_host.get_dummy_flat_data_page().dtype

    # -- exists --------------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        """True if a tier holds page ``key``."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are stored (every tier asked; remote in one round trip)."""
        if not keys or not self._ready():
            return 0
        self.counters["exists_calls"] += 1
        try:
            return len(self.store.lookup_keys(self._keys.keys(list(keys))).keys)  # type: ignore[union-attr]
        except TypeError:
            raise
        except Exception:
            log.exception("kvtier: batch_exists failed; answering 0")
            return 0

    # -- reads ---------------------------------------------------------------------------------
    def _open_reads(self, keys: list[str]) -> Sequence[ReadHandle | None]:
        mapped = self._keys.keys(list(keys))  # type: ignore[union-attr]
        try:
            return self.store.open_read_many([(k, None) for k in mapped])  # type: ignore[union-attr]
        except Exception:
            log.exception("kvtier: reading %d pages failed", len(keys))
            return [None] * len(keys)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Page ``key`` as a flat tensor (into ``target_location`` when given), or None on a miss."""
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Per key the page (written into ``target_locations[i]`` when given, else a new flat
        tensor of the pool's dtype), or None (miss, or a target of the wrong byte size)."""
        if not self._ready():
            return [None] * len(keys)
        handles = self._open_reads(keys)
        out: list[torch.Tensor | None] = []
        dtype = self._dtype()
        try:
            for i, h in enumerate(handles):
                self.counters["get_pages"] += 1
                if h is None:
                    out.append(None)
                    continue
                target = target_locations[i] if target_locations is not None else None
                if target is None:
                    target = torch.empty(h.buffer.nbytes // torch.empty(0, dtype=dtype).element_size(), dtype=dtype)
                if target.numel() * target.element_size() != h.buffer.nbytes or not target.is_contiguous():
                    log.error("kvtier: get target of %d B for a %d B page", target.numel() * target.element_size(), h.buffer.nbytes)
                    out.append(None)
                    continue
                target.view(torch.uint8).reshape(-1).copy_(as_tensor(h.buffer))
                self.counters["get_hits"] += 1
                out.append(target)
        finally:
            for h in handles:
                if h is not None:
                    h.close()
        return out

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Read pages ``keys`` straight into the host pool at ``host_indices`` (``page_size`` per key)."""
        if not self._ready() or not self._indices_ok(keys, host_indices):
            return [False] * len(keys)
        handles = self._open_reads(keys)
        ok: list[bool] = []
        dtype = self._dtype()
        try:
            for i, h in enumerate(handles):
                self.counters["get_pages"] += 1
                if h is None:
                    ok.append(False)
                    continue
                page = as_tensor(h.buffer).view(dtype)
                try:
                    self.mem_pool_host.set_from_flat_data_page(int(host_indices[i * self.page_size]), page)
                except Exception:
                    log.exception("kvtier: writing page %d into the host pool failed", i)
                    ok.append(False)
                    continue
                self.counters["get_hits"] += 1
                ok.append(True)
        finally:
            for h in handles:
                if h is not None:
                    h.close()
        return ok

    def _indices_ok(self, keys: list[str], host_indices: torch.Tensor) -> bool:
        if host_indices is None or host_indices.numel() != len(keys) * self.page_size:
            log.error("kvtier: %d host indices for %d pages of %d tokens",
                      0 if host_indices is None else host_indices.numel(), len(keys), self.page_size)
            self.counters["errors"] += 1
            return False
        return True

    # -- writes --------------------------------------------------------------------------------
    def _write(self, keys: list[str], pages: list[torch.Tensor | None], extra_info: Any = None) -> list[bool]:
        """Store ``pages[i]`` under ``keys[i]``; consecutive keys are one prefix (each page's
        parent is the previous one; the first's is ``extra_info.prefix_keys[-1]`` if given)."""
        mapped = self._keys.keys(list(keys))  # type: ignore[union-attr]
        prefix = list(getattr(extra_info, "prefix_keys", None) or [])
        first_parent = self._keys.key(prefix[-1]) if prefix else None  # type: ignore[union-attr]
        parents = [mapped[i - 1] if i else first_parent for i in range(len(mapped))]
        try:
            bufs = self.store.open_write_many(mapped, parents)  # type: ignore[union-attr]
        except Exception:
            log.exception("kvtier: reserving %d pages failed", len(keys))
            return [False] * len(keys)
        ok: list[bool] = []
        for key, parent, buf, page in zip(mapped, parents, bufs, pages):
            self.counters["set_pages"] += 1
            if not isinstance(buf, np.ndarray):
                ok.append(buf in (WriteSkip.PRESENT, WriteSkip.IN_FLIGHT))
                continue
            try:
                if page is None:
                    raise ValueError("no page data")
                data = page_bytes(page)
                if data.nbytes != buf.nbytes:
                    raise ValueError(f"page of {data.nbytes} B, kvtier chunk of {buf.nbytes} B")
                np.copyto(buf, data)
            except Exception:
                log.exception("kvtier: storing a page failed")
                self.store.abort(key)  # type: ignore[union-attr]
                ok.append(False)
                continue
            self.store.commit(key, parent)  # type: ignore[union-attr]
            self.counters["set_stored"] += 1
            ok.append(True)
        return ok

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store flat page tensor ``value`` under ``key``; True if stored or already held."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        """Store ``values[i]`` under ``keys[i]``; True if every page is stored or already held."""
        if not self._ready() or values is None or len(values) != len(keys):
            return False
        return all(self._write(list(keys), list(values)))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` (``page_size`` per key) under ``keys``."""
        if not self._ready() or not self._indices_ok(keys, host_indices):
            return [False] * len(keys)
        pages: list[torch.Tensor | None] = []
        for i in range(len(keys)):
            try:
                pages.append(self.mem_pool_host.get_data_page(int(host_indices[i * self.page_size]), flat=True))
            except Exception:
                log.exception("kvtier: reading page %d from the host pool failed", i)
                pages.append(None)
        return self._write(list(keys), pages, extra_info)

    # -- admin ---------------------------------------------------------------------------------
    def clear(self) -> None:
        """Remove this namespace's pages from every kvtier tier (other models' stay)."""
        if self.store is not None:
            self.store.clear()

    def stats(self) -> dict[str, int | float]:
        """This backend's page counters plus the kvtier store's stats."""
        out: dict[str, int | float] = dict(self.counters)
        if self.store is not None:
            try:
                out.update(self.store.stats())
            except Exception:
                log.exception("kvtier: stats failed")
        return out

    def get_stats(self) -> None:
        """SGLang's storage-metrics hook: None (kvtier reports through :meth:`stats`, its
        Prometheus/HTTP endpoints and ``kvtier top``, not SGLang's metric object)."""
        return

    def close(self) -> None:
        """Flush and close the store if this backend opened it."""
        if self.store is not None and self._given_store is None:
            self.store.close()
        self.store = None


__all__ = ["SGLANG_BASE", "KVTierHiCacheStorage"]
