"""Copies between an engine's paged KV blocks and a kvtier chunk slot.

A chunk slot is ``uint8 [num_layers, blocks_per_chunk, block_bytes]``; the engine's
KV is one ``uint8 [num_blocks, block_bytes]`` view per layer (see
``vllm_layout.paged_views``). Each (layer, block) pair is one contiguous run of
``block_bytes`` (98,304 B for SmolLM2 on vLLM's CPU backend), so the copy is one
``np.copyto`` per run: a straight memcpy into pre-touched memory, single-threaded
(torch's intra-op threads made strided chunk copies ~15x slower on 2 vCPUs, see
shared notes/baselines.md), with no temporary (``np.take(out=...)`` in its default
mode and fancy-index assignment both copy through one).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def _check(block_ids: Sequence[int], num_blocks: int) -> None:
    for b in block_ids:
        if not 0 <= b < num_blocks:  # a negative id would silently wrap around
            raise IndexError(f"block id {b} outside the KV cache [0, {num_blocks})")


def save_blocks(layers: Sequence[np.ndarray], chunk: np.ndarray, block_ids: Sequence[int]) -> None:
    """Copy engine blocks ``block_ids`` of every layer into ``chunk[:, :len(block_ids)]``.

    Raises:
        IndexError: a block id outside the KV cache.
    """
    if layers:
        _check(block_ids, layers[0].shape[0])
    for layer, out in zip(layers, chunk):
        for j, b in enumerate(block_ids):
            np.copyto(out[j], layer[b])


def load_blocks(chunk: np.ndarray, layers: Sequence[np.ndarray], block_ids: Sequence[int], offset: int = 0) -> None:
    """Copy ``chunk[:, offset + j]`` into engine block ``block_ids[j]`` of every layer.

    Raises:
        IndexError: a block id outside the KV cache.
    """
    if layers:
        _check(block_ids, layers[0].shape[0])
    for src, layer in zip(chunk, layers):
        for j, b in enumerate(block_ids):
            np.copyto(layer[b], src[offset + j])
