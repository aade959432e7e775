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

import gc
import inspect
import mmap
import os
import shutil
import sys
import tempfile
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import blake3
import numpy as np

from kvtier.bench.common import (
    aligned_empty,
    CacheEvictor,
    Check,
    PagedKV,
    Stopwatch,
    chunk_view,
    gbps,
    interleaved,
    load_chunk_blocks,
    median,
    print_checks,
    save_chunk_blocks,
    smollm2_namespace,
    write_json,
)
from kvtier.config import KVTierConfig
from kvtier.index.keys import ChunkHasher, KeyNamespace, LayoutSignature
from kvtier.memory.pool import ChunkPool
from kvtier.storage.manager import StorageManager
from kvtier.bench.peers_baseline import plain_files_get, plain_files_put
from kvtier.tiers.base import ChunkWrite
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk.parallel import DEFAULT_IO_THREADS

#: Targets (issue 3 item 6; disk against multi-threaded plain I/O since issue 15).
CPU_RATIO_TARGET = 0.9
DISK_RATIO_TARGET = 0.9
LOOKUP_US_TARGET = 10.0
INDEX_BYTES_TARGET = 300.0
HASH_TOKENS_PER_S_TARGET = 20e6

_LOOKUP_CHAIN = 31  # chunks per looked-up prompt (an 8,000-token prompt)


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


def _fresh_keys(n: int, rng: np.random.Generator) -> list[bytes]:
    return [rng.bytes(32) for _ in range(n)]


def _best(samples: dict[str, list[float]], names: tuple[str, ...]) -> tuple[str, float]:
    """The fastest (lowest median seconds) of ``names``."""
    return min(((n, median(samples[n])) for n in names), key=lambda t: t[1])


# -- CPU tier --------------------------------------------------------------------------
def bench_cpu(prompt_tokens: int, reps: int, paged: PagedKV, seed: int = 0) -> dict[str, Any]:
    """CPU tier put/get of one prompt's full chunks vs plain numpy copies (see module doc)."""
    ns = smollm2_namespace()
    layout = ns.layout
    nl, bpc = layout.num_layers, ns.blocks_per_chunk
    n_chunks = prompt_tokens // ns.chunk_size
    if n_chunks < 1:
        raise ValueError(f"prompt of {prompt_tokens} tokens has no full {ns.chunk_size}-token chunk")
    nbytes = n_chunks * ns.chunk_bytes
    rng = np.random.default_rng(seed)
    block_ids = paged.random_blocks(n_chunks * bpc, seed)
    chunks = [block_ids[i * bpc : (i + 1) * bpc] for i in range(n_chunks)]
    # Room for the get set plus one put set: put never evicts.
    cfg = KVTierConfig(cpu_capacity=2 * nbytes, disk_path=None)
    mgr = StorageManager(cfg, ns)
    base = aligned_empty((n_chunks, nl, bpc, paged.block_bytes))  # page-aligned, like kvtier's pool
    base.fill(1)  # pre-touched
    layers = paged.layers

    get_keys = _fresh_keys(n_chunks, rng)
    parent = None
    for key, blocks in zip(get_keys, chunks):
        buf = mgr.open_write(key)
        assert buf is not None
        save_chunk_blocks(layers, chunk_view(buf, nl, bpc), blocks)
        mgr.commit(key, parent)
        parent = key
    put_keys: list[bytes] = []

    def kv_put() -> float:
        for k in reversed(put_keys):  # untimed: make room for this repetition's fresh keys
            mgr.cpu.delete(k)  # tail first: the CPU tier never drops a resident chunk's parent
        put_keys[:] = _fresh_keys(n_chunks, rng)
        with Stopwatch() as sw:
            parent = None
            for key, blocks in zip(put_keys, chunks):
                buf = mgr.open_write(key)
                if buf is None:
                    raise RuntimeError("CPU tier refused a store in the benchmark")
                save_chunk_blocks(layers, chunk_view(buf, nl, bpc), blocks)
                mgr.commit(key, parent)
                parent = key
        return sw.s

    def plain_take() -> float:
        with Stopwatch() as sw:
            for i, blocks in enumerate(chunks):
                save_chunk_blocks(layers, base[i], blocks)
        return sw.s

    def plain_blockcopy() -> float:
        with Stopwatch() as sw:
            for i, blocks in enumerate(chunks):
                for layer, out in zip(layers, base[i]):
                    for j, b in enumerate(blocks):
                        np.copyto(out[j], layer[b])
        return sw.s

    def kv_get() -> float:
        with Stopwatch() as sw:
            parent = None
            for key, blocks in zip(get_keys, chunks):
                handle = mgr.open_read(key, parent)
                if handle is None:
                    raise RuntimeError("CPU tier missed a stored chunk in the benchmark")
                with handle:
                    load_chunk_blocks(chunk_view(handle.buffer, nl, bpc), layers, blocks, 0)
                parent = key
            mgr.release("bench")
        return sw.s

    def plain_scatter() -> float:
        with Stopwatch() as sw:
            for i, blocks in enumerate(chunks):
                load_chunk_blocks(base[i], layers, blocks, 0)
        return sw.s

    def plain_blockassign() -> float:
        with Stopwatch() as sw:
            for i, blocks in enumerate(chunks):
                for src, layer in zip(base[i], layers):
                    for j, b in enumerate(blocks):
                        layer[b] = src[j]
        return sw.s

    flat = base.reshape(-1)
    ref_src = np.ones_like(flat)

    def memcpy() -> float:
        with Stopwatch() as sw:
            np.copyto(flat, ref_src)
        return sw.s

    s = interleaved(
        {
            "kv_put": kv_put,
            "plain_take": plain_take,
            "plain_blockcopy": plain_blockcopy,
            "kv_get": kv_get,
            "plain_scatter": plain_scatter,
            "plain_blockassign": plain_blockassign,
            "memcpy": memcpy,
        },
        reps,
        before_each=CacheEvictor(),
    )
    put_base, put_base_s = _best(s, ("plain_take", "plain_blockcopy"))
    get_base, get_base_s = _best(s, ("plain_scatter", "plain_blockassign"))
    kv_put_s, kv_get_s = median(s["kv_put"]), median(s["kv_get"])
    return {
        "prompt_tokens": prompt_tokens,
        "chunks": n_chunks,
        "bytes": nbytes,
        "reps": reps,
        "put_kvtier_gbps": gbps(nbytes, kv_put_s),
        "put_plain_gbps": gbps(nbytes, put_base_s),
        "put_plain_method": put_base,
        "put_ratio": put_base_s / kv_put_s,
        "put_ratio_same_ops": median(s["plain_take"]) / kv_put_s,
        "get_kvtier_gbps": gbps(nbytes, kv_get_s),
        "get_plain_gbps": gbps(nbytes, get_base_s),
        "get_plain_method": get_base,
        "get_ratio": get_base_s / kv_get_s,
        "get_ratio_same_ops": median(s["plain_scatter"]) / kv_get_s,
        "memcpy_gbps": gbps(nbytes, median(s["memcpy"])),
        "median_s": {k: median(v) for k, v in s.items()},
    }


# -- disk tier -------------------------------------------------------------------------
def direct_io_supported() -> bool:
    """True if this kvtier's DiskTier has a ``direct_io`` parameter."""
    return "direct_io" in inspect.signature(DiskTier.__init__).parameters


class _AlignedSlots:
    """``n`` page-aligned slots of ``size`` bytes (anonymous mmap), pre-touched."""

    def __init__(self, n: int, size: int):
        self._mm = mmap.mmap(-1, n * size)
        self.arr = np.frombuffer(self._mm, dtype=np.uint8).reshape(n, size)
        self.arr[:] = 1

    def close(self) -> None:
        del self.arr
        self._mm.close()


def bench_disk(
    root: Path, prompt_tokens: int, reps: int, fsync: bool = False, direct: bool = False, seed: int = 0,
    io_threads: int = DEFAULT_IO_THREADS,
) -> dict[str, Any]:
    """Disk tier put/get of one prompt's chunks (one batch) vs plain file I/O on ``io_threads`` threads.

    Raises:
        RuntimeError: ``direct`` requested but unavailable (check :func:`direct_io_supported`).
    """
    ns = smollm2_namespace()
    n_chunks = max(1, prompt_tokens // ns.chunk_size)
    cb = ns.chunk_bytes
    nbytes = n_chunks * cb
    rng = np.random.default_rng(seed)
    case = root / f"disk-{prompt_tokens}-{'direct' if direct else 'buffered'}-{'fsync' if fsync else 'nofsync'}"
    shutil.rmtree(case, ignore_errors=True)
    plain_dir = case / "plain"
    plain_dir.mkdir(parents=True)
    kwargs: dict[str, Any] = dict(fsync=fsync)
    if direct:
        if not direct_io_supported():
            raise RuntimeError("this DiskTier has no direct_io mode")
        kwargs["direct_io"] = True
    tier = DiskTier(case / "kv", 4 * nbytes + (1 << 20), ns.digest(), io_threads=io_threads, **kwargs)
    if direct and not tier.direct_io:
        tier.close()
        shutil.rmtree(case, ignore_errors=True)
        raise RuntimeError(f"the file system at {root} refuses O_DIRECT")
    # Sources and destinations are CPU-tier slots (a ChunkPool, as in the tier);
    # the plain O_DIRECT side needs page-aligned buffers, so it gets its own.
    src = ChunkPool(cb, n_chunks)
    src._buf[:] = rng.integers(0, 256, size=src._buf.shape, dtype=np.uint8)
    dst = ChunkPool(cb, n_chunks)
    aligned = _AlignedSlots(n_chunks, cb) if direct else None
    if aligned is not None:
        aligned.arr[:] = src._buf
    plain_src = (lambda i: memoryview(aligned.arr[i])) if aligned is not None else (lambda i: memoryview(src.view(i)))
    plain_dst = plain_src  # reads land in the same (aligned) buffers
    paths = [str(plain_dir / f"c{i}.bin") for i in range(n_chunks)]

    put_keys: list[bytes] = []

    def kv_put() -> float:
        for k in put_keys:  # untimed clean-up of the previous repetition
            tier.delete(k)
        put_keys[:] = _fresh_keys(n_chunks, rng)
        writes = [ChunkWrite(k, put_keys[i - 1] if i else None, src.view(i)) for i, k in enumerate(put_keys)]
        with Stopwatch() as sw:  # one batch, as the write-behind thread sends a prompt's chunks
            ok = tier.put_many(writes)
        if not all(ok):
            raise RuntimeError("disk tier refused a write in the benchmark")
        return sw.s

    def plain_put(threads: int) -> Callable[[], float]:
        def run() -> float:
            for p in paths:
                if os.path.exists(p):
                    os.unlink(p)
            bufs = [plain_src(i) for i in range(n_chunks)]
            with Stopwatch() as sw:
                plain_files_put(paths, bufs, threads, direct, fsync, executor=ex)
            return sw.s

        return run

    # Gets read what the last put wrote (files in the page cache unless direct).
    def kv_get() -> float:
        with Stopwatch() as sw:
            ok = tier.get_many_into([(key, dst.view(i)) for i, key in enumerate(put_keys)])
        if not all(ok):
            raise RuntimeError("disk tier missed a written chunk in the benchmark")
        return sw.s

    def plain_get(threads: int) -> Callable[[], float]:
        def run() -> float:
            bufs = [plain_dst(i) for i in range(n_chunks)]
            with Stopwatch() as sw:
                plain_files_get(paths, bufs, threads, direct, executor=ex)
            return sw.s

        return run

    ex = ThreadPoolExecutor(io_threads)  # started once, like the disk tier's I/O threads
    try:
        evict = CacheEvictor()
        sp = interleaved({"kvtier": kv_put, "plain": plain_put(io_threads), "plain_1t": plain_put(1)}, reps,
                         before_each=evict)
        sg = interleaved({"kvtier": kv_get, "plain": plain_get(io_threads), "plain_1t": plain_get(1)}, reps,
                         before_each=evict)
        if not np.array_equal(dst.view(0), src.view(0)):
            raise RuntimeError("disk tier returned wrong bytes in the benchmark")
    finally:
        ex.shutdown()
        tier.close()
        if aligned is not None:
            aligned.close()
        shutil.rmtree(case, ignore_errors=True)
    kp, pp, kg, pg = (median(x) for x in (sp["kvtier"], sp["plain"], sg["kvtier"], sg["plain"]))
    return {
        "io_threads": io_threads,
        "put_plain_1t_gbps": gbps(nbytes, median(sp["plain_1t"])),
        "get_plain_1t_gbps": gbps(nbytes, median(sg["plain_1t"])),
        "prompt_tokens": prompt_tokens,
        "chunks": n_chunks,
        "bytes": nbytes,
        "reps": reps,
        "fsync": fsync,
        "direct_io": direct,
        "put_kvtier_gbps": gbps(nbytes, kp),
        "put_plain_gbps": gbps(nbytes, pp),
        "put_ratio": pp / kp,
        "get_kvtier_gbps": gbps(nbytes, kg),
        "get_plain_gbps": gbps(nbytes, pg),
        "get_ratio": pg / kg,
    }


# -- lookup and index memory -------------------------------------------------------------
def _tiny_namespace() -> KeyNamespace:
    """16-token chunks of 2 bytes per token: 32-byte payloads, so a million chunks fit in 32 MB."""
    layout = LayoutSignature("bench", "numpy", "tiny", 16, 1, 1, 1, "uint8")
    return KeyNamespace("bench/lookup", layout, 16)


def bench_lookup(num_chunks: int, num_prompts: int, seed: int = 0) -> dict[str, Any]:
    """Lookup latency per chunk and index bytes per chunk with ``num_chunks`` chunks indexed."""
    ns = _tiny_namespace()
    chain = min(_LOOKUP_CHAIN, num_chunks)
    cfg = KVTierConfig(chunk_size=ns.chunk_size, cpu_capacity=num_chunks * ns.chunk_bytes, disk_path=None)
    mgr = StorageManager(cfg, ns)  # the pool is allocated (and pre-touched) here, before counting
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        keys: list[bytes] = []
        parent: bytes | None = None
        for i in range(num_chunks):
            key = blake3.blake3(i.to_bytes(8, "little")).digest()
            if mgr.open_write(key) is None:
                raise RuntimeError("CPU tier refused a store while indexing")
            mgr.commit(key, parent if i % chain else None)
            parent = key
            keys.append(key)
        gc.collect()
        index_bytes = tracemalloc.get_traced_memory()[0] - before - sys.getsizeof(keys)
    finally:
        tracemalloc.stop()
    if len(mgr.cpu) != num_chunks:
        raise RuntimeError(f"indexed {len(mgr.cpu)} chunks, expected {num_chunks}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, num_chunks // chain, size=num_prompts) * chain
    prompts = [keys[s : s + chain] for s in starts]
    hits = 0
    with Stopwatch() as sw:
        for j, p in enumerate(prompts):
            res = mgr.lookup_keys(p, lease_owner="bench")
            hits += len(res.keys)
            mgr.release("bench")
    if hits != num_prompts * chain:
        raise RuntimeError(f"lookup found {hits} of {num_prompts * chain} chunks")
    miss_keys = [blake3.blake3(b"miss" + i.to_bytes(8, "little")).digest() for i in range(num_prompts)]
    with Stopwatch() as sm:
        for k in miss_keys:
            mgr.lookup_keys([k], lease_owner="bench")
            mgr.release("bench")
    return {
        "chunks_indexed": num_chunks,
        "prompts_looked_up": num_prompts,
        "chunks_per_prompt": chain,
        "lookup_us_per_chunk": sw.s / hits * 1e6,
        "lookup_miss_us": sm.s / num_prompts * 1e6,
        "index_bytes_per_chunk": index_bytes / num_chunks,
        "index_bytes": index_bytes,
    }


# -- hashing -----------------------------------------------------------------------------
def bench_hash(num_tokens: int, reps: int, seed: int = 0) -> dict[str, Any]:
    """``ChunkHasher.keys`` throughput (tokens/s) on one long prompt, as a list and as numpy."""
    hasher = ChunkHasher(smollm2_namespace())
    arr = np.random.default_rng(seed).integers(0, 49152, size=num_tokens, dtype=np.int64)
    as_list = [int(t) for t in arr]

    def timed(tokens: Any) -> Callable[[], float]:
        def run() -> float:
            with Stopwatch() as sw:
                hasher.keys(tokens)
            return sw.s

        return run

    s = interleaved({"list": timed(as_list), "numpy": timed(arr)}, reps)
    n = (num_tokens // hasher.chunk_size) * hasher.chunk_size
    return {
        "prompt_tokens": num_tokens,
        "reps": reps,
        "tokens_per_s_list": n / median(s["list"]),
        "tokens_per_s_numpy": n / median(s["numpy"]),
    }


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
    if not result["disk_direct_io_available"]:
        console.print(f"direct I/O not measured: {result['disk_direct_io_note']}")
    write_json(json_path, result)
    return 1 if enforce and not all(c.passed for c in checks) else 0
