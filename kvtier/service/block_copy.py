"""Device-agnostic gather/scatter of paged KV blocks, and the copy stream that runs them.

Shared by the cache service's copies addressed by engine block id
(:mod:`kvtier.service.kv_ops`) and the vLLM worker's GPU path
(:mod:`kvtier.integrations.vllm.gpu.gather` re-exports these), so both lay a
chunk slot out the same way.

An engine layer is a ``uint8 [B, H, N, C]`` view (blocks, head slots, tokens per
block, content bytes; any strides, C contiguous) on any torch device. A chunk
slot is ``uint8 [L, k, page_bytes]`` with ``page_bytes = H * N * C``: for each
layer, the ``k`` blocks' bytes in logical ``[H, N, C]`` order (what
``index_select`` on dim 0 of a layer view returns). Each move is one
``index_select`` / ``index_copy_`` per layer (or one for all layers with a
stacked ``[L, B, H, N, C]`` view); host<->device moves are
``Tensor.copy_(non_blocking=True)``, so the caller synchronizes its stream
(:class:`CopyRunner` does) before reading or freeing the slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch


def check_ids(ids: "torch.Tensor | Sequence[int]", num_blocks: int) -> None:
    """Raise IndexError for an id outside ``[0, num_blocks)``, ValueError for duplicates (a CPU check).

    Args:
        ids: block ids, an ``int64`` tensor (any device) or a sequence of ints.
        num_blocks: B, the number of blocks of each engine layer.
    """
    values = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    bad = [b for b in values if not 0 <= b < num_blocks]
    if bad:
        raise IndexError(f"block ids {bad[:4]} outside the KV cache [0, {num_blocks})")
    if len(set(values)) != len(values):
        raise ValueError("duplicate block ids (a scatter would be order dependent)")


def gather_layer(layer: "torch.Tensor", ids: "torch.Tensor", out: "torch.Tensor") -> None:
    """Copy blocks ``ids`` of one layer ``uint8 [B, H, N, C]`` into ``out`` ``uint8 [k, page_bytes]``.

    ``out`` may be on another device (e.g. pinned host memory): the copy is
    ``non_blocking``, so the caller synchronizes its stream before reading ``out``.
    """
    out.copy_(layer.index_select(0, ids).reshape(ids.numel(), -1), non_blocking=True)


def scatter_layer(src: "torch.Tensor", layer: "torch.Tensor", ids: "torch.Tensor") -> None:
    """Copy ``src`` ``uint8 [k, page_bytes]`` (any device) into blocks ``ids`` of one layer ``[B, H, N, C]``."""
    staged = src.to(layer.device, non_blocking=True).reshape(ids.numel(), *layer.shape[1:])
    layer.index_copy_(0, ids, staged)


def gather(layers: Sequence["torch.Tensor"], stacked: "torch.Tensor | None", ids: "torch.Tensor",
           out: "torch.Tensor") -> None:
    """Blocks ``ids`` of every layer into ``out`` ``uint8 [L, k, page_bytes]`` (stacked: one op)."""
    if stacked is not None:
        out.copy_(stacked.index_select(1, ids).reshape(out.shape), non_blocking=True)
        return
    for i, layer in enumerate(layers):
        gather_layer(layer, ids, out[i])


def scatter(src: "torch.Tensor", layers: Sequence["torch.Tensor"], stacked: "torch.Tensor | None",
            ids: "torch.Tensor") -> None:
    """``src`` ``uint8 [L, k, page_bytes]`` into blocks ``ids`` of every layer (stacked: one op)."""
    if stacked is not None:
        staged = src.to(stacked.device, non_blocking=True).reshape(stacked.shape[0], ids.numel(), *stacked.shape[2:])
        stacked.index_copy_(1, ids, staged)
        return
    for i, layer in enumerate(layers):
        scatter_layer(src[i], layer, ids)


class CopyRunner:
    """Runs copy work on a dedicated CUDA stream and waits for its event; on CPU, runs it inline.

    Args:
        device: the engine KV's torch device. ``cuda``: a new ``torch.cuda.Stream``
            on it; any other device: the work runs synchronously on the caller's thread.
    """

    def __init__(self, device: "torch.device"):
        import torch

        self.device = device
        self.stream: Any = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def run(self, work: Callable[[], None]) -> None:
        """Issue ``work`` on the copy stream and block until it has completed (``cudaEventSynchronize``).

        Raises whatever ``work`` raises (copies issued before the error are waited for).
        """
        if self.stream is None:
            work()
            return
        import torch

        try:
            with torch.cuda.stream(self.stream):
                work()
        finally:
            event = torch.cuda.Event()
            event.record(self.stream)
            event.synchronize()
