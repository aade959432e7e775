"""Copies addressed by engine block id: ``kv_register``, ``store_blocks``, ``load_blocks``, ``kv_release``.

A connection that shared its engine's paged KV (``kv_register``: CUDA IPC exports,
or the CPU stand-in used by tests, see :mod:`kvtier.service.kv_buffers`) can store
and load chunks by naming engine block ids: the server gathers the blocks into its
own slots (or scatters slots into the blocks) on a dedicated copy stream
(:class:`~kvtier.service.block_copy.CopyRunner`: a CUDA stream plus an event it
waits for; inline on CPU) and replies once the copies are complete, so the engine
never touches the host copy. A slot is ``uint8 [L, blocks_per_chunk, page_bytes]``
(:mod:`kvtier.service.block_copy`), the layout the vLLM worker's GPU path uses.

Stores and loads go through the same reservation, read-reference, quota and
checksum code as the slot-copy ops (:class:`~kvtier.service.handlers.DataHandlers`):
a stored chunk is checksummed at commit, a loaded CPU chunk verified before its
copy. Holds taken by a request are given back before its reply (commit or abort;
unload), whatever happens. Ordering contract for the engine: its writes to the
blocks of a store must be complete (its stream synchronized) before it sends
``store_blocks``; the blocks of a load must not be read, nor their ids reused,
until the ``load_blocks`` reply (after an error reply they hold garbage).

One registration per connection; it ends with ``kv_release``, a new
``kv_register``, or the connection (:meth:`KVOps.release` from ``drop``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

from kvtier.protocol import ErrorCode, ProtocolError
from kvtier.protocol.messages import Abort, Commit, KVRegister, KVRelease, LoadBlocks, StoreBlocks
from kvtier.service.block_copy import CopyRunner, check_ids, gather, scatter
from kvtier.service.cuda_ipc import cuda_available
from kvtier.service.handlers import DataHandlers
from kvtier.service.kv_buffers import KVBufferError, OpenedBuffers, layer_views, open_buffers
from kvtier.service.pinning import SegmentPins
from kvtier.service.session import Session
from kvtier.storage.types import WriteSkip

log = logging.getLogger(__name__)

KV_OPS = frozenset({"kv_register", "store_blocks", "load_blocks", "kv_release"})


@dataclass
class EngineKV:
    """One connection's registered engine KV.

    Attributes:
        buffers: the opened allocations (kept alive while the views are used).
        layers: per layer ``uint8 [B, H, N, C]`` views, on the engine's device.
        num_blocks, page_bytes, bpc: B, ``H * N * C`` and blocks per chunk.
        runner: the copy stream.
        pinned: the namespace digest whose segment this registration pinned, or None.
    """

    buffers: OpenedBuffers
    layers: list[Any]
    num_blocks: int
    page_bytes: int
    bpc: int
    runner: CopyRunner
    pinned: bytes | None = None


def _bad(msg: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_MESSAGE, msg)


class KVOps:
    """The block-id ops of every connection (the server holds one).

    Args:
        handlers: the slot ops whose reservations, reads, quotas and checksums these reuse.
        pins: pins namespace segments for CUDA registrations (:mod:`kvtier.service.pinning`).
    """

    def __init__(self, handlers: DataHandlers, pins: SegmentPins):
        self.handlers = handlers
        self.pins = pins
        self._kv: dict[int, EngineKV] = {}  # session id -> its registration
        self._lock = threading.Lock()
        self.table: dict[str, Callable[[Session, Any], dict[str, Any]]] = {
            "kv_register": self.register, "store_blocks": self.store, "load_blocks": self.load,
            "kv_release": self.kv_release,
        }

    def registered(self) -> int:
        """Connections holding a registration now."""
        with self._lock:
            return len(self._kv)

    # -- registration --------------------------------------------------------------------------
    def register(self, s: Session, r: KVRegister) -> dict[str, Any]:
        """Open the buffers, check the geometry against the namespace, keep the views.

        Raises:
            ProtocolError: ``CUDA_UNAVAILABLE``, ``NOT_ALLOWED`` (the shm stand-in over TCP),
                ``UNSUPPORTED`` (no torch), ``BAD_NAMESPACE`` (geometry that does not make
                this namespace's chunks), ``BAD_MESSAGE`` (buffers that cannot be opened or views
                outside them).
        """
        assert s.registered is not None
        host = s.registered.host
        if r.kind == "cuda" and not cuda_available():
            raise ProtocolError(ErrorCode.CUDA_UNAVAILABLE, "this server has no CUDA device; use the slot copies")
        if r.kind == "shm" and s.kind != "unix":
            raise ProtocolError(ErrorCode.NOT_ALLOWED, "the shm stand-in (tests only) is served on the Unix socket only")
        try:
            import torch  # noqa: F401
        except ImportError:
            raise ProtocolError(ErrorCode.UNSUPPORTED, "this server has no torch; use the slot copies") from None
        lay, ns = host.namespace.layout, host.namespace
        b, h, n, c = r.shape
        page = h * n * c
        if len(r.layers) != lay.num_layers or n != lay.block_size or len(r.layers) * ns.blocks_per_chunk * page != ns.chunk_bytes:
            raise ProtocolError(
                ErrorCode.BAD_NAMESPACE,
                f"{len(r.layers)} layers of {n}-token blocks of {page} B make {len(r.layers) * ns.blocks_per_chunk * page} B "
                f"chunks; the namespace has {lay.num_layers} layers of {lay.block_size}-token blocks, {ns.chunk_bytes} B chunks",
            )
        self.release(s.sid)
        try:
            opened = open_buffers(r.kind, r.buffers)
        except KVBufferError as exc:
            raise _bad(str(exc)) from None
        try:
            views = layer_views(opened.tensors, r.shape, r.layers)
            kv = EngineKV(opened, views, b, page, ns.blocks_per_chunk, CopyRunner(opened.device))
        except BaseException as exc:
            opened.close()
            if isinstance(exc, KVBufferError):
                raise _bad(str(exc)) from None
            raise
        if opened.device.type == "cuda" and self.pins.acquire(host.digest, host.segment):
            kv.pinned = host.digest
        with self._lock:
            self._kv[s.sid] = kv
        return {"num_layers": len(views), "num_blocks": b, "page_bytes": page, "device": str(opened.device),
                "pinned": kv.pinned is not None}

    def kv_release(self, s: Session, r: KVRelease) -> dict[str, Any]:
        return {"released": self.release(s.sid)}

    def release(self, sid: int) -> bool:
        """Forget session ``sid``'s registration (unpin, unmap); True if it had one. Never raises."""
        with self._lock:
            kv = self._kv.pop(sid, None)
        if kv is None:
            return False
        try:
            if kv.pinned is not None:
                self.pins.release(kv.pinned)
        except Exception:
            log.exception("kvtier server: unpinning a segment failed")
        kv.layers = []
        kv.buffers.close()
        return True

    def close(self) -> None:
        """Release every registration and pin (server shutdown)."""
        with self._lock:
            sids = list(self._kv)
        for sid in sids:
            self.release(sid)
        self.pins.close()

    def _get(self, s: Session) -> EngineKV:
        with self._lock:
            kv = self._kv.get(s.sid)
        if kv is None:
            raise ProtocolError(ErrorCode.BAD_STATE, "no engine KV registered on this connection: send kv_register first")
        return kv

    # -- copies --------------------------------------------------------------------------------------
    def store(self, s: Session, r: StoreBlocks) -> dict[str, Any]:
        """Reserve, gather the blocks into the slots, commit (checksummed); abort on a copy error.

        Chain rule: from the first ``NO_ROOM`` on, nothing more is stored (skips say ``NO_ROOM``).
        """
        import torch

        kv, reg = self._get(s), s.registered
        assert reg is not None
        for ids in r.blocks:
            if len(ids) != kv.bpc:
                raise _bad(f"store_blocks: each chunk is {kv.bpc} block ids, got {len(ids)}")
            _check(ids, kv.num_blocks)
        slots, skips = self.handlers._reserve(s.holds, reg, r.keys, r.parents)
        stop = next((i for i, (sl, sk) in enumerate(zip(slots, skips)) if sl is None and sk == WriteSkip.NO_ROOM), None)
        jobs: list[tuple[int, int]] = []
        for i, slot in enumerate(slots):
            if slot is None:
                continue
            if stop is not None and i > stop:
                self.handlers.abort(s.holds, reg, Abort(r.keys[i]))
                skips[i] = int(WriteSkip.NO_ROOM)
            else:
                jobs.append((i, slot))
        pool, dev = reg.host.pool, kv.buffers.device

        def work() -> None:
            for i, slot in jobs:
                out = torch.from_numpy(pool.view(slot)).view(len(kv.layers), kv.bpc, kv.page_bytes)
                gather(kv.layers, None, torch.tensor(r.blocks[i], dtype=torch.int64, device=dev), out)

        try:
            kv.runner.run(work)
        except BaseException:
            for i, _ in jobs:
                self.handlers.abort(s.holds, reg, Abort(r.keys[i]))
            raise
        for n, (i, _) in enumerate(jobs):
            parent = r.parents[i] if r.parents is not None else (r.keys[i - 1] if i else None)
            try:
                self.handlers.commit(s.holds, reg, Commit(r.keys[i], parent))
            except BaseException:
                for j, _ in jobs[n + 1 :]:
                    self.handlers.abort(s.holds, reg, Abort(r.keys[j]))
                raise
        return {"skips": [int(x) for x in skips]}

    def load(self, s: Session, r: LoadBlocks) -> dict[str, Any]:
        """Take read references, scatter the prefix of hits into the blocks, give the references back."""
        import torch

        kv, reg = self._get(s), s.registered
        assert reg is not None
        for ids, off in zip(r.blocks, r.offsets):
            if off + len(ids) > kv.bpc:
                raise _bad(f"load_blocks: blocks {off}..{off + len(ids)} are outside a {kv.bpc}-block chunk")
        _check([b for ids in r.blocks for b in ids], kv.num_blocks)
        got = self.handlers._load(s.holds, reg, r.keys, r.parents)
        hits = next((i for i, g in enumerate(got) if g is None), len(got))
        held = [g for g in got[:hits] if g is not None]  # all of them: the prefix of hits
        pool, dev = reg.host.pool, kv.buffers.device

        def work() -> None:
            for i, g in enumerate(held):
                src = torch.from_numpy(pool.view(g[1])).view(len(kv.layers), kv.bpc, kv.page_bytes)
                ids = torch.tensor(r.blocks[i], dtype=torch.int64, device=dev)
                scatter(src[:, r.offsets[i] : r.offsets[i] + len(r.blocks[i])], kv.layers, None, ids)

        try:
            kv.runner.run(work)
        finally:
            for g in got:
                if g is not None:
                    handle = s.holds.pop_read(g[0])
                    if handle is not None:
                        handle.close()
        return {"sources": [g[2] for g in held] + [None] * (len(got) - hits)}


def _check(ids: list[int], num_blocks: int) -> None:
    try:
        check_ids(ids, num_blocks)
    except (IndexError, ValueError) as exc:
        raise _bad(str(exc)) from None
