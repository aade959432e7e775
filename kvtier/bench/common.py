"""Helpers shared by kvtier's benchmarks: the reference KV shape, an engine-like
paged KV buffer, the connector's chunk copies, interleaved timing and the report.

Benchmarks compare kvtier with a plain baseline measured side by side in the
same process, repetitions interleaved (A, B, B, A, A, B, ...) and summarised by
their medians, because absolute figures swing on a shared machine (single-run
ratios moved by up to 20% between runs on the 2-vCPU development VM). Only ratios are judged.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from kvtier.integrations.block_copy import load_blocks, save_blocks

from kvtier.index.keys import KeyNamespace, LayoutSignature

class BenchUsageError(Exception):
    """A bench cannot run as asked (bad flag, unreachable target); the message names the flag or URL.

    The CLI prints it as one line and exits with code 2 (0: every target met,
    1: a target missed, 2: usage error).
    """


#: vLLM's CPU backend block size (tokens).
BLOCK_SIZE = 128
#: kvtier's default chunk size (tokens).
CHUNK_SIZE = 256


def smollm2_layout() -> LayoutSignature:
    """SmolLM2-135M's KV: 30 layers, 3 KV heads, head dim 64, bf16, 128-token blocks.

    23,040 bytes per token; 98,304 bytes per layer-block; 5,898,240 bytes per 256-token chunk.
    """
    return LayoutSignature(
        engine="bench",
        attn_backend="numpy",
        kv_layout="LBHNC",
        block_size=BLOCK_SIZE,
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        dtype="bfloat16",
    )


def smollm2_namespace(chunk_size: int = CHUNK_SIZE) -> KeyNamespace:
    return KeyNamespace("bench/SmolLM2-135M", smollm2_layout(), chunk_size)


class PagedKV:
    """An engine-like paged KV cache: one storage, a ``uint8 [num_blocks, block_bytes]`` view per layer.

    Mirrors what ``kvtier.integrations.vllm_layout.paged_views`` returns for
    vLLM's CPU backend (all layers are views of one allocation). The storage is
    written once (pre-touched), like an engine's KV cache after warm-up.

    Args:
        layout: KV layout (layers, heads, head dim, dtype, block size).
        num_blocks: blocks per layer.
        seed: seed of the random block contents.
    """

    def __init__(self, layout: LayoutSignature, num_blocks: int, seed: int = 0):
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_bytes = layout.num_kv_heads * layout.block_size * 2 * layout.head_dim * layout.itemsize
        rng = np.random.default_rng(seed)
        # Placed like vLLM's CPU KV tensor (torch's allocator: 64 bytes past a page
        # boundary, measured), since memcpy speed depends on src/dst relative alignment.
        self.storage = aligned_empty((layout.num_layers, num_blocks, self.block_bytes), ENGINE_KV_PAGE_OFFSET)
        self.storage[...] = rng.integers(0, 256, size=self.storage.shape, dtype=np.uint8)
        self.layers: list[np.ndarray] = [self.storage[i] for i in range(layout.num_layers)]

    def random_blocks(self, n: int, seed: int) -> list[int]:
        """``n`` distinct block ids in random order (an engine's block table is not sorted)."""
        if n > self.num_blocks:
            raise ValueError(f"{n} blocks requested, buffer has {self.num_blocks}")
        rng = np.random.default_rng(seed)
        return [int(b) for b in rng.permutation(self.num_blocks)[:n]]


#: Where vLLM's CPU KV tensor starts relative to a 4 KiB page (bytes), as observed.
ENGINE_KV_PAGE_OFFSET = 64


def aligned_empty(shape: tuple[int, ...], page_offset: int = 0) -> np.ndarray:
    """An uninitialised uint8 array starting ``page_offset`` bytes past a 4 KiB boundary."""
    n = int(np.prod(shape))
    raw = np.empty(n + 8192, dtype=np.uint8)
    off = ((-raw.ctypes.data) % 4096 + page_offset) % 4096
    return raw[off : off + n].reshape(shape)


def chunk_view(buf: np.ndarray, num_layers: int, blocks_per_chunk: int) -> np.ndarray:
    """A chunk slot as ``uint8 [num_layers, blocks_per_chunk, block_bytes]`` (no copy)."""
    return buf.reshape(num_layers, blocks_per_chunk, -1)


def save_chunk_blocks(layers: Sequence[np.ndarray], dst: np.ndarray, block_ids: Sequence[int]) -> None:
    """The connector's save copy (shared code: kvtier.integrations.block_copy.save_blocks)."""
    save_blocks(layers, dst, block_ids)


def load_chunk_blocks(src: np.ndarray, layers: Sequence[np.ndarray], block_ids: Sequence[int], offset: int = 0) -> None:
    """The connector's load copy (shared code: kvtier.integrations.block_copy.load_blocks)."""
    load_blocks(src, layers, block_ids, offset)


# -- timing ---------------------------------------------------------------------------
class CacheEvictor:
    """Writes a buffer several times the last-level cache, so no run starts with its data cached.

    Without it a baseline whose buffer the previous run just wrote reads from L3
    (32 MiB on the reference VM) while kvtier's slots come from DRAM, which
    skews ratios of copies of tens of MB by 10% or more.

    Args:
        nbytes: bytes to write per eviction (default 96 MiB).
    """

    def __init__(self, nbytes: int = 96 << 20):
        self._buf = np.ones(nbytes, dtype=np.uint8)

    def __call__(self) -> None:
        self._buf += 1


def interleaved(
    runs: dict[str, Callable[[], float]], reps: int, before_each: Callable[[], None] | None = None
) -> dict[str, list[float]]:
    """Run each callable ``reps`` times, interleaved in ABBA order; returns their samples.

    Each callable does its own untimed set-up and returns the seconds of its timed part.
    One unrecorded warm-up run of each comes first. ``before_each`` (untimed) runs
    before every call, e.g. a :class:`CacheEvictor`.
    """
    names = list(runs)
    prep = before_each or (lambda: None)
    for name in names:
        prep()
        runs[name]()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            prep()
            samples[name].append(runs[name]())
    return samples


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def gbps(nbytes: int, seconds: float) -> float:
    """Bandwidth in GB/s (10^9 bytes per second)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.s`` holds the elapsed seconds (perf_counter)."""

    s: float = 0.0

    def __enter__(self) -> "Stopwatch":
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self._t0


# -- report ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Check:
    """One judged figure.

    Attributes:
        name: what is measured.
        measured: the figure.
        target: the bound.
        higher_is_better: True if ``measured >= target`` passes, else ``measured <= target``.
        unit: printed after the numbers.
        note: short context (e.g. the absolute speeds behind a ratio).
    """

    name: str
    measured: float
    target: float
    higher_is_better: bool
    unit: str = ""
    note: str = ""

    @property
    def passed(self) -> bool:
        if self.higher_is_better:
            return self.measured >= self.target
        return self.measured <= self.target


def _fmt(x: float) -> str:
    if x == 0 or 0.01 <= abs(x) < 1e5:
        return f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"
    return f"{x:.3g}"


def print_checks(title: str, checks: Sequence[Check]) -> None:
    """A rich table: name, target, measured, pass/FAIL, note."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("figure", "target", "measured", "result", "note"):
        table.add_column(col, justify="right" if col in ("target", "measured") else "left")
    for c in checks:
        bound = (">= " if c.higher_is_better else "<= ") + _fmt(c.target) + (f" {c.unit}" if c.unit else "")
        got = _fmt(c.measured) + (f" {c.unit}" if c.unit else "")
        result = "[green]pass[/green]" if c.passed else "[red]FAIL[/red]"
        table.add_row(c.name, bound, got, result, c.note)
    console = Console()
    Console(width=max(console.width, 130)).print(table)


def write_json(path: Path | None, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON to ``path`` (parents created); nothing if ``path`` is None."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
