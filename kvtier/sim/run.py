"""``kvtier simulate``: token hit rate of each eviction policy at several capacities.

Generates a seeded synthetic trace (:mod:`kvtier.sim.trace`), computes every
prompt's chunk keys once with the real :class:`~kvtier.index.keys.ChunkHasher`,
replays the keys through each policy and capacity (:mod:`kvtier.sim.replay`)
and prints a table of token hit rates, with the unbounded tier as the ceiling.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from kvtier.index.keys import ChunkHasher, KeyNamespace, LayoutSignature
from kvtier.sim.replay import SimStats, replay
from kvtier.sim.trace import TRACES, TraceParams, generate
from kvtier.tiers.policies import POLICIES

#: Default capacities, as fractions of the trace's distinct chunks.
DEFAULT_FRACTIONS = (0.02, 0.05, 0.10, 0.25, 0.50)

# The demo model's KV layout (SmolLM2-135M, bf16), so capacities convert to bytes.
_SIM_LAYOUT = LayoutSignature(
    engine="sim",
    attn_backend="none",
    kv_layout="none",
    block_size=16,
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
    dtype="bfloat16",
)


@dataclass
class SimReport:
    """Everything one ``simulate`` run measured (JSON-ready via :meth:`as_dict`)."""

    trace: str
    seed: int
    chunk_size: int
    chunk_bytes: int
    requests: int
    prompt_tokens: int
    distinct_chunks: int
    capacities: list[int]
    ceiling: SimStats
    results: dict[str, dict[int, SimStats]]
    elapsed_s: float

    def as_dict(self) -> dict:
        return {
            "trace": self.trace,
            "seed": self.seed,
            "chunk_size": self.chunk_size,
            "chunk_bytes": self.chunk_bytes,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "distinct_chunks": self.distinct_chunks,
            "capacities_chunks": self.capacities,
            "ceiling": self.ceiling.as_dict(),
            "results": {
                pol: {str(cap): st.as_dict() for cap, st in by_cap.items()} for pol, by_cap in self.results.items()
            },
            "elapsed_s": self.elapsed_s,
        }


def simulate(
    trace: str = "mixed",
    capacities: Sequence[int] | None = None,
    policies: Sequence[str] | None = None,
    seed: int = 0,
    num_requests: int = 2000,
    chunk_size: int = 256,
    progress: Callable[[str, int, int], None] | None = None,
) -> SimReport:
    """Replay one synthetic trace through each policy at each capacity.

    Args:
        trace: one of ``multi-turn``, ``long-doc``, ``mixed``.
        capacities: tier capacities in chunks (default: :data:`DEFAULT_FRACTIONS`
            of the trace's distinct chunks).
        policies: policy names (default: all of ``POLICIES``).
        seed: trace seed.
        num_requests: prompts in the trace.
        chunk_size: tokens per chunk (a multiple of 16).
        progress: called as ``progress(step, done, total)`` after hashing and
            after each replay (``total`` = 1 + policies * capacities + 1).

    Raises:
        ValueError: unknown trace or policy, capacity below 1, bad chunk size.
    """
    start = time.perf_counter()
    policies = list(policies or POLICIES)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown eviction policy {unknown[0]!r}; choose from {', '.join(POLICIES)}")
    namespace = KeyNamespace(model="kvtier-sim", layout=_SIM_LAYOUT, chunk_size=chunk_size)
    hasher = ChunkHasher(namespace)
    requests = generate(trace, seed, TraceParams(num_requests=num_requests))
    prompts = [(len(r.tokens), hasher.keys(r.tokens)) for r in requests]
    distinct = len({k for _, keys in prompts for k in keys})
    if capacities is None:
        capacities = sorted({max(1, round(f * distinct)) for f in DEFAULT_FRACTIONS})
    capacities = list(capacities)
    bad = [c for c in capacities if c < 1]
    if bad:
        raise ValueError(f"capacities must be at least 1 chunk, got {bad[0]}")
    total = 2 + len(policies) * len(capacities)
    report = progress or (lambda step, done, total: None)
    report(f"{trace}: hashed {len(prompts)} prompts", 1, total)
    ceiling = replay(prompts, chunk_size, policies[0], None)
    report(f"{trace}: unbounded ceiling", 2, total)
    results: dict[str, dict[int, SimStats]] = {}
    for pol in policies:
        results[pol] = {}
        for cap in capacities:
            results[pol][cap] = replay(prompts, chunk_size, pol, cap)
            report(f"{trace}: {pol} at {cap:,} chunks", 2 + sum(map(len, results.values())), total)
    return SimReport(
        trace=trace,
        seed=seed,
        chunk_size=chunk_size,
        chunk_bytes=namespace.chunk_bytes,
        requests=len(requests),
        prompt_tokens=sum(n for n, _ in prompts),
        distinct_chunks=distinct,
        capacities=capacities,
        ceiling=ceiling,
        results=results,
        elapsed_s=time.perf_counter() - start,
    )


def _parse_list(text: str | None, what: str) -> list[str] | None:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"{what}: empty list")
    return items


def _run_with_progress(
    traces: list[str], caps: list[int] | None, pols: list[str] | None, seed: int, num_requests: int, chunk_size: int
) -> list[SimReport]:
    """Each trace's :func:`simulate`, with a progress bar on stderr (transient; hidden when not a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    reports = []
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console, transient=True
    ) as bar:
        task = bar.add_task("simulate", total=None)

        def step(what: str, done: int, total: int) -> None:
            bar.update(task, description=what, completed=done, total=total)

        for t in traces:
            if not console.is_terminal:  # no live bar in a log: one line per trace
                console.print(f"simulating trace {t} ({num_requests} prompts)...")
            reports.append(simulate(t, caps, pols, seed, num_requests, chunk_size, progress=step))
    return reports


def run_simulate(
    trace: str = "mixed",
    capacities: str | None = None,
    policies: str | None = None,
    seed: int = 0,
    num_requests: int = 2000,
    chunk_size: int = 256,
    json_path: Path | None = None,
) -> int:
    """CLI entry: run :func:`simulate` and print a table; returns the exit status.

    ``capacities`` and ``policies`` are comma-separated lists ("64,256,1024").
    Bad arguments print one error line and return 2.
    """
    from rich.console import Console
    from rich.table import Table

    console = Console()
    traces = list(TRACES) if trace == "all" else [trace]
    try:
        caps = _parse_list(capacities, "--capacities")
        try:
            cap_ints = [int(c) for c in caps] if caps else None
        except ValueError:
            raise ValueError(f"--capacities must be whole numbers of chunks, got {capacities!r}") from None
        pols = _parse_list(policies, "--policies")
        reports = _run_with_progress(traces, cap_ints, pols, seed, num_requests, chunk_size)
    except ValueError as exc:
        Console(stderr=True).print(f"[red]kvtier simulate: {exc}[/red]")
        return 2
    for rep in reports:
        gib = rep.chunk_bytes / 2**30
        table = Table(
            title=(
                f"Token hit rate, trace {rep.trace} (seed {rep.seed}): {rep.requests} prompts, "
                f"{rep.prompt_tokens:,} tokens, {rep.distinct_chunks:,} distinct {rep.chunk_size}-token chunks"
            )
        )
        table.add_column("policy")
        for cap in rep.capacities:
            table.add_column(f"{cap:,} chunks\n({cap * gib:.1f} GiB)", justify="right")
        for pol, by_cap in rep.results.items():
            cells = []
            best = {c: max(r[c].hit_rate for r in rep.results.values()) for c in rep.capacities}
            for cap in rep.capacities:
                rate = by_cap[cap].hit_rate
                text = f"{100 * rate:.1f}%"
                cells.append(f"[bold]{text}[/bold]" if rate == best[cap] else text)
            table.add_row(pol, *cells)
        table.add_row("unbounded", *[f"{100 * rep.ceiling.hit_rate:.1f}%"] * len(rep.capacities), style="dim")
        console.print(table)
        violations = sum(s.chain_violations for by_cap in rep.results.values() for s in by_cap.values())
        console.print(
            f"GiB at SmolLM2-135M bf16 ({rep.chunk_bytes:,} B per chunk); chain violations: {violations}; "
            f"{rep.elapsed_s:.1f} s"
        )
    if json_path is not None:
        data = [r.as_dict() for r in reports]
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data[0] if len(data) == 1 else data, indent=2))
        console.print(f"wrote {json_path}")
    return 0


def run_trace_file(
    trace_file: Path,
    capacity_tokens: str | None = None,
    policies: str | None = None,
    block_size: int = 512,
    chunk_size: int | None = None,
    mode: str = "every-block",
    with_belady: bool = True,
    max_requests: int | None = None,
    json_path: Path | None = None,
    plot_path: Path | None = None,
) -> int:
    """CLI entry for a Mooncake-format trace file (:mod:`kvtier.sim.trace_replay`): a table
    of chunk hit rates per policy and capacity with Belady's MIN and the unbounded cache.

    Bad arguments and malformed trace lines print one error line and return 2.
    """
    from rich.console import Console
    from rich.table import Table

    from kvtier.sim.trace_replay import DEFAULT_CAPACITY_TOKENS, parse_tokens, replay_trace, write_plot

    console = Console()
    err = Console(stderr=True)
    try:
        caps = [parse_tokens(t) for t in _parse_list(capacity_tokens, "--capacity-tokens") or []] or \
            list(DEFAULT_CAPACITY_TOKENS)
        pols = _parse_list(policies, "--policies")
        if not console.is_terminal:
            console.print(f"replaying {trace_file} ...")
        rep = replay_trace(trace_file, caps, pols, block_size, chunk_size, mode, with_belady, max_requests,
                           progress=lambda s: err.print(f"[dim]{s}[/dim]") if err.is_terminal else None)
    except (ValueError, OSError) as exc:
        err.print(f"[red]kvtier simulate: {exc}[/red]")
        return 2
    table = Table(title=(f"Chunk hit rate, {rep.trace} ({rep.mode}): {rep.requests:,} requests, "
                         f"{rep.chunk_refs:,} chunk references, {rep.chunk_size}-token chunks"))
    table.add_column("policy")
    for t in rep.capacities_tokens:
        table.add_column(f"{t:,} tokens", justify="right")
    best = {c: max(by[c].chunk_hit_rate for by in rep.results.values()) for c in rep.capacities_chunks}
    for pol, by in rep.results.items():
        cells = [f"{by[c].chunk_hit_rate:.3f}" for c in rep.capacities_chunks]
        cells = [f"[bold]{x}[/bold]" if by[c].chunk_hit_rate == best[c] else x
                 for x, c in zip(cells, rep.capacities_chunks)]
        table.add_row(pol, *cells)
    if rep.belady is not None:
        table.add_row("Belady's MIN", *[f"{rep.belady[c].chunk_hit_rate:.3f}" for c in rep.capacities_chunks],
                      style="dim")
    table.add_row("unbounded", *[f"{rep.unbounded.chunk_hit_rate:.3f}"] * len(rep.capacities_chunks), style="dim")
    console.print(table)
    violations = sum(s.chain_violations for by in rep.results.values() for s in by.values())
    console.print(f"chain violations: {violations}; {rep.elapsed_s:.1f} s; peak RSS {rep.max_rss_bytes / 2**20:.0f} MiB"
                  + "".join(f"; {n}" for n in rep.notes))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(rep.as_dict(), indent=2))
        console.print(f"wrote {json_path}")
    if plot_path is not None:
        write_plot(rep, plot_path)
        console.print(f"wrote {plot_path}")
    return 0
