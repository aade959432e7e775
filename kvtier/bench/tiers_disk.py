"""``kvtier bench tiers``, disk tier: put/get against plain file I/O, page cache, fsync and O_DIRECT (see :mod:`kvtier.bench.tiers`)."""

from __future__ import annotations

import inspect
import mmap
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvtier.bench.common import (
    CacheEvictor,
    Stopwatch,
    gbps,
    interleaved,
    median,
    smollm2_namespace,
)
from kvtier.memory.pool import ChunkPool
from kvtier.serde.base import byte_view
from kvtier.bench.peers_baseline import plain_files_get, plain_files_put
from kvtier.tiers.base import ChunkWrite
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk.parallel import DEFAULT_IO_THREADS

from kvtier.bench.tiers_cpu import _fresh_keys

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
    plain_src = (lambda i: byte_view(aligned.arr[i])) if aligned is not None else (lambda i: byte_view(src.view(i)))
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
