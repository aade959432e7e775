"""Copies between a ``DynamicCache`` and kvtier chunk payloads (layout ``L2HTD``, see :mod:`.layout`).

A payload is a ``uint8 [chunk_bytes]`` numpy buffer; viewed in the model's dtype it is
``[num_layers, 2, num_kv_heads, chunk_size, head_dim]``. Copies go through torch views
of the buffer (no temporary), one ``copy_`` per layer and K/V.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.index.keys import KeyNamespace


def chunk_view(buf: np.ndarray, ns: KeyNamespace, dtype: torch.dtype) -> torch.Tensor:
    """``buf`` (uint8 ``[chunk_bytes]``) as ``dtype [L, 2, H, C, D]`` sharing its memory.

    A read-only buffer gives a tensor that must not be written (torch warns about it
    once; the warning is silenced here because readers only copy out of it).

    Raises:
        ValueError: ``buf`` is not ``chunk_bytes`` long.
    """
    if buf.nbytes != ns.chunk_bytes:
        raise ValueError(f"chunk buffer has {buf.nbytes} bytes, expected {ns.chunk_bytes}")
    lay = ns.layout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(buf.reshape(-1))
    return raw.view(dtype).view(lay.num_layers, 2, lay.num_kv_heads, ns.chunk_size, lay.head_dim)


def save_chunk(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], row: int, start: int, out: torch.Tensor) -> None:
    """Copy positions ``[start, start + C)`` of batch row ``row`` of every layer into ``out``.

    Args:
        layers: per layer ``(keys, values)``, each ``[batch, H, seq, D]``.
        out: a :func:`chunk_view` ``[L, 2, H, C, D]``.

    Raises:
        ValueError: the range runs past the cached sequence.
    """
    c = out.shape[3]
    for i, (k, v) in enumerate(layers):
        if start + c > k.shape[2]:
            raise ValueError(f"chunk [{start}, {start + c}) past the {k.shape[2]} cached positions")
        out[i, 0].copy_(k[row, :, start : start + c])
        out[i, 1].copy_(v[row, :, start : start + c])


def load_chunk(src: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               row: int, start: int, ntokens: int) -> None:
    """Copy the first ``ntokens`` tokens of chunk ``src`` ``[L, 2, H, C, D]`` into positions
    ``[start, start + ntokens)`` of batch row ``row`` of per-layer ``keys``/``values`` ``[B, H, S, D]``."""
    for i, (k, v) in enumerate(zip(keys, values)):
        k[row, :, start : start + ntokens].copy_(src[i, 0, :, :ntokens])
        v[row, :, start : start + ntokens].copy_(src[i, 1, :, :ntokens])
