"""Layer-by-layer KV copies overlapped with the forward pass (vLLM's layer-wise connector hooks).

Loads: :meth:`LayerwiseLoader.start` (from ``start_load_kv``, before the forward)
issues layer 0's host->device copies of every chunk on the copy stream, records
an event, then layer 1's, and so on. ``wait_for_layer_load(layer i)`` (vLLM calls
it inside layer i's attention, before the attention reads the cache) makes the
compute stream wait on event i only, so layer i's attention starts as soon as its
own copy is done while the copies of layers > i continue. :meth:`finish` waits on
the host for the last event before the host slots are released.

Saves: :meth:`LayerwiseSaver.save_layer` (from ``save_kv_layer``, after layer i
wrote its KV) orders the copy stream after the compute stream's work so far and
issues layer i's device->host gathers; :meth:`finish` (from ``wait_for_save``)
copies the layers vLLM did not report, then waits for the copy stream, after
which the slots may be committed.

On CPU (:class:`~.streams.SyncStream`) the same calls copy synchronously. The
pattern (per-layer events on a side stream, ``cudaStreamWaitEvent`` before each
layer) is the standard CUDA stream/event overlap from the CUDA C++ Programming
Guide, "Asynchronous Concurrent Execution".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.integrations.vllm.gpu.gather import check_ids, gather_layer, scatter_layer
from kvtier.integrations.vllm.gpu.layout import RegisteredKV
from kvtier.integrations.vllm.gpu.streams import CopyEvent, CopyStream

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass
class ChunkJob:
    """One chunk's copy: host slot ``slot`` ``uint8 [L, blocks_per_chunk, page_bytes]``
    positions ``offset + j`` <-> engine block ``block_ids[j]``."""

    slot: "torch.Tensor"
    block_ids: tuple[int, ...]
    offset: int = 0


def _ids(kv: RegisteredKV, jobs: list[ChunkJob]) -> list["torch.Tensor"]:
    import torch

    out = []
    for job in jobs:
        ids = torch.tensor(job.block_ids, dtype=torch.int64)
        check_ids(ids, kv.layout.num_blocks)
        if job.offset < 0 or job.offset + len(job.block_ids) > job.slot.shape[1]:
            raise ValueError(f"blocks {job.offset}..{job.offset + len(job.block_ids)} outside the slot")
        out.append(ids)
    return out


class LayerwiseLoader:
    """Host slots -> engine blocks, one layer at a time on ``stream``. Not thread-safe (the forward's thread)."""

    def __init__(self, kv: RegisteredKV, stream: CopyStream):
        self.kv = kv
        self.stream = stream
        self._events: dict[str, CopyEvent] = {}
        self._last: CopyEvent | None = None

    @property
    def pending(self) -> bool:
        """True between :meth:`start` and :meth:`finish`."""
        return self._last is not None

    def start(self, jobs: list[ChunkJob]) -> None:
        """Issue every layer's copies (layer order), one event per layer.

        Raises:
            RuntimeError: the previous load was not finished.
            IndexError / ValueError: a block id outside the cache, duplicated, or past the slot.
        """
        if self._last is not None:
            raise RuntimeError("LayerwiseLoader.start before finish of the previous load")
        if not jobs:
            return
        host_ids = _ids(self.kv, jobs)
        dev = self.kv.device
        ids: list["torch.Tensor"] = []
        # The blocks may have been freed by a request whose kernels of the previous step are
        # still running on the compute stream: overwrite them only after that work.
        self.stream.wait_compute()
        self.stream.run(lambda: ids.extend(i.to(dev, non_blocking=True) for i in host_ids))
        for li, (name, layer) in enumerate(zip(self.kv.names, self.kv.layers)):
            def work(li: int = li, layer: "torch.Tensor" = layer) -> None:
                for job, idx in zip(jobs, ids):
                    scatter_layer(job.slot[li, job.offset : job.offset + len(job.block_ids)], layer, idx)

            self.stream.run(work)
            self._events[name] = self.stream.record()
        self._last = self.stream.record()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Order the compute stream after ``layer_name``'s copies (no-op for a layer with none)."""
        event = self._events.pop(layer_name, None)
        if event is not None:
            event.block_compute()

    def finish(self) -> None:
        """Host-wait for every copy of this load (then its host slots may be released)."""
        last, self._last = self._last, None
        for event in self._events.values():  # layers the forward never asked for
            event.block_compute()
        self._events.clear()
        if last is not None:
            last.synchronize()


class LayerwiseSaver:
    """Engine blocks -> host slots, one layer at a time on ``stream``. Not thread-safe."""

    def __init__(self, kv: RegisteredKV, stream: CopyStream):
        self.kv = kv
        self.stream = stream
        self._jobs: list[ChunkJob] = []
        self._ids: list["torch.Tensor"] = []
        self._saved: set[int] = set()

    @property
    def pending(self) -> bool:
        return bool(self._jobs)

    def start(self, jobs: list[ChunkJob]) -> None:
        """Take this step's chunks to save (copies are issued by :meth:`save_layer`/:meth:`finish`).

        Raises:
            RuntimeError: the previous save was not finished.
            IndexError / ValueError: as :meth:`LayerwiseLoader.start`.
        """
        if self._jobs:
            raise RuntimeError("LayerwiseSaver.start before finish of the previous save")
        host_ids = _ids(self.kv, jobs)
        dev = self.kv.device
        self._ids = []
        self.stream.run(lambda: self._ids.extend(i.to(dev, non_blocking=True) for i in host_ids))
        self._jobs = list(jobs)
        self._saved = set()

    def save_layer(self, layer_name: str) -> None:
        """Issue ``layer_name``'s gathers after the compute stream's work so far (unknown layer: no-op)."""
        if not self._jobs or layer_name not in self.kv.names:
            return
        li = self.kv.layer_index(layer_name)
        if li in self._saved:
            return
        self._saved.add(li)
        self.stream.wait_compute()
        layer = self.kv.layers[li]

        def work() -> None:
            for job, idx in zip(self._jobs, self._ids):
                gather_layer(layer, idx, job.slot[li, job.offset : job.offset + len(job.block_ids)])

        self.stream.run(work)

    def finish(self) -> list[ChunkJob]:
        """Copy the layers not saved yet, host-wait for all copies; returns the jobs (slots filled)."""
        jobs = self._jobs
        try:
            for name in self.kv.names:
                self.save_layer(name)
            if jobs:
                self.stream.record().synchronize()
        finally:
            self._jobs, self._ids, self._saved = [], [], set()
        return jobs
