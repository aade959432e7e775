"""Loads and saves copied by ``kvtier server`` itself, addressed by engine block id.

When the worker's store is a :class:`~kvtier.service.client.ServiceClient` and the
engine's KV is on a CUDA device, :meth:`ServerCopies.try_register` shares the KV with
the server (``kv_register``: CUDA IPC exports plus each layer's strided view, see
:mod:`kvtier.service.kv_export`). If the server accepts, :class:`~.steps.TorchSteps`
hands its loads and saves to this class: one ``load_blocks`` / ``store_blocks`` per
request, which the server runs between its slots and the engine's blocks on its own
CUDA stream; the engine never copies through host memory itself. If the server
refuses (no CUDA, another device, an older server) the worker keeps the layer-wise
slot copies.

Trade-off: a server-side load is finished when ``start_load_kv`` returns (no
layer-by-layer overlap with the forward); saves run at ``wait_for_save``.
Ordering: before each call the engine's current CUDA stream is synchronized (a
load's blocks may still be read for their previous owner; a save's blocks must be
fully written). Never run on a GPU so far.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable

from kvtier.integrations.vllm.types import TransferSpec
from kvtier.storage.types import WriteSkip

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtier.integrations.vllm.gpu.layout import RegisteredKV

log = logging.getLogger("kvtier.vllm")


class ServerCopies:
    """Per-request ``load_blocks`` / ``store_blocks`` through a store that supports them.

    Args:
        store: a ``ServiceClient`` whose ``register_kv`` was accepted.
        device: the engine KV's device (its current stream is synchronized before each call).
        info: the server's ``kv_register`` reply.
    """

    def __init__(self, store: Any, device: "torch.device", info: dict[str, Any]):
        self.store = store
        self.device = device
        self.info = info

    @classmethod
    def try_register(cls, store: Any, kv: "RegisteredKV", shm_name: str | None = None) -> "ServerCopies | None":
        """Share ``kv`` with the store's server; None (use the slot copies) if anything refuses.

        ``shm_name``: the CPU stand-in (tests only, see :mod:`kvtier.service.kv_buffers`).
        """
        if not hasattr(store, "register_kv"):
            return None
        if shm_name is None and kv.device.type != "cuda":
            return None
        try:
            from kvtier.service.kv_export import kv_register_request

            info = store.register_kv(kv_register_request(kv.layers, shm_name))
        except Exception as exc:
            log.info("kvtier: server-side block copies not available (%s); using slot copies", exc)
            return None
        if info is None:
            log.info("kvtier: the server refused the KV registration; using slot copies")
            return None
        log.info("kvtier: the server copies KV by block id (%s, pinned=%s)", info.get("device"), info.get("pinned"))
        return cls(store, kv.device, info)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.current_stream(self.device).synchronize()

    def load(self, specs: list[TransferSpec], report_errors: Callable[[Iterable[int]], None]) -> set[str]:
        """Load every spec's chunks; returns the failed request ids (their blocks from the first miss reported)."""
        self._sync()
        failed: set[str] = set()
        for spec in specs:
            chunks = spec.chunks
            try:
                got = self.store.load_blocks([c.key for c in chunks], [c.parent for c in chunks],
                                             [list(c.block_ids) for c in chunks], [c.offset for c in chunks])
            except Exception:
                log.exception("kvtier: server-side load for %s failed", spec.req_id)
                got = [None] * len(chunks)
            failed_at = next((i for i, g in enumerate(got) if g is None), None)
            if failed_at is not None:
                failed.add(spec.req_id)
                report_errors(b for later in chunks[failed_at:] for b in later.block_ids)
            try:
                self.store.release(spec.req_id)
            except Exception:
                log.exception("kvtier: releasing the lease of %s failed", spec.req_id)
        return failed

    def save(self, specs: list[TransferSpec]) -> None:
        """Store every spec's chunks (the server stops a chain at ``NO_ROOM``); never raises."""
        if not specs:
            return
        self._sync()
        for spec in specs:
            chunks = spec.chunks
            try:
                skips = self.store.store_blocks([c.key for c in chunks], [list(c.block_ids) for c in chunks],
                                                [c.parent for c in chunks])
            except Exception:
                log.exception("kvtier: server-side save for %s failed", spec.req_id)
                continue
            if any(s == WriteSkip.NO_ROOM for s in skips):
                log.debug("kvtier: %s stored %d of %d chunks (no room)", spec.req_id, skips.count(None), len(chunks))

    def close(self) -> None:
        try:
            self.store.release_kv()
        except Exception:
            log.exception("kvtier: releasing the server's KV registration failed")
