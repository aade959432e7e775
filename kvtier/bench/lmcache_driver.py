"""kvtier's LMCache driver for ``kvtier bench peers``: LMCache's side of each figure.

Runs in LMCache's own virtual environment (``--lmcache-python``; LMCache pins
packages kvtier must not depend on), as a script, by path::

    LMCACHE_PY kvtier/bench/lmcache_driver.py FIGURE [--tokens N ...] [--odirect]
    LMCACHE_PY kvtier/bench/lmcache_driver.py --probe

It imports only the standard library, torch, LMCache and its sibling
:mod:`memory_state` (the pre-put hook every side shares), never kvtier. It prints
one line ``RESULT <json>`` with ``bytes``, ``level`` and the per-repetition
seconds ``put_s`` and ``get_s`` (one unrecorded warm-up first), the shape of
kvtier's side (:mod:`kvtier.bench.peers_side`). ``--probe`` prints
``PROBE <json>`` with LMCache's and torch's versions (exit 3: not importable).

Figures, on a CPU tensor ``kv [2, layers, tokens, kv_heads * head_dim]`` bf16 (LMCache's
``KV_2LTD`` chunk layout) standing in for the GPU's KV:

- ``cpu``, engine level: ``LMCacheEngine.store(tokens)`` (token hashing, pool
  allocation, the copy out of ``kv``) / ``retrieve(tokens)`` (lookup, copy back),
  through a connector whose copies are ``Tensor.copy_`` between ``kv`` and the
  pool's memory objects.
- ``disk`` (``--odirect``: LMCache's ``use_odirect``) and ``redis`` (``redis://``,
  naive serde), storage level: ``batched_submit_put_task`` of pool memory objects
  filled beforehand, timed until the backend reported every chunk written, then
  the objects are released and ``batched_get_blocking`` reads them back (LMCache's
  first-fit pool hands the get the blocks the put just freed). No CPU copy is kept
  (``local_cpu=False``), so the get is a real disk/Redis read.

Every get is compared with the source bytes (a mismatch exits non-zero). Before
each timed put: :func:`memory_state.before_put`, as on every other side.

LMCache 0.5.6 defects worked around here (found while writing this driver;
both only concern teardown or hangs, not the timed paths):

- ``RedisConnector.close()`` is a coroutine on the backend's event loop that calls
  the blocking ``pq_executor.shutdown(wait=True)`` and so waits on that same loop:
  closing the engine never returns. The driver never closes the engine: it prints
  its result, deletes its own Redis keys with redis-py and leaves with ``os._exit``
  (LMCache also leaves non-daemon threads behind).
- A hang anywhere (e.g. the ``resp://`` connector's ``batch_exists_sync``, which
  registers its future after submitting, so the event loop can drop the
  completion; this driver does not use ``resp://``) must not stall the bench:
  ``faulthandler`` dumps the stacks and exits after ``--child-timeout`` seconds.

torch intra-op threads: 1 by default (2 made strided copies ~15x slower on the
2-vCPU VM). LMCache's CPU pool is pre-faulted once before the first repetition
(its steady state in a server that has been running).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
import traceback
from typing import Any


def _load_memory_state() -> Any:
    """The sibling ``memory_state.py``, loaded by path (kvtier is not importable in LMCache's venv)."""
    if __package__:  # imported as kvtier.bench.lmcache_driver (kvtier's own tests)
        from kvtier.bench import memory_state

        return memory_state
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory_state.py")
    spec = importlib.util.spec_from_file_location("kvtier_bench_memory_state", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


before_put = _load_memory_state().before_put

#: Figures this driver measures, and the LMCache backend (storage_backends key) behind each.
BACKENDS = {"cpu": "LocalCPUBackend", "disk": "LocalDiskBackend", "redis": "RemoteBackend"}
#: Exit code of ``--probe`` when LMCache or torch cannot be imported.
EXIT_NOT_IMPORTABLE = 3
#: Model name of every key this driver writes (its Redis keys start with it).
MODEL = "kvtier-bench-peers"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="lmcache_driver.py", description="LMCache's side of kvtier bench peers")
    ap.add_argument("figure", nargs="?", choices=sorted(BACKENDS))
    ap.add_argument("--probe", action="store_true", help="print LMCache's and torch's versions and exit")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--redis-url", default="127.0.0.1:6399", help="host:port")
    ap.add_argument("--disk-dir", default="")
    ap.add_argument("--odirect", action="store_true")
    ap.add_argument("--free-bytes", type=int, default=0)
    ap.add_argument("--cpu-pool-gb", type=float, default=1.5)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--child-timeout", type=int, default=300)
    a = ap.parse_args(argv)
    if not a.probe and a.figure is None:
        ap.error("a figure (cpu, disk, redis) or --probe is required")
    if a.figure == "disk" and not a.disk_dir:
        ap.error("the disk figure needs --disk-dir")
    return a


def probe() -> int:
    try:
        import lmcache
        import torch
    except Exception as exc:  # noqa: BLE001 - reported in one line
        print(f"PROBE_ERROR {type(exc).__name__}: {exc}", flush=True)
        return EXIT_NOT_IMPORTABLE
    print("PROBE " + json.dumps({"lmcache": getattr(lmcache, "__version__", "?"), "torch": torch.__version__}),
          flush=True)
    return 0


class _Completions:
    """Counts a backend's per-key write completions (disk and remote puts are asynchronous)."""

    def __init__(self) -> None:
        self.n = 0
        self._cv = threading.Condition()

    def done(self, _key: Any = None) -> None:
        with self._cv:
            self.n += 1
            self._cv.notify_all()

    def wait(self, n: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self.n < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"LMCache completed {self.n} of {n} writes in {timeout_s} s")
                self._cv.wait(left)


def _engine(a: argparse.Namespace, kv: Any) -> Any:
    """An LMCacheEngine for ``a.figure`` whose 'GPU' is the CPU tensor ``kv``."""
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
    from lmcache.v1.metadata import LMCacheMetadata

    shape = (a.layers, 2, a.chunk, a.kv_heads, a.head_dim)

    class TensorCopies(MockGPUConnector):
        """Copies between the chunk's memory objects and ``kv[:, :, start:end]``."""

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **_: Any) -> None:
            for obj, s, e in zip(memory_objs, starts, ends):
                obj.tensor.copy_(kv[:, :, s:e])

        def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **_: Any) -> None:
            for obj, s, e in zip(memory_objs, starts, ends):
                kv[:, :, s:e].copy_(obj.tensor)

    base: dict[str, Any] = dict(chunk_size=a.chunk, max_local_cpu_size=a.cpu_pool_gb, save_unfull_chunk=True,
                                lmcache_instance_id=f"kvtier-peers-{a.figure}")
    if a.figure == "cpu":
        cfg = LMCacheEngineConfig.from_defaults(local_cpu=True, **base)
    elif a.figure == "disk":
        cfg = LMCacheEngineConfig.from_defaults(local_cpu=False, local_disk=f"file://{a.disk_dir}/",
                                                max_local_disk_size=4.0,
                                                extra_config={"use_odirect": bool(a.odirect)}, **base)
    else:
        cfg = LMCacheEngineConfig.from_defaults(local_cpu=False, remote_url=f"redis://{a.redis_url}",
                                                remote_serde="naive", **base)
    meta = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.bfloat16, kv_shape=shape, chunk_size=a.chunk)
    eng = LMCacheEngineBuilder.get_or_create(f"kvtier-peers-{a.figure}", cfg, meta, TensorCopies(shape),
                                             lambda *_: None, lambda obj, *_: obj)
    eng.post_init()
    return eng, meta


def engine_level(a: argparse.Namespace) -> dict[str, Any]:
    """``cpu``: store() / retrieve() of a prompt's tokens, ``reps`` + 1 warm-up."""
    import torch

    T = a.tokens
    kv = torch.zeros(2, a.layers, T, a.kv_heads * a.head_dim, dtype=torch.bfloat16)
    src = torch.randn(kv.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    eng, _ = _engine(a, kv)
    _prefault(eng)
    gen = torch.Generator().manual_seed(2)
    out: dict[str, Any] = {"bytes": kv.numel() * kv.element_size(), "level": "engine", "put_s": [], "get_s": []}
    for rep in range(a.reps + 1):
        tokens = torch.randint(0, 50000, (T,), generator=gen)
        kv.copy_(src)
        before_put(a.free_bytes)
        t0 = time.perf_counter()
        eng.store(tokens)
        t1 = time.perf_counter()
        kv.zero_()
        t2 = time.perf_counter()
        mask = eng.retrieve(tokens)
        t3 = time.perf_counter()
        if int(mask.sum()) != T or not torch.equal(kv, src):
            raise SystemExit(f"LMCache returned {int(mask.sum())} of {T} tokens or wrong bytes")
        if rep:
            out["put_s"].append(t1 - t0)
            out["get_s"].append(t3 - t2)
    return out


def storage_level(a: argparse.Namespace) -> dict[str, Any]:
    """``disk`` / ``redis``: batched_submit_put_task until written, batched_get_blocking back."""
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat

    T, C = a.tokens, a.chunk
    kv = torch.zeros(2, a.layers, T, a.kv_heads * a.head_dim, dtype=torch.bfloat16)
    src = torch.randn(kv.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    eng, meta = _engine(a, kv)
    _prefault(eng)
    backends = eng.storage_manager.storage_backends
    be, cpu = backends[BACKENDS[a.figure]], backends["LocalCPUBackend"]
    writes = _Completions()
    sizes = [min(C, T - s) for s in range(0, T, C)]
    out: dict[str, Any] = {"bytes": kv.numel() * kv.element_size(), "level": "storage", "put_s": [], "get_s": []}
    for rep in range(a.reps + 1):
        objs, keys, off = [], [], 0
        for i, n in enumerate(sizes):
            obj = cpu.allocate(meta.get_shapes(n), meta.get_dtypes(), MemoryFormat.KV_2LTD)
            if obj is None:
                raise SystemExit("LMCache's CPU pool refused an allocation")
            obj.tensor.copy_(src[:, :, off : off + n])
            off += n
            objs.append(obj)
            keys.append(CacheEngineKey(MODEL, 1, 0, int.from_bytes(os.urandom(8), "little"), torch.bfloat16))
        before_put(a.free_bytes)
        writes.n = 0
        t0 = time.perf_counter()
        be.batched_submit_put_task(keys, objs, on_complete_callback=writes.done)
        writes.wait(len(keys))
        t1 = time.perf_counter()
        for obj in objs:  # the backend holds its own reference while it needs one
            obj.ref_count_down()
        t2 = time.perf_counter()
        got = be.batched_get_blocking(keys)
        t3 = time.perf_counter()
        off = 0
        for n, obj in zip(sizes, got):
            if obj is None or not torch.equal(obj.tensor, src[:, :, off : off + n]):
                raise SystemExit("LMCache missed a chunk or returned wrong bytes")
            off += n
            obj.ref_count_down()
        if rep:
            out["put_s"].append(t1 - t0)
            out["get_s"].append(t3 - t2)
    return out


def _prefault(eng: Any) -> None:
    """Touch LMCache's CPU pool once (its steady state; first-touch faults would hit the first puts)."""
    import torch

    pool = getattr(eng.storage_manager.storage_backends["LocalCPUBackend"].memory_allocator, "buffer", None)
    if isinstance(pool, torch.Tensor):
        pool.view(torch.uint8).fill_(0)


def _drop_redis_keys(url: str) -> None:
    """Delete the keys this driver wrote (LMCache's keys start with the model name)."""
    try:
        import redis

        host, port = url.rsplit(":", 1)
        r = redis.Redis(host=host, port=int(port), socket_timeout=10)
        keys = list(r.scan_iter(f"{MODEL}*", count=1000))
        for i in range(0, len(keys), 500):
            r.delete(*keys[i : i + 500])
    except Exception as exc:  # noqa: BLE001 - cleanup only
        print(f"lmcache driver: could not delete its Redis keys: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.probe:
        return probe()
    import faulthandler

    faulthandler.dump_traceback_later(a.child_timeout, exit=True)  # a hang exits with its stacks
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    import torch

    torch.set_num_threads(a.torch_threads)
    if a.figure == "disk":
        shutil.rmtree(a.disk_dir, ignore_errors=True)
    rc = 0
    try:
        res = engine_level(a) if a.figure == "cpu" else storage_level(a)
        res.update(figure=a.figure, odirect=bool(a.odirect))
        print("RESULT " + json.dumps(res), flush=True)
    except BaseException:  # noqa: BLE001 - reported; LMCache's threads would keep a raising process alive
        traceback.print_exc()
        rc = 1
    finally:
        if a.figure == "redis":
            _drop_redis_keys(a.redis_url)
        if a.figure == "disk":
            shutil.rmtree(a.disk_dir, ignore_errors=True)
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(rc)  # not LMCacheEngine.close(): see the module doc


if __name__ == "__main__":
    sys.exit(main())
