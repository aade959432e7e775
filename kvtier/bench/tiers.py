"""``kvtier bench tiers``: tier bandwidth, lookup latency, index memory and hashing speed.

Every bandwidth figure is a ratio of kvtier over a plain baseline doing the
same byte movement, measured side by side in this process (interleaved
repetitions, medians). Sizes follow SmolLM2-135M (30 layers, 3 KV heads, head
dim 64, bf16: 5,898,240 bytes per 256-token chunk, 128-token engine blocks).

- CPU put: ``StorageManager.open_write`` + the connector's per-layer ``np.take``
  of a chunk's blocks from an engine-like paged KV buffer + ``commit``.
  Baseline: the faster of two plain numpy gathers (``np.take``; one
  ``np.copyto`` per block) into a pre-allocated, pre-touched buffer.
- CPU get: ``open_read`` + the connector's per-layer scatter into blocks +
  close, lease released at the end. Baseline: the faster of
  two plain numpy scatters (fancy assignment; one assignment per block) from a
  pre-touched buffer.
- Disk put: one ``DiskTier.put_many`` of a prompt's chunks (what the write-behind
  thread runs: record header with xxh3 checksum, ``.tmp`` file, rename; up to
  ``io_threads`` files in flight) from CPU slots. Baseline: one plain file per
  chunk (``open``/``pwrite``/``close``) on ``io_threads`` threads (the single-thread
  figure is kept in the JSON as ``put_plain_1t_gbps``). Both without fsync, then
  both with fsync, then (if the file system accepts it) both with ``O_DIRECT``.
- Disk get: one ``DiskTier.get_many_into`` into CPU slots (header check, read,
  payload checksum). Baseline: ``open``/``preadv``/``close`` of the plain files on
  ``io_threads`` threads (page cache), or the same with ``O_DIRECT``.
- Lookup: ``StorageManager.lookup_keys`` with a lease (as the connector calls
  it) of 31-chunk prompts, all hits, against a CPU tier indexing N chunks.
- Index memory: bytes allocated by Python (``tracemalloc``) while N chunks are
  stored into the CPU tier through ``open_write``/``commit``, pool excluded
  (allocated before). Counted: the tier's entry dict and entries, the eviction
  policy's order and chain metadata, the key ``bytes`` objects themselves.
- Hashing: ``ChunkHasher.keys`` on a 32,768-token prompt given as a Python
  list of ints (what the connector passes) and as a numpy array.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable


from kvtier.bench.common import (
    Check,
    PagedKV,
    print_checks,
    smollm2_namespace,
    write_json,
)
from kvtier.bench.tiers_cpu import bench_cpu
from kvtier.bench.tiers_disk import bench_disk, direct_io_supported
from kvtier.bench.tiers_index import _LOOKUP_CHAIN, bench_hash, bench_lookup  # noqa: F401

#: Targets (issue 3 item 6; disk against multi-threaded plain I/O since issue 15).
CPU_RATIO_TARGET = 0.9
DISK_RATIO_TARGET = 0.9
LOOKUP_US_TARGET = 10.0
INDEX_BYTES_TARGET = 300.0
HASH_TOKENS_PER_S_TARGET = 20e6



@dataclass(frozen=True)
class TierBenchSizes:
    """Sizes of one ``bench tiers`` run.

    Attributes:
        prompt_tokens: prompt lengths (tokens) for the bandwidth cases.
        reps: interleaved repetitions per CPU case (after one warm-up each).
        disk_reps: interleaved repetitions per disk case.
        lookup_chunks: chunks indexed for the lookup and index-memory figures.
        lookup_prompts: prompts looked up (each ``_LOOKUP_CHAIN`` chunks).
        hash_tokens: tokens of the hashed prompt.
        hash_reps: hashing repetitions.
    """

    prompt_tokens: tuple[int, ...] = (2000, 8000)
    reps: int = 9
    disk_reps: int = 7
    lookup_chunks: int = 1_000_000
    lookup_prompts: int = 3000
    hash_tokens: int = 32768
    hash_reps: int = 30

    @classmethod
    def quick(cls) -> "TierBenchSizes":
        return cls(prompt_tokens=(2000,), reps=5, disk_reps=3, lookup_chunks=100_000, lookup_prompts=1000, hash_reps=10)

    @classmethod
    def tiny(cls) -> "TierBenchSizes":
        """For smoke tests: seconds, not minutes; figures meaningless."""
        return cls(prompt_tokens=(600,), reps=1, disk_reps=1, lookup_chunks=2000, lookup_prompts=20, hash_tokens=2048, hash_reps=2)


# -- the command -------------------------------------------------------------------------
def run_tiers_bench(sizes: TierBenchSizes, work_dir: Path | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every tier benchmark; returns the JSON document (see module doc for what is measured).

    Args:
        sizes: how much to move and how often.
        work_dir: directory for the disk cases (default: a temporary directory on the
            file system of ``~/.cache``, not tmpfs, so O_DIRECT can work).
        log: progress lines.
    """
    cache = Path.home() / ".cache" / "kvtier"
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir=work_dir or cache))
    try:
        ns = smollm2_namespace()
        max_blocks = max(t // ns.chunk_size for t in sizes.prompt_tokens) * ns.blocks_per_chunk
        paged = PagedKV(ns.layout, max(max_blocks + 8, 16))
        cpu = []
        for t in sizes.prompt_tokens:
            log(f"CPU tier, {t}-token prompt")
            cpu.append(bench_cpu(t, sizes.reps, paged))
        # The CPU figures above run with NUMA placement as an engine gets it (cpu_numa_node auto);
        # the largest prompt again without any policy, so the two can be compared (issue 29).
        log(f"CPU tier, {max(sizes.prompt_tokens)}-token prompt, cpu_numa_node none (for comparison)")
        cpu_numa_off = bench_cpu(max(sizes.prompt_tokens), sizes.reps, paged, cpu_numa_node="none")
        del paged
        disk = []
        direct_note = "direct_io parameter absent from DiskTier"
        for t in sizes.prompt_tokens:
            for fsync in (False, True):
                log(f"disk tier, {t}-token prompt, fsync={fsync}")
                disk.append(bench_disk(tmp, t, sizes.disk_reps, fsync=fsync))
        direct_available = direct_io_supported()
        if direct_available:
            for t in sizes.prompt_tokens:
                log(f"disk tier, {t}-token prompt, O_DIRECT")
                try:
                    disk.append(bench_disk(tmp, t, sizes.disk_reps, direct=True))
                    direct_note = ""
                except RuntimeError as exc:
                    direct_available = False
                    direct_note = str(exc)
                    break
        log(f"lookup with {sizes.lookup_chunks:,} chunks indexed")
        lookup = bench_lookup(sizes.lookup_chunks, sizes.lookup_prompts)
        log(f"hashing a {sizes.hash_tokens}-token prompt")
        hashing = bench_hash(sizes.hash_tokens, sizes.hash_reps)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    buffered = [d for d in disk if not d["fsync"] and not d["direct_io"]]
    fsynced = [d for d in disk if d["fsync"]]
    direct = [d for d in disk if d["direct_io"]]

    def worst(rows: list[dict[str, Any]], key: str) -> float | None:
        return min(r[key] for r in rows) if rows else None

    out: dict[str, Any] = {
        "sizes": asdict(sizes),
        "chunk_bytes": ns.chunk_bytes,
        "cpu_put_ratio": worst(cpu, "put_ratio"),
        "cpu_get_ratio": worst(cpu, "get_ratio"),
        "cpu_put_ratio_same_ops": worst(cpu, "put_ratio_same_ops"),
        "cpu_get_ratio_same_ops": worst(cpu, "get_ratio_same_ops"),
        "cpu_put_ratio_numa_off": cpu_numa_off["put_ratio"],
        "cpu_get_ratio_numa_off": cpu_numa_off["get_ratio"],
        "disk_put_ratio": worst(buffered, "put_ratio"),
        "disk_get_ratio": worst(buffered, "get_ratio"),
        "disk_put_fsync_ratio": worst(fsynced, "put_ratio"),
        "disk_get_fsync_ratio": worst(fsynced, "get_ratio"),
        "disk_direct_io_available": direct_available and bool(direct),
        "disk_direct_io_note": direct_note,
        "disk_put_direct_ratio": worst(direct, "put_ratio"),
        "disk_get_direct_ratio": worst(direct, "get_ratio"),
        "lookup_us_per_chunk_1m": lookup["lookup_us_per_chunk"],
        "index_bytes_per_chunk": lookup["index_bytes_per_chunk"],
        "hash_tokens_per_s": hashing["tokens_per_s_list"],
        "hash_tokens_per_s_numpy": hashing["tokens_per_s_numpy"],
        "cpu": cpu,
        "cpu_numa_off": cpu_numa_off,
        "disk": disk,
        "lookup": lookup,
        "hash": hashing,
    }
    return out


def checks_of(result: dict[str, Any]) -> list[Check]:
    """The judged figures of a ``bench tiers`` result."""
    checks: list[Check] = []
    for c in result["cpu"]:
        t = c["prompt_tokens"]
        checks.append(Check(f"CPU put, {t} tok", c["put_ratio"], CPU_RATIO_TARGET, True, "x",
                            f"{c['put_kvtier_gbps']:.2f} vs {c['put_plain_gbps']:.2f} GB/s ({c['put_plain_method']}); "
                            f"vs same ops {c['put_ratio_same_ops']:.2f}x"))
        checks.append(Check(f"CPU get, {t} tok", c["get_ratio"], CPU_RATIO_TARGET, True, "x",
                            f"{c['get_kvtier_gbps']:.2f} vs {c['get_plain_gbps']:.2f} GB/s ({c['get_plain_method']}); "
                            f"vs same ops {c['get_ratio_same_ops']:.2f}x"))
    for d in result["disk"]:
        mode = "O_DIRECT" if d["direct_io"] else ("fsync" if d["fsync"] else "page cache")
        t = d["prompt_tokens"]
        checks.append(Check(f"disk put, {t} tok, {mode}", d["put_ratio"], DISK_RATIO_TARGET, True, "x",
                            f"{d['put_kvtier_gbps']:.2f} vs {d['put_plain_gbps']:.2f} GB/s"))
        checks.append(Check(f"disk get, {t} tok, {mode}", d["get_ratio"], DISK_RATIO_TARGET, True, "x",
                            f"{d['get_kvtier_gbps']:.2f} vs {d['get_plain_gbps']:.2f} GB/s"))
    lk = result["lookup"]
    checks.append(Check(f"lookup, {lk['chunks_indexed']:,} chunks", lk["lookup_us_per_chunk"], LOOKUP_US_TARGET,
                        False, "us/chunk", f"with lease; miss {lk['lookup_miss_us']:.1f} us"))
    checks.append(Check(f"index, {lk['chunks_indexed']:,} chunks", lk["index_bytes_per_chunk"], INDEX_BYTES_TARGET,
                        False, "B/chunk", "tracemalloc; keys included"))
    h = result["hash"]
    checks.append(Check(f"hashing, {h['prompt_tokens']} tok (list)", h["tokens_per_s_list"],
                        HASH_TOKENS_PER_S_TARGET, True, "tok/s", f"numpy input {h['tokens_per_s_numpy'] / 1e6:.0f} M/s"))
    return checks


def run_tiers(
    json_path: Path | None = None, quick: bool = False, sizes: TierBenchSizes | None = None, enforce: bool = False
) -> int:
    """``kvtier bench tiers``: run, print the table, write JSON.

    Returns 1 if ``enforce`` (the CLI) and a target was missed, else 0 (targets
    reported in the table and JSON only, e.g. for smoke runs at tiny sizes).
    """
    from rich.console import Console

    console = Console(stderr=True)
    sizes = sizes or (TierBenchSizes.quick() if quick else TierBenchSizes())
    result = run_tiers_bench(sizes, log=lambda m: console.print(f"[dim]{m}[/dim]"))
    checks = checks_of(result)
    result["checks"] = [{**asdict(c), "passed": c.passed} for c in checks]
    print_checks("kvtier bench tiers (ratios: kvtier / plain, measured side by side)", checks)
    on = next(c for c in result["cpu"] if c["prompt_tokens"] == result["cpu_numa_off"]["prompt_tokens"])
    off = result["cpu_numa_off"]
    console.print(f"CPU tier, {off['prompt_tokens']} tok, NUMA placement auto vs none (each / plain copies): "
                  f"put {on['put_ratio']:.2f}x vs {off['put_ratio']:.2f}x, get {on['get_ratio']:.2f}x vs "
                  f"{off['get_ratio']:.2f}x (not judged)")
    if not result["disk_direct_io_available"]:
        console.print(f"direct I/O not measured: {result['disk_direct_io_note']}")
    write_json(json_path, result)
    return 1 if enforce and not all(c.passed for c in checks) else 0
