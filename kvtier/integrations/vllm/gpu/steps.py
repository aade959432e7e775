"""The worker's per-step loads and saves over torch KV tensors, layer by layer.

Used by :class:`~kvtier.integrations.vllm.worker.KVTierWorker` when the engine's
KV is on a CUDA device (and by tests with CPU tensors). It keeps the worker's
invariants (module docstring of ``worker.py``):

- a load fills every planned block up to the first unavailable chunk; that chunk's
  blocks and all later ones are reported (``report_errors``) for recompute;
- every load ends its request's lease (``store.release``) once its copies are done;
- a save stops a prompt's chain only at ``NO_ROOM``/failure; ``PRESENT`` and
  ``IN_FLIGHT`` do not stop it; reserved slots are committed only after their
  copies completed on the host, aborted on any copy error.

Per step: :meth:`begin_loads` (``start_load_kv``), :meth:`wait_for_layer_load`,
:meth:`end_loads` (before saves / at ``wait_for_save``), :meth:`save_layer`
(``save_kv_layer``, which reserves the step's slots on its first call),
:meth:`end_saves` (``wait_for_save``). :meth:`copy_chunk_in` is the whole-chunk
path for asynchronous loads (their own stream, synchronous for the caller).

With a ``server`` (:class:`~.server_copies.ServerCopies`: the store is a ``kvtier server``
that accepted the engine's KV over CUDA IPC), sync loads and saves are the server's
copies by block id instead (whole request at ``begin_loads`` / ``end_saves``; same
invariants); asynchronous loads keep :meth:`copy_chunk_in`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

from kvtier.integrations.vllm.gpu.gather import check_ids, scatter
from kvtier.integrations.vllm.gpu.layerwise import ChunkJob, LayerwiseLoader, LayerwiseSaver
from kvtier.integrations.vllm.gpu.layout import RegisteredKV
from kvtier.integrations.vllm.gpu.server_copies import ServerCopies
from kvtier.integrations.vllm.gpu.streams import CopyStream, stream_for
from kvtier.integrations.vllm.types import ChunkCopy, TransferSpec
from kvtier.storage.types import WriteSkip

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("kvtier.vllm")


@dataclass
class _OpenLoad:
    req_id: str
    handles: list[Any] = field(default_factory=list)


@dataclass
class _Reserved:
    chunk: ChunkCopy  # a reserved slot being filled, committed at end_saves


class TorchSteps:
    """Loads and saves between a store's host slots and registered torch KV.

    Args:
        store: the worker's :class:`~kvtier.storage.backend.KVStore`.
        kv: the registered KV (:func:`~.layout.register_kv`).
        blocks_per_chunk: engine blocks per kvtier chunk.
        report_errors: called with block ids whose load failed (vLLM recomputes them).
        stream, async_stream: copy streams; default :func:`~.streams.stream_for` the KV's device.
        server: when set, sync loads and saves are copied by ``kvtier server`` by block id
            (:mod:`.server_copies`) instead of through the slots here.
    """

    def __init__(self, store: Any, kv: RegisteredKV, blocks_per_chunk: int,
                 report_errors: Callable[[Iterable[int]], None],
                 stream: CopyStream | None = None, async_stream: CopyStream | None = None,
                 server: "ServerCopies | None" = None):
        self.store = store
        self.server = server
        self.kv = kv
        self.bpc = blocks_per_chunk
        self.report_errors = report_errors
        self.stream = stream if stream is not None else stream_for(kv.device)
        self._async_stream = async_stream
        self.loader = LayerwiseLoader(kv, self.stream)
        self.saver = LayerwiseSaver(kv, self.stream)
        self._open: list[_OpenLoad] = []
        self._save_specs: list[TransferSpec] | None = None
        self._reserved: list[_Reserved] = []
        self._save_failed = False

    def slot(self, buf: np.ndarray) -> "torch.Tensor":
        """A host slot as ``uint8 [L, blocks_per_chunk, page_bytes]`` (no copy)."""
        import torch

        return torch.from_numpy(buf).view(self.kv.layout.num_layers, self.bpc, -1)

    # -- loads ---------------------------------------------------------------------------------
    def begin_loads(self, specs: list[TransferSpec]) -> set[str]:
        """Open the chunks of this step's sync loads and issue their copies; returns failed req ids."""
        self.end_loads()
        if self.server is not None:
            return self.server.load(specs, self.report_errors)
        failed: set[str] = set()
        jobs: list[ChunkJob] = []
        for spec in specs:
            opened = _OpenLoad(spec.req_id)
            self._open.append(opened)
            try:
                handles = self.store.open_read_many([(ch.key, ch.parent) for ch in spec.chunks])
            except Exception:
                log.exception("kvtier: opening %d chunks for %s failed", len(spec.chunks), spec.req_id)
                handles = [None] * len(spec.chunks)
            opened.handles = [h for h in handles if h is not None]
            failed_at = next((i for i, h in enumerate(handles) if h is None), None)
            usable = len(spec.chunks) if failed_at is None else failed_at
            for i in range(usable):
                ch = spec.chunks[i]
                try:
                    job = ChunkJob(self.slot(handles[i].buffer), tuple(ch.block_ids), ch.offset)
                    check_ids(_ids(job.block_ids), self.kv.layout.num_blocks)
                except Exception:
                    log.exception("kvtier: chunk %s cannot be loaded", ch.key.hex()[:16])
                    failed_at = i
                    break
                jobs.append(job)
            if failed_at is not None:
                failed.add(spec.req_id)
                self.report_errors(b for later in spec.chunks[failed_at:] for b in later.block_ids)
        try:
            self.loader.start(jobs)
        except Exception:  # nothing was issued: every planned block is recomputed
            log.exception("kvtier: issuing the layer-wise load failed")
            self.report_errors(b for spec in specs for ch in spec.chunks for b in ch.block_ids)
            failed.update(spec.req_id for spec in specs)
            self.end_loads()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.loader.wait_for_layer_load(layer_name)

    def end_loads(self) -> None:
        """Wait for this step's load copies, close the slots, end the leases."""
        try:
            self.loader.finish()
        finally:
            opened, self._open = self._open, []
            for o in opened:
                for handle in o.handles:
                    handle.close()
                self.store.release(o.req_id)

    def copy_chunk_in(self, buf: np.ndarray, block_ids: tuple[int, ...], offset: int) -> None:
        """Whole-chunk load (all layers), finished on return (async loads' thread).

        Raises:
            IndexError / ValueError: bad block ids or offset.
        """
        if self._async_stream is None:
            self._async_stream = stream_for(self.kv.device)
        ids = _ids(block_ids)
        check_ids(ids, self.kv.layout.num_blocks)
        if offset < 0 or offset + len(block_ids) > self.bpc:
            raise ValueError(f"blocks {offset}..{offset + len(block_ids)} outside a {self.bpc}-block chunk")
        src = self.slot(buf)[:, offset : offset + len(block_ids)]
        dev = self.kv.device
        if dev.type == "cuda":
            # The engine thread's stream is not visible from this thread: wait for the device's
            # earlier work, which may still read these blocks for their previous owner.
            import torch

            torch.cuda.synchronize(dev)
        self._async_stream.run(lambda: scatter(src, self.kv.layers, self.kv.stacked, ids.to(dev)))
        self._async_stream.record().synchronize()

    # -- saves ---------------------------------------------------------------------------------
    def set_saves(self, specs: list[TransferSpec]) -> None:
        """This step's saves (slots are reserved at the first :meth:`save_layer` or at :meth:`end_saves`)."""
        self._save_specs = list(specs)

    def _reserve(self) -> None:
        specs, self._save_specs = self._save_specs, None
        jobs: list[ChunkJob] = []
        for spec in specs or []:
            bufs = self.store.open_write_many([ch.key for ch in spec.chunks], [ch.parent for ch in spec.chunks])
            stop = False
            for ch, buf in zip(spec.chunks, bufs):
                if not isinstance(buf, np.ndarray):
                    if not stop and buf not in (WriteSkip.PRESENT, WriteSkip.IN_FLIGHT):
                        stop = True
                    continue
                if stop:
                    self.store.abort(ch.key)
                    continue
                job = ChunkJob(self.slot(buf), tuple(ch.block_ids))
                self._reserved.append(_Reserved(ch))
                jobs.append(job)
        self.saver.start(jobs)

    def save_layer(self, layer_name: str) -> None:
        """Issue ``layer_name``'s save copies; never raises (a failure drops this step's saves)."""
        if self._save_failed or self.server is not None:
            return  # (server copies: the whole step's saves run at end_saves)
        try:
            if self._save_specs is not None:
                self._reserve()
            self.saver.save_layer(layer_name)
        except Exception:
            log.exception("kvtier: layer-wise save of %s failed; this step's chunks are dropped", layer_name)
            self._save_failed = True

    def end_saves(self) -> None:
        """Finish this step's save copies; commit the chunks (abort all on a copy error)."""
        if self.server is not None:
            specs, self._save_specs = self._save_specs, None
            self.server.save(specs or [])
            return
        ok = not self._save_failed
        self._save_failed = False
        try:
            if self._save_specs is not None:
                self._reserve()
            self.saver.finish()
        except Exception:
            log.exception("kvtier: layer-wise save failed; this step's chunks are dropped")
            ok = False
        reserved, self._reserved = self._reserved, []
        for r in reserved:
            if ok:
                self.store.commit(r.chunk.key, r.chunk.parent)
            else:
                self.store.abort(r.chunk.key)

    def close(self) -> None:
        """End any step in progress (loads finished, reserved saves aborted)."""
        self.end_loads()
        self._save_specs = None
        self._save_failed = False
        try:
            self.saver.finish()
        except Exception:  # pragma: no cover - copies of a dying engine
            log.exception("kvtier: finishing saves at shutdown failed")
        reserved, self._reserved = self._reserved, []
        for r in reserved:
            self.store.abort(r.chunk.key)
        server, self.server = self.server, None
        if server is not None:
            server.close()


def _ids(block_ids: tuple[int, ...]) -> "torch.Tensor":
    import torch

    return torch.tensor(block_ids, dtype=torch.int64)


def torch_steps_for(kv_caches: dict[str, "torch.Tensor"], namespace: Any, store: Any,
                    report_errors: Callable[[Iterable[int]], None]) -> TorchSteps:
    """Register ``kv_caches`` for ``namespace`` (layout, backend and block bytes checked) and build the steps.

    The backend is read from vLLM's forward context when one is current (the layers'
    own ``attn_backend``), else taken from the namespace. On CUDA with a ``kvtier server``
    store that accepts the KV (``kv_register``), loads and saves are server-side copies by
    block id (:mod:`.server_copies`); otherwise the layer-wise slot copies.

    Raises:
        UnsupportedKVLayout: the KV does not match the namespace's layout, backend,
            layer count or block size (kvtier is then disabled, never run on wrong data).
    """
    from kvtier.integrations.vllm.gpu.layout import UnsupportedKVLayout, check_namespace, layers_backend, register_kv

    lay = namespace.layout
    backend = lay.attn_backend.rsplit("/", 1)[-1]
    try:
        from vllm.config import get_current_vllm_config

        backend = layers_backend(get_current_vllm_config(), list(kv_caches))
    except Exception as exc:
        log.info("kvtier: layers' attention backend not readable here (%s); using the namespace's %r", exc, backend)
    kv = register_kv(kv_caches, lay.kv_layout, backend)
    check_namespace(kv, lay.attn_backend, lay.kv_layout, lay.num_kv_heads * lay.block_size * 2 * lay.head_dim * lay.itemsize)
    if kv.layout.num_layers != lay.num_layers or kv.layout.tokens != lay.block_size:
        raise UnsupportedKVLayout(
            f"engine KV has {kv.layout.num_layers} layers of {kv.layout.tokens}-token blocks, "
            f"the namespace {lay.num_layers} of {lay.block_size}"
        )
    server = ServerCopies.try_register(store, kv) if kv.device.type == "cuda" else None
    return TorchSteps(store, kv, namespace.blocks_per_chunk, report_errors, server=server)
