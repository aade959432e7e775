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

The gather/scatter functions themselves live in :mod:`kvtier.service.block_copy`
(a lower layer, so the cache service's copies by block id lay slots out the
same way); they are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kvtier.service.block_copy import check_ids, gather, gather_layer, scatter, scatter_layer

__all__ = ["ChunkGather", "check_ids", "gather", "gather_layer", "plan_chunks", "scatter", "scatter_layer"]

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
