"""Copies between an engine's paged KV blocks and a kvtier chunk slot.

A chunk slot is ``uint8 [num_layers, blocks_per_chunk, block_bytes]``; the engine's
KV is either one ``uint8 [num_layers, num_blocks, block_bytes]`` view of all layers
(``vllm_layout.stacked_view``, when layers share one storage) or a list of
``uint8 [num_blocks, block_bytes]`` views, one per layer (``paged_views``). Each
(layer, block) pair is one contiguous run of ``block_bytes`` (98,304 B for SmolLM2
on vLLM's CPU backend). With the stacked view one ``np.copyto`` moves a block of
every layer (few calls, so few GIL hand-offs when a loader thread runs beside the
engine); otherwise one call per run. Either way a straight memcpy into pre-touched
memory, single-threaded
(torch's intra-op threads made strided chunk copies ~15x slower on 2 vCPUs, see
shared notes/baselines.md), with no temporary (``np.take(out=...)`` in its default
mode and fancy-index assignment both copy through one).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import numpy as np
import xxhash

from kvtier.storage.types import ChunkUnavailable

#: The engine's KV: a stacked ``[num_layers, num_blocks, block_bytes]`` view or per-layer views.
PagedKV = Union[np.ndarray, Sequence[np.ndarray]]


def _check(block_ids: Sequence[int], num_blocks: int) -> None:
    for b in block_ids:
        if not 0 <= b < num_blocks:  # a negative id would silently wrap around
            raise IndexError(f"block id {b} outside the KV cache [0, {num_blocks})")


def save_blocks(kv: PagedKV, chunk: np.ndarray, block_ids: Sequence[int]) -> None:
    """Copy engine blocks ``block_ids`` of every layer into ``chunk[:, :len(block_ids)]``.

    Raises:
        IndexError: a block id outside the KV cache.
    """
    if isinstance(kv, np.ndarray) and kv.ndim == 3:
        _check(block_ids, kv.shape[1])
        for j, b in enumerate(block_ids):
            np.copyto(chunk[:, j], kv[:, b])
        return
    if kv:
        _check(block_ids, kv[0].shape[0])
    for layer, out in zip(kv, chunk):
        for j, b in enumerate(block_ids):
            np.copyto(out[j], layer[b])


def _copy_checked(chunk: np.ndarray, layers: Sequence[np.ndarray], maps: Sequence[dict[int, int]],
                  expected: int) -> bool:
    """Copy ``chunk[l, j]`` into ``layers[l][maps[l][j]]`` for every mapped run, hashing the whole
    slot in slot order (layer, then block) as it goes: a copied run from its destination right
    after the copy wrote it, an unmapped one from the slot. True if the hash is ``expected``."""
    h = xxhash.xxh3_64()
    for src, layer, to in zip(chunk, layers, maps):
        for j in range(src.shape[0]):
            b = to.get(j)
            if b is not None:
                dst = layer[b]
                np.copyto(dst, src[j])
                h.update(dst)  # the bytes the engine got: a scribble undone after the copy is still seen
            else:
                h.update(src[j])
    for src in chunk[len(layers):]:  # (a slot with more layers than the KV: hashed, not copied)
        h.update(src)
    return h.intdigest() == expected


def load_blocks_checked(
    chunk: np.ndarray, kv: PagedKV, block_ids: Sequence[int], offset: int, expected: int
) -> bool:
    """:func:`load_blocks`, checking the chunk against ``expected`` (the xxh3-64 of its whole slot)
    as it copies: in slot order (layer, then block), each copied run is hashed from its
    destination right after the copy wrote it, while it is still in the CPU cache, so the check
    adds no pass over memory and covers exactly the bytes the engine received (runs the load
    does not need are hashed from the slot: the checksum covers the whole slot). The blocks are
    written before the verdict: on False the caller treats them as unfilled (recomputed).

    Returns:
        True if the slot's bytes matched ``expected``.

    Raises:
        IndexError: a block id outside the KV cache.
    """
    layers: Sequence[np.ndarray] = [kv[i] for i in range(kv.shape[0])] if isinstance(kv, np.ndarray) and kv.ndim == 3 \
        else list(kv)
    if layers:
        _check(block_ids, layers[0].shape[0])
    to = {offset + j: b for j, b in enumerate(block_ids)}
    return _copy_checked(chunk, layers, [to] * len(layers), expected)


def load_blocks_grouped_checked(chunk: np.ndarray, layers: Sequence[np.ndarray], layer_groups: Sequence[int],
                                ids_by_group: Sequence[Sequence[int]], offset: int, skip: int | None,
                                expected: int) -> bool:
    """:func:`load_blocks_grouped`, checked as :func:`load_blocks_checked` checks (hybrid models).

    Returns:
        True if the slot's bytes matched ``expected``.

    Raises:
        IndexError: a block id outside the KV cache.
    """
    if layers:
        for ids in ids_by_group:
            _check([b for b in ids if b != skip], layers[0].shape[0])
    by_group = [{offset + j: b for j, b in enumerate(ids) if b != skip} for ids in ids_by_group]
    return _copy_checked(chunk, layers, [by_group[g] for g in layer_groups[: len(layers)]], expected)


def _load_verified(handle: Any, view: Callable[[np.ndarray], np.ndarray], plain: Callable[[np.ndarray], None],
                   checked: Callable[[np.ndarray, int], bool]) -> None:
    """The verification choice of :func:`load_handle` and :func:`load_handle_grouped`."""
    beside = getattr(handle, "check_beside", None)
    if beside is not None and beside():
        # The client's helper thread hashes this chunk while this thread copies it (two cores
        # reading the slot at once), then the copy waits for the verdict. As in the checked copy,
        # the blocks are written first and are unfilled if the verdict is bad.
        plain(view(handle.view))
        handle.buffer  # noqa: B018 - waits for the verdict; ChunkUnavailable on a mismatch
        return
    claim = getattr(handle, "claim", None)
    want = claim() if claim is not None else None
    if want is None:
        plain(view(handle.buffer))
        return
    try:
        ok = checked(view(handle.view), want)
    except BaseException:
        handle.unclaim()  # no verdict: a later reader checks it (never a 10 s wait for this one)
        raise
    handle.settle(ok)
    if not ok:
        raise ChunkUnavailable(f"kvtier: the bytes of chunk {handle.key.hex()[:16]} differ from its commit checksum")


def load_handle(
    handle: Any, view: Callable[[np.ndarray], np.ndarray], kv: PagedKV, block_ids: Sequence[int], offset: int = 0
) -> None:
    """Copy a read handle's chunk into engine blocks ``block_ids`` (``view`` maps its flat slot to
    ``[num_layers, blocks_per_chunk, block_bytes]``). A handle that still carries a checksum to
    check (a ``kvtier server`` client with ``verify="client"``: ``claim()``) is checked as it is
    copied: in the copy itself (:func:`load_blocks_checked`), or by its client's opt-in helper
    thread beside the copy (``check_beside()``; the copy then waits for the verdict); any other
    is copied as it is (``buffer``: verified before, or nothing to verify).

    Raises:
        ChunkUnavailable: the chunk's bytes differ from its commit checksum (its blocks are unfilled).
        IndexError: a block id outside the KV cache.
    """
    _load_verified(handle, view, lambda c: load_blocks(c, kv, block_ids, offset),
                   lambda c, want: load_blocks_checked(c, kv, block_ids, offset, want))


def load_handle_grouped(handle: Any, view: Callable[[np.ndarray], np.ndarray], layers: Sequence[np.ndarray],
                        layer_groups: Sequence[int], ids_by_group: Sequence[Sequence[int]], offset: int = 0,
                        skip: int | None = None) -> None:
    """:func:`load_handle` for hybrid models: :func:`load_blocks_grouped`, checked as it copies
    (:func:`load_blocks_grouped_checked`) where the handle carries a checksum.

    Raises:
        ChunkUnavailable: the chunk's bytes differ from its commit checksum (its blocks are unfilled).
        IndexError: a block id outside the KV cache.
    """
    _load_verified(handle, view, lambda c: load_blocks_grouped(c, layers, layer_groups, ids_by_group, offset, skip),
                   lambda c, want: load_blocks_grouped_checked(c, layers, layer_groups, ids_by_group, offset, skip,
                                                               want))


def load_blocks(chunk: np.ndarray, kv: PagedKV, block_ids: Sequence[int], offset: int = 0) -> None:
    """Copy ``chunk[:, offset + j]`` into engine block ``block_ids[j]`` of every layer.

    Raises:
        IndexError: a block id outside the KV cache.
    """
    if isinstance(kv, np.ndarray) and kv.ndim == 3:
        _check(block_ids, kv.shape[1])
        for j, b in enumerate(block_ids):
            np.copyto(kv[:, b], chunk[:, offset + j])
        return
    if kv:
        _check(block_ids, kv[0].shape[0])
    for src, layer in zip(chunk, kv):
        for j, b in enumerate(block_ids):
            np.copyto(layer[b], src[offset + j])


def save_blocks_grouped(layers: Sequence[np.ndarray], layer_groups: Sequence[int], chunk: np.ndarray,
                        ids_by_group: Sequence[Sequence[int]]) -> None:
    """Hybrid models: copy layer ``l``'s engine blocks ``ids_by_group[layer_groups[l]]`` into
    ``chunk[l, :n]`` (each group has its own block table; every group lists the same positions).

    Raises:
        IndexError: a block id outside the KV cache.
        ValueError: the groups list different numbers of blocks.
    """
    if len({len(ids) for ids in ids_by_group}) > 1:
        raise ValueError(f"groups list {[len(ids) for ids in ids_by_group]} blocks for one chunk")
    if layers:
        for ids in ids_by_group:
            _check(ids, layers[0].shape[0])
    for layer, g, out in zip(layers, layer_groups, chunk):
        for j, b in enumerate(ids_by_group[g]):
            np.copyto(out[j], layer[b])


def load_blocks_grouped(chunk: np.ndarray, layers: Sequence[np.ndarray], layer_groups: Sequence[int],
                        ids_by_group: Sequence[Sequence[int]], offset: int = 0, skip: int | None = None) -> None:
    """Hybrid models: copy ``chunk[l, offset + j]`` into engine block ``ids_by_group[g][j]`` of layer ``l``
    (``g = layer_groups[l]``), leaving out blocks equal to ``skip`` (vLLM's null block: out of a
    sliding window, never read).

    Raises:
        IndexError: a block id outside the KV cache.
    """
    if layers:
        for ids in ids_by_group:
            _check([b for b in ids if b != skip], layers[0].shape[0])
    for src, layer, g in zip(chunk, layers, layer_groups):
        for j, b in enumerate(ids_by_group[g]):
            if b != skip:
                np.copyto(layer[b], src[offset + j])
