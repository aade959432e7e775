"""Child processes of ``kvtier bench peers``: kvtier's side of each figure and the physical baselines.

Run as ``python -m kvtier.bench.peers_side SIDE FIGURE [options]``; prints one line
``RESULT <json>`` with ``bytes`` and per-repetition seconds (``put_s``, ``get_s``;
one unrecorded warm-up first), the shape the LMCache peer script reports.

Before every timed put each side calls :func:`~kvtier.bench.memory_state.before_put`
(``os.sync()``, then free ``free_bytes`` of freshly touched memory), so every side's
writes find the same kind of free pages; the LMCache driver
(:mod:`kvtier.bench.lmcache_driver`) calls the very same function.

Figures (KV ``[2, layers, tokens, kv_heads * head_dim]`` bf16, 256-token chunks):

- ``cpu``: engine level, as LMCache's ``store()``/``retrieve()``: hash the tokens,
  ``StorageManager.open_write`` + copy each chunk out of the KV tensor + ``commit``;
  get = ``lookup_keys`` with a lease + ``open_read`` + copy back + release.
- ``disk`` / ``disk_direct``: storage level, as LMCache's
  ``batched_submit_put_task``/``batched_get_blocking``: one ``DiskTier.put_many`` of
  the prompt's chunks from CPU pool slots, one ``get_many_into`` (checksum verified)
  back into those slots: LMCache's get lands in the pool blocks its put just freed
  (first-fit allocator) and the plain baseline reads into the buffers it wrote from,
  so all three write into memory the put just read (in a paired A/B on the 2-vCPU
  VM, a get into other, untouched slots ran 1.5x slower).
- ``redis``: one ``RedisTier.put_many`` / ``get_many_into`` of the chunks.
- ``baseline``: the physical baselines (:mod:`kvtier.bench.peers_baseline`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Any

import numpy as np

from kvtier.bench.memory_state import before_put, free_fresh_memory
from kvtier.bench.peers_shape import Shape as _Shape
from kvtier.bench.peers_shape import kv_pair as _kv
from kvtier.bench.peers_shape import timed as _timed

__all__ = ["before_put", "free_fresh_memory", "main"]


def _namespace(s: _Shape) -> Any:
    """A key namespace of this shape (bf16; SmolLM2-135M's with the defaults)."""
    from kvtier.bench.common import BLOCK_SIZE
    from kvtier.index.keys import KeyNamespace, LayoutSignature

    layout = LayoutSignature(engine="bench", attn_backend="numpy", kv_layout="LBHNC", block_size=min(BLOCK_SIZE, s.CH),
                             num_layers=s.L, num_kv_heads=s.H, head_dim=s.D, dtype="bfloat16")
    return KeyNamespace("bench/peers", layout, s.CH)


# -- kvtier --------------------------------------------------------------------------------
def kvtier_cpu(a: argparse.Namespace, s: _Shape) -> dict[str, Any]:
    from kvtier.config import KVTierConfig
    from kvtier.index.keys import ChunkHasher
    from kvtier.storage.manager import StorageManager

    if s.T % s.CH:
        raise SystemExit("the cpu figure needs tokens that are a multiple of the chunk size")
    ns = _namespace(s)
    if ns.chunk_bytes != s.chunk_bytes:
        raise SystemExit(f"namespace chunks of {ns.chunk_bytes} B, the shape's {s.chunk_bytes}")
    mgr = StorageManager(KVTierConfig(cpu_capacity=2 * s.nbytes, chunk_size=s.CH, disk_path=None), ns)
    hasher = ChunkHasher(ns)
    kv, src = _kv(s)
    rng = np.random.default_rng(7)
    out: dict[str, Any] = {"bytes": s.nbytes, "put_s": [], "get_s": []}
    prev: list[bytes] = []
    for rep in range(a.reps + 1):
        for k in reversed(prev):  # untimed: room for this repetition's keys
            mgr.cpu.delete(k)
        tokens = [int(t) for t in rng.integers(0, 50000, size=s.T)]
        np.copyto(kv, src)
        before_put(a.free_bytes)

        def put() -> None:
            keys = hasher.keys(tokens)
            parent = None
            for i, key in enumerate(keys):
                buf = mgr.open_write(key, parent)
                if buf is None:
                    raise RuntimeError("CPU tier refused a store")
                np.copyto(buf.view(np.uint16).reshape(2, s.L, s.CH, s.HD), kv[:, :, i * s.CH : (i + 1) * s.CH])
                mgr.commit(key, parent)
                parent = key
            prev[:] = keys

        tp = _timed(put)
        kv.fill(0)

        def get() -> None:
            keys = hasher.keys(tokens)
            res = mgr.lookup_keys(keys, lease_owner="peers")
            if len(res.keys) != len(keys):
                raise RuntimeError("CPU tier missed a stored chunk")
            parent = None
            for i, key in enumerate(res.keys):
                h = mgr.open_read(key, parent)
                if h is None:
                    raise RuntimeError("CPU tier missed a stored chunk")
                with h:
                    np.copyto(kv[:, :, i * s.CH : (i + 1) * s.CH], h.buffer.view(np.uint16).reshape(2, s.L, s.CH, s.HD))
                parent = key
            mgr.release("peers")

        tg = _timed(get)
        if not np.array_equal(kv, src):
            raise RuntimeError("kvtier CPU tier returned wrong bytes")
        if rep:
            out["put_s"].append(tp)
            out["get_s"].append(tg)
    return out


def kvtier_disk(a: argparse.Namespace, s: _Shape, direct: bool) -> dict[str, Any]:
    """The disk figures; ``--no-verify``: the tier with ``verify_reads=False`` (``disk_verify_reads = false``)."""
    from kvtier.memory.pool import ChunkPool
    from kvtier.tiers.base import ChunkWrite
    from kvtier.tiers.disk import DiskTier

    d = os.path.join(a.work_dir, "kvtier-disk")
    shutil.rmtree(d, ignore_errors=True)
    tier = DiskTier(d, 4 << 30, _namespace(s).digest(), direct_io=direct, io_threads=a.io_threads,
                    verify_reads=not a.no_verify)
    if direct and not tier.direct_io:
        tier.close()
        raise SystemExit("the file system refuses O_DIRECT")
    n = len(s.sizes)
    _, src_kv = _kv(s)
    src, spare = ChunkPool(s.chunk_bytes, n), ChunkPool(s.chunk_bytes, n)
    views, refs = [], []
    for i, m in enumerate(s.sizes):
        nb = 2 * s.L * m * s.HD * 2
        src.view(i)[:nb].view(np.uint16).reshape(2, s.L, m, s.HD)[:] = src_kv[:, :, i * s.CH : i * s.CH + m]
        views.append((src.view(i)[:nb], spare.view(i)[:nb]))
        refs.append(src.view(i)[:nb].copy())
    out: dict[str, Any] = {"bytes": s.nbytes, "put_s": [], "get_s": [], "direct_io": tier.direct_io,
                           "verify_reads": not a.no_verify}
    try:
        for rep in range(a.reps + 1):
            keys = [os.urandom(32) for _ in range(n)]
            writes = [ChunkWrite(k, keys[i - 1] if i else None, views[i][0]) for i, k in enumerate(keys)]
            before_put(a.free_bytes)
            ok: list[bool] = []
            tp = _timed(lambda: ok.extend(tier.put_many(writes)))
            if not all(ok):
                raise RuntimeError("disk tier refused a write")
            # The timed gets read back into the slots the put wrote from, as LMCache's does (its
            # first-fit pool hands the get the blocks the put just freed) and the plain baseline
            # does (same buffers); the warm-up reads into spare slots (pre-filled with ones), so a get that wrote
            # nothing could not pass the comparison with the reference copy.
            dsts = [v[1] if rep == 0 else v[0] for v in views]
            got: list[bool] = []
            tg = _timed(lambda: got.extend(tier.get_many_into(list(zip(keys, dsts)))))
            if not all(got) or not all(np.array_equal(d, r) for d, r in zip(dsts, refs)):
                raise RuntimeError("disk tier returned wrong bytes")
            if rep:
                out["put_s"].append(tp)
                out["get_s"].append(tg)
    finally:
        tier.close()
        shutil.rmtree(d, ignore_errors=True)
    return out


def kvtier_redis(a: argparse.Namespace, s: _Shape) -> dict[str, Any]:
    from kvtier.tiers.base import ChunkWrite
    from kvtier.tiers.redis_tier import RedisTier

    prefix = f"kvtier-peers:{os.urandom(6).hex()}:"
    tier = RedisTier.from_url(f"redis://{a.redis_url}", key_prefix=prefix, timeout_s=60.0, connect_timeout_s=5.0)
    _, src_kv = _kv(s)
    payloads = [np.ascontiguousarray(src_kv[:, :, i * s.CH : i * s.CH + m]).view(np.uint8).reshape(-1)
                for i, m in enumerate(s.sizes)]
    outs = [np.zeros_like(p) for p in payloads]
    out: dict[str, Any] = {"bytes": s.nbytes, "put_s": [], "get_s": []}
    all_keys: list[bytes] = []
    try:
        for rep in range(a.reps + 1):
            keys = [os.urandom(32) for _ in payloads]
            all_keys += keys
            writes = [ChunkWrite(k, keys[i - 1] if i else None, p) for i, (k, p) in enumerate(zip(keys, payloads))]
            before_put(a.free_bytes)
            ok: list[bool] = []
            tp = _timed(lambda: ok.extend(tier.put_many(writes)))
            got: list[bool] = []
            tg = _timed(lambda: got.extend(tier.get_many_into(list(zip(keys, outs)))))
            if not all(ok) or not all(got) or not all(np.array_equal(o, p) for o, p in zip(outs, payloads)):
                raise RuntimeError("Redis tier failed a round trip")
            if rep:
                out["put_s"].append(tp)
                out["get_s"].append(tg)
    finally:
        tier.delete_many(all_keys)
        tier.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvtier.bench.peers_side")
    ap.add_argument("figure", choices=("cpu", "disk", "disk_direct", "redis", "baseline"))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--redis-url", default="127.0.0.1:6399")
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--free-bytes", type=int, default=0)
    ap.add_argument("--no-verify", action="store_true", help="disk figures: read verification off")
    a = ap.parse_args(argv)
    s = _Shape(a)
    if a.figure == "cpu":
        res = kvtier_cpu(a, s)
    elif a.figure in ("disk", "disk_direct"):
        res = kvtier_disk(a, s, a.figure == "disk_direct")
    elif a.figure == "redis":
        res = kvtier_redis(a, s)
    else:
        from kvtier.bench.peers_baseline import baselines

        res = baselines(a, s)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
