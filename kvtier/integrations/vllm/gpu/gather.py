"""Block-gather planning and the device-agnostic gather/scatter of engine blocks.

A request's engine blocks ``block_ids`` (block ``j`` holds tokens
``[j * block_size, (j + 1) * block_size)``) split into kvtier chunks of
``chunk_tokens`` tokens, ``blocks_per_chunk = chunk_tokens // block_size`` blocks
each. A :class:`ChunkGather` names one chunk's engine blocks as an ``int64`` index
tensor on the KV's device; ``gather`` / ``scatter`` move those blocks between the
engine's strided ``uint8 [B, H, N, C]`` layer views (see :mod:`.layout`) and a chunk
slot ``uint8 [L, blocks_per_chunk, page_bytes]`` with one ``index_select`` /
``index_copy_`` per layer (or one for all layers with a stacked view) on whatever
device the KV lives; host<->device moves are ``Tensor.copy_(non_blocking=True)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(frozen=True)
class ChunkGather:
    """One chunk's blocks: ``block_ids[j]`` <-> slot position ``offset + j``.

    Attributes:
        chunk: index of the chunk in the request (0 = tokens ``[0, chunk_tokens)``).
        block_ids: engine block ids, in token order.
        offset: first slot position (blocks) the ids map to (> 0 for a partly loaded chunk).
    """

    chunk: int
    block_ids: tuple[int, ...]
    offset: int = 0

    def index(self, device: "torch.device | str" = "cpu") -> "torch.Tensor":
        """The block ids as ``int64 [len(block_ids)]`` on ``device``."""
        import torch

        return torch.tensor(self.block_ids, dtype=torch.int64, device=device)


def plan_chunks(block_ids: Sequence[int], chunk_tokens: int, block_size: int, num_tokens: int,
                first_token: int = 0) -> list[ChunkGather]:
    """The full chunks of ``[first_token, num_tokens)`` of a request, as block gathers.

    Only chunks that end at or before ``num_tokens`` are planned (kvtier stores full
    chunks); ``first_token`` may fall inside a chunk (its earlier blocks are skipped,
    ``offset`` says where the rest go in the slot) but must be block aligned.

    Raises:
        ValueError: ``chunk_tokens`` not a positive multiple of ``block_size``;
            ``first_token`` not block aligned or negative; too few block ids for
            ``num_tokens``; duplicate block ids.
    """
    if block_size <= 0 or chunk_tokens <= 0 or chunk_tokens % block_size:
        raise ValueError(f"chunk_tokens {chunk_tokens} must be a positive multiple of block_size {block_size}")
    if first_token < 0 or first_token % block_size:
        raise ValueError(f"first_token {first_token} must be a non-negative multiple of block_size {block_size}")
    if len(block_ids) * block_size < num_tokens:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} tokens cannot hold {num_tokens} tokens")
    if len(set(block_ids)) != len(block_ids):
        raise ValueError("duplicate block ids in one request")
    bpc = chunk_tokens // block_size
    out = []
    for c in range(first_token // chunk_tokens, num_tokens // chunk_tokens):
        lo = max(c * bpc, first_token // block_size)
        out.append(ChunkGather(c, tuple(int(b) for b in block_ids[lo : (c + 1) * bpc]), lo - c * bpc))
    return out


def check_ids(ids: "torch.Tensor", num_blocks: int) -> None:
    """Raise IndexError for an id outside ``[0, num_blocks)``, ValueError for duplicates (CPU check)."""
    values = ids.tolist()
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
