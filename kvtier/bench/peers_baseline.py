"""Physical baselines of ``kvtier bench peers`` and ``kvtier bench tiers``: what the machine gives
with no cache layer at all, on the same bytes and chunking.

- memcpy: the chunks copied out of / back into a KV tensor ``[2, L, T, H*D]`` (numpy ``copyto``),
  the put after the same :func:`before_put` as every side's put (without it, it copied a tensor
  still hot in the CPU caches while each side's put followed the hook's memory sweep);
- plain files: one file per chunk, ``open``/``pwrite``/``close`` and ``open``/``preadv``/``close``
  on ``io_threads`` already started threads (the disk tier's default: 4), buffered and with
  O_DIRECT into page-aligned buffers; the single-thread figure too. Buffered files both with one
  call per file (``file``) and in steps (``file_steps``: ``STEP_PUT``-byte writes, ``STEP_GET``-byte
  reads): on this kernel a write that covers a whole aligned 2 MiB of a file makes the page cache
  allocate a 2 MiB folio, slow when free memory is fragmented, and small read steps keep the copy
  in cache; the report's buffered baseline is the faster of the two in each round (the most the
  machine gives with plain calls), so neither side beats a baseline that a better plain loop beats;
- checksummed plain files (``file_xxh3``): xxh3-64 of each chunk, then ``STEP_PUT``-byte writes;
  the one-call read, then xxh3-64 of the chunk, on the same thread: the least work of a store that
  keeps a checksum of every byte and a read that checks it, as kvtier's disk tier does (LMCache's
  does neither); the target baseline of the buffered disk figures (:mod:`.peers_report`);
- Redis: redis-py (hiredis) pipelined ``SET``/``GET`` of the chunks on one connection; the same
  with an xxh3-64 of each chunk before its ``SET`` and of each value after the ``GET``
  (``redis_xxh3``: the same work as kvtier's checksummed envelope);
- O_DIRECT files plus an xxh3-64 of each chunk (``file_direct_xxh3``).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np
import xxhash

from kvtier.bench.memory_state import before_put
from kvtier.serde.base import byte_view
from kvtier.bench.peers_shape import Shape as _Shape
from kvtier.bench.peers_shape import kv_pair as _kv
from kvtier.bench.peers_shape import timed as _timed


#: Bytes per ``pwrite`` / ``preadv`` of the stepped plain-file baseline (``file_steps``).
STEP_PUT = 1 << 20
STEP_GET = 256 << 10


def _aligned(n: int) -> np.ndarray:
    mm = mmap.mmap(-1, max(n, 4096))
    arr = np.frombuffer(mm, dtype=np.uint8)[:n]
    arr.fill(1)
    return arr


def plain_files_put(
    paths: Sequence[str], bufs: Sequence[Any], threads: int, direct: bool, fsync: bool = False,
    executor: ThreadPoolExecutor | None = None, step: int = 0, verify: bool = False,
) -> None:
    """The physical write baseline: one file per buffer (``open``/``pwrite``/[``fsync``]/``close``)
    on ``threads`` threads (1: inline; ``executor``: already started threads, as the tier's are);
    one ``pwrite`` per file or ``pwrite`` calls of ``step`` bytes (0: whole files); ``verify``: first
    xxh3-64 of the buffer (a checksum to store, not stored). O_DIRECT needs page-aligned buffers of whole pages."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)

    def one(i: int) -> None:
        if verify:
            xxhash.xxh3_64_digest(bufs[i])
        fd = os.open(paths[i], flags, 0o600)
        try:
            view, off = memoryview(bufs[i]).cast("B"), 0
            while off < len(view):
                off += os.pwrite(fd, view[off : off + step] if step else view[off:], off)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    _each(one, len(paths), threads, executor)


def plain_files_get(
    paths: Sequence[str], bufs: Sequence[Any], threads: int, direct: bool, executor: ThreadPoolExecutor | None = None,
    step: int = 0, verify: bool = False,
) -> None:
    """The physical read baseline: ``open``/``preadv``/``close`` of each file into its buffer on ``threads``
    threads; one ``preadv`` per file, or ``preadv`` calls of ``step`` bytes (0: whole files); ``verify``:
    then xxh3-64 of the whole buffer (the digest is not compared: the work, not the check, is measured)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)

    def one(i: int) -> None:
        fd = os.open(paths[i], flags)
        try:
            view = memoryview(bufs[i]).cast("B")
            n, pos = len(view), 0
            while pos < n:
                piece = view[pos : pos + step] if step else view
                if os.preadv(fd, [piece], pos) != len(piece):
                    raise RuntimeError("short read")
                pos += len(piece)
        finally:
            os.close(fd)
        if verify:
            xxhash.xxh3_64_digest(view)

    _each(one, len(paths), threads, executor)


def _each(fn: Callable[[int], None], n: int, threads: int, executor: ThreadPoolExecutor | None) -> None:
    if threads <= 1:
        for i in range(n):
            fn(i)
    elif executor is not None:
        list(executor.map(fn, range(n)))
    else:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(fn, range(n)))


def baselines(a: argparse.Namespace, s: _Shape) -> dict[str, Any]:
    """memcpy, multi-threaded plain file I/O (buffered, O_DIRECT), redis-py; same bytes and chunking."""
    kv, src = _kv(s)
    slots = [_aligned(2 * s.L * m * s.HD * 2) for m in s.sizes]  # page-aligned, pre-touched
    slot_views = [x.view(np.uint16).reshape(2, s.L, m, s.HD) for x, m in zip(slots, s.sizes)]
    d = os.path.join(a.work_dir, "plain")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    out: dict[str, Any] = {"bytes": s.nbytes, "io_threads": a.io_threads}
    ex = ThreadPoolExecutor(a.io_threads)  # started once, like the disk tier's I/O threads
    names = ("memcpy_put", "memcpy_get", "file_put", "file_get", "file_steps_put", "file_steps_get",
             "file_xxh3_put", "file_xxh3_get",
             "file_direct_put", "file_direct_get", "file_direct_xxh3_put", "file_direct_xxh3_get",
             "file_1t_put", "file_1t_get", "redis_put", "redis_get", "redis_xxh3_put", "redis_xxh3_get")
    for k in names:
        out[k + "_s"] = []
    try:
        import redis

        host, port = a.redis_url.split(":")
        r: Any = redis.Redis(host=host, port=int(port))
        r.ping()
    except Exception:  # noqa: BLE001 - no Redis: that baseline is skipped
        r = None
    try:
        for rep in range(a.reps + 1):
            np.copyto(kv, src)
            rec: dict[str, float] = {}

            def mput() -> None:
                for i, (m, v) in enumerate(zip(s.sizes, slot_views)):
                    np.copyto(v, kv[:, :, i * s.CH : i * s.CH + m])

            def mget() -> None:
                for i, (m, v) in enumerate(zip(s.sizes, slot_views)):
                    np.copyto(kv[:, :, i * s.CH : i * s.CH + m], v)

            before_put(a.free_bytes)  # the memory state every side's put starts from (kvtier's, LMCache's)
            rec["memcpy_put"] = _timed(mput)
            rec["memcpy_get"] = _timed(mget)
            for mode, threads, direct, wstep, rstep, verify in (
                ("file", a.io_threads, False, 0, 0, False),
                ("file_steps", a.io_threads, False, STEP_PUT, STEP_GET, False),
                ("file_xxh3", a.io_threads, False, STEP_PUT, 0, True),
                ("file_1t", 1, False, 0, 0, False), ("file_direct", a.io_threads, True, 0, 0, False),
                ("file_direct_xxh3", a.io_threads, True, 0, 0, True),
            ):
                paths = [os.path.join(d, f"{mode}-{rep}-{i}") for i in range(len(slots))]
                before_put(a.free_bytes)
                rec[mode + "_put"] = _timed(
                    lambda: plain_files_put(paths, slots, threads, direct, executor=ex, step=wstep, verify=verify))
                rec[mode + "_get"] = _timed(
                    lambda: plain_files_get(paths, slots, threads, direct, executor=ex, step=rstep, verify=verify))
            if r is not None:
                keys = [f"kvtier-peers-raw:{rep}:{i}" for i in range(len(slots))]
                blobs = [byte_view(x) for x in slots]
                before_put(a.free_bytes)

                def rput(verify: bool) -> Callable[[], None]:
                    def run() -> None:
                        p = r.pipeline(transaction=False)
                        for k, b in zip(keys, blobs):
                            if verify:
                                xxhash.xxh3_64_digest(b)
                            p.set(k, b)
                        p.execute()

                    return run

                got: list[Any] = []

                def rget(verify: bool) -> Callable[[], None]:
                    def run() -> None:
                        p = r.pipeline(transaction=False)
                        for k in keys:
                            p.get(k)
                        got[:] = p.execute()
                        if verify:
                            for v in got:
                                xxhash.xxh3_64_digest(v)

                    return run

                rec["redis_put"] = _timed(rput(False))
                rec["redis_get"] = _timed(rget(False))
                r.delete(*keys)
                before_put(a.free_bytes)
                rec["redis_xxh3_put"] = _timed(rput(True))
                rec["redis_xxh3_get"] = _timed(rget(True))
                r.delete(*keys)
            if rep:
                for k, v in rec.items():
                    out[k + "_s"].append(v)
    finally:
        ex.shutdown()
        shutil.rmtree(d, ignore_errors=True)
    return out


