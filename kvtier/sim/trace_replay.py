"""Single-cache replay of a Mooncake-format trace through every eviction policy at once.

The trace is streamed (:func:`kvtier.storage.trace_file.iter_trace`): each request's chunk
keys are made once (:class:`kvtier.sim.blocks.BlockKeyer`, kvtier's real key chain) and fed
to one simulated tier per (policy, capacity) (:func:`kvtier.sim.replay.step`), so memory is
the tiers' keys, the bounded key map and one request, whatever the trace's length. The
ceilings run on integer chunk ids (``hash_id * blocks_per_chunk + i``): the unbounded cache
(a bitmap of ids) and Belady's MIN (:mod:`kvtier.sim.belady`; 12 bytes per reference, off
with ``belady=False``).

Hit rate here is the chunk hit rate (the fraction of chunk references that hit, the Mooncake
figures' "fraction of block references"); token hit rates are in the JSON too.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from kvtier.sim.belady import CeilingStats, IdRequest, belady, unbounded
from kvtier.sim.blocks import BlockKeyer
from kvtier.sim.replay import SimStats, SimTier, step
from kvtier.storage.trace_file import TraceRecord, iter_trace
from kvtier.tiers.policies import POLICIES, make_policy

#: Capacities of the issue's table, in tokens.
DEFAULT_CAPACITY_TOKENS = (100_000, 1_000_000, 3_000_000, 10_000_000)


def parse_tokens(text: str) -> int:
    """``"3M"`` -> 3,000,000; ``"100k"`` -> 100,000; plain digits as they are (decimal units).

    Raises:
        ValueError: not a positive whole number with an optional k/M/G suffix.
    """
    t = text.strip()
    mult = {"k": 10**3, "K": 10**3, "m": 10**6, "M": 10**6, "g": 10**9, "G": 10**9}.get(t[-1:], 1)
    num = t[:-1] if mult != 1 else t
    try:
        value = float(num) * mult
    except ValueError:
        raise ValueError(f"{text!r} is not a token count (e.g. 100k, 3M)") from None
    if value < 1 or value != int(value):
        raise ValueError(f"{text!r} is not a positive whole number of tokens")
    return int(value)


@dataclass
class TraceReplayReport:
    """Everything one trace replay measured (JSON via :meth:`as_dict`)."""

    trace: str
    mode: str
    block_size: int
    chunk_size: int
    requests: int
    input_tokens: int
    chunk_refs: int
    capacities_tokens: list[int]
    capacities_chunks: list[int]
    results: dict[str, dict[int, SimStats]]
    unbounded: CeilingStats
    belady: dict[int, CeilingStats] | None
    elapsed_s: float
    max_rss_bytes: int
    hashed_blocks: int = 0
    notes: list[str] = field(default_factory=list)

    def rate(self, policy: str, cap_tokens: int) -> float:
        """Chunk hit rate of ``policy`` at ``cap_tokens``."""
        return self.results[policy][self._chunks(cap_tokens)].chunk_hit_rate

    def belady_rate(self, cap_tokens: int) -> float | None:
        if self.belady is None:
            return None
        return self.belady[self._chunks(cap_tokens)].chunk_hit_rate

    def _chunks(self, cap_tokens: int) -> int:
        return self.capacities_chunks[self.capacities_tokens.index(cap_tokens)]

    def best_policy(self, exclude: Sequence[str] = ()) -> str:
        """The policy with the highest mean hit rate over the capacities (ties: first listed)."""
        names = [p for p in self.results if p not in exclude]
        return max(names, key=lambda p: sum(s.chunk_hit_rate for s in self.results[p].values()))

    def as_dict(self) -> dict:
        caps = list(zip(self.capacities_tokens, self.capacities_chunks))
        return {
            "trace": self.trace, "mode": self.mode, "block_size": self.block_size, "chunk_size": self.chunk_size,
            "requests": self.requests, "input_tokens": self.input_tokens, "chunk_refs": self.chunk_refs,
            "capacities_tokens": self.capacities_tokens, "capacities_chunks": self.capacities_chunks,
            "hit_rate": {p: {str(t): self.results[p][c].chunk_hit_rate for t, c in caps} for p in self.results},
            "belady_hit_rate": None if self.belady is None else
            {str(t): self.belady[c].chunk_hit_rate for t, c in caps},
            "unbounded_hit_rate": self.unbounded.chunk_hit_rate,
            "best_policy": self.best_policy(),
            "results": {p: {str(t): self.results[p][c].as_dict() for t, c in caps} for p in self.results},
            "belady": None if self.belady is None else {str(t): self.belady[c].as_dict() for t, c in caps},
            "unbounded": self.unbounded.as_dict(),
            "elapsed_s": self.elapsed_s, "max_rss_bytes": self.max_rss_bytes, "hashed_blocks": self.hashed_blocks,
            "notes": self.notes,
        }


def chunk_ids(rec: TraceRecord, keyer: BlockKeyer) -> IdRequest:
    """``(hit limit, chunk ids)`` of ``rec`` as the ceilings see it (same chunks as ``keyer.keys``)."""
    k = keyer.per_block
    if keyer.mode == "engine":
        n = rec.input_length // keyer.chunk_size
        limit = max(0, (rec.input_length - 1) // keyer.chunk_size)
    else:
        n = len(rec.hash_ids) * k
        limit = n
    ids = [h * k + i for h in rec.hash_ids[: -(-n // k)] for i in range(k)][:n]
    return min(limit, n), ids


def _hit_limit(rec: TraceRecord, keyer: BlockKeyer, n_keys: int) -> int:
    if keyer.mode == "engine":
        return min(n_keys, max(0, (rec.input_length - 1) // keyer.chunk_size))
    return n_keys


def replay_trace(
    path: str | os.PathLike[str],
    capacities_tokens: Sequence[int] = DEFAULT_CAPACITY_TOKENS,
    policies: Sequence[str] | None = None,
    block_size: int = 512,
    chunk_size: int | None = None,
    mode: str = "every-block",
    with_belady: bool = True,
    max_requests: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> TraceReplayReport:
    """Replay a trace file through each policy at each capacity, with the two ceilings.

    Args:
        path: a Mooncake-format JSONL trace.
        capacities_tokens: cache capacities in tokens (each at least one chunk).
        policies: names in ``POLICIES`` (default: all).
        block_size: the trace's tokens per hash id.
        chunk_size: kvtier chunk (default: the block size; must divide it).
        mode: ``every-block`` or ``engine`` (:mod:`kvtier.sim.blocks`).
        with_belady: also run Belady's MIN (12 bytes of memory per chunk reference).
        max_requests: stop after this many requests (None: the whole trace).
        progress: called with a line of text at each stage.

    Raises:
        TraceFormatError: a malformed line (named by line and field).
        ValueError: an unknown policy or mode, a capacity below one chunk, a bad chunk size.
        OSError: the file cannot be read.
    """
    start = time.perf_counter()
    say = progress or (lambda s: None)
    chunk = chunk_size or block_size
    policies = list(policies or POLICIES)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown eviction policy {unknown[0]!r}; choose from {', '.join(POLICIES)}")
    keyer = BlockKeyer(chunk, block_size, mode)
    caps = [int(t) // chunk for t in capacities_tokens]
    if any(c < 1 for c in caps):
        raise ValueError(f"every capacity must hold at least one {chunk}-token chunk, got {list(capacities_tokens)}")

    def records() -> Iterator[TraceRecord]:
        for i, rec in enumerate(iter_trace(path, block_size)):
            if max_requests is not None and i >= max_requests:
                return
            yield rec

    tiers = {(p, c): SimTier(c, make_policy(p), SimStats(p, c)) for p in policies for c in caps}
    n_req = n_tokens = 0
    for rec in records():
        keys = keyer.keys(rec)
        limit = _hit_limit(rec, keyer, len(keys))
        for (p, c), tier in tiers.items():
            hits = step(tier, rec.input_length, keys, limit)
            tier.stats.hit_tokens += min(hits * chunk, rec.input_length)
        n_req += 1
        n_tokens += rec.input_length
        if n_req % 2000 == 0:
            say(f"{n_req:,} requests replayed through {len(tiers)} caches")
    say("unbounded ceiling")
    ceiling = unbounded(chunk_ids(r, keyer) for r in records())
    bel = None
    notes: list[str] = []
    if with_belady:
        say("Belady's MIN")
        try:
            bel = belady(lambda: (chunk_ids(r, keyer) for r in records()), caps)
        except ValueError as exc:
            notes.append(f"belady skipped: {exc}")
    results: dict[str, dict[int, SimStats]] = {p: {c: tiers[(p, c)].stats for c in caps} for p in policies}
    return TraceReplayReport(
        trace=Path(path).name, mode=mode, block_size=block_size, chunk_size=chunk, requests=n_req,
        input_tokens=n_tokens, chunk_refs=ceiling.chunk_refs, capacities_tokens=[int(t) for t in capacities_tokens],
        capacities_chunks=caps, results=results, unbounded=ceiling, belady=bel,
        elapsed_s=time.perf_counter() - start, max_rss_bytes=max_rss_bytes(), hashed_blocks=keyer.hashed_blocks,
        notes=notes,
    )


def max_rss_bytes() -> int:
    """Peak resident set size of this process so far (bytes; Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def write_plot(rep: TraceReplayReport, png: Path) -> None:
    """Hit rate against capacity: one line per policy, Belady's MIN and the unbounded cache
    as ceilings (needs matplotlib: the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = rep.capacities_tokens
    for p, by in rep.results.items():
        ax.plot(xs, [by[c].chunk_hit_rate for c in rep.capacities_chunks], marker="o", label=p)
    if rep.belady is not None:
        ax.plot(xs, [rep.belady[c].chunk_hit_rate for c in rep.capacities_chunks], "k--", marker="s",
                label="Belady's MIN")
    ax.axhline(rep.unbounded.chunk_hit_rate, color="grey", linestyle=":", label="unbounded")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("fraction of chunk references hit")
    ax.set_title(f"{rep.trace}: {rep.requests:,} requests, {rep.chunk_size}-token chunks ({rep.mode})", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
