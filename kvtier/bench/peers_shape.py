"""What both sides of ``kvtier bench peers`` share: the KV shape of a figure, its data, a timer.

kvtier's side (:mod:`kvtier.bench.peers_side`) and the physical baselines
(:mod:`kvtier.bench.peers_baseline`) time the same bytes the same way; the helpers live here so that
neither module imports the other (they were an import cycle, issue 25).
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np


def timed(fn: Callable[[], None]) -> float:
    """Seconds ``fn()`` took (``time.perf_counter``)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Shape:
    """A figure's KV shape from its options: ``L`` layers, ``H`` KV heads of ``D`` dims (``HD = H * D``),
    ``CH``-token chunks, ``T`` tokens; ``sizes`` (tokens per chunk), ``chunk_bytes`` and ``nbytes``
    (bf16, K and V) in bytes."""

    def __init__(self, a: argparse.Namespace):
        self.L, self.H, self.D, self.CH, self.T = a.layers, a.kv_heads, a.head_dim, a.chunk, a.tokens
        self.HD = self.H * self.D
        self.sizes = [min(self.CH, self.T - i) for i in range(0, self.T, self.CH)]
        self.chunk_bytes = 2 * self.L * self.CH * self.HD * 2
        self.nbytes = 2 * self.L * self.T * self.HD * 2


def kv_pair(s: Shape, seed: int = 1234) -> tuple[np.ndarray, np.ndarray]:
    """(kv zeros, src random) as uint16 ``[2, L, T, H*D]`` (bf16 bit patterns)."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 1 << 16, size=(2, s.L, s.T, s.HD), dtype=np.uint16)
    return np.zeros_like(src), src


__all__ = ["Shape", "kv_pair", "timed"]
