"""Host <-> device copy bandwidth of kvtier's GPU path against torch's raw ``copy_`` (the GPU check).

Every figure pairs what kvtier does with torch's plain ``Tensor.copy_`` between the same
kinds of memory, measured in the same run, as a ratio (kvtier / raw; 1.0 is the ceiling):

- ``chunk_h2d`` / ``chunk_d2h``: one chunk (5.9 MB: 256 tokens of SmolLM2-135M, 23,040 B per
  token) between a slot of kvtier's :class:`~kvtier.memory.pool.ChunkPool` (page-locked
  when CUDA is present) and device memory, against a freshly pinned tensor of the same size;
- ``batch_h2d`` / ``batch_d2h``: 20 chunks (118 MB) from 20 pool slots, one
  ``non_blocking`` copy each and one synchronisation, against one raw copy of 118 MB;
- ``scatter`` / ``gather``: the layer-wise paths of a paged KV cache (SmolLM2's shape in
  16-token blocks, layout ``LBHNC``: per layer, ``index_copy_`` / ``index_select`` of a
  chunk's 16 blocks, :mod:`kvtier.service.block_copy`) for 20 chunks with their blocks
  scattered over the cache, against the raw copy of the same bytes;
- ``pinned_vs_pageable_h2d``: the raw copy from pinned memory over the same copy from
  pageable (``numpy``) memory: well above 1 on a real GPU, which shows the pool's pages
  really are page-locked (``pool_pinned`` says what the pool reports).

Bandwidth in GB/s (1e9 B/s), median of ``rounds`` timed repetitions after a warm-up, timed
with CUDA events (host clock on the CPU). Every kvtier copy is checked byte for byte after
timing. On a machine without CUDA the same code runs on CPU tensors (``--device cpu``): the
figures then only show that it runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from kvtier.memory.pool import ChunkPool
from kvtier.service.block_copy import gather, scatter

#: SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, bf16: K+V = 23,040 B per token.
LAYERS, HEADS, HEAD_DIM, ITEM = 30, 3, 64, 2
CHUNK_TOKENS, BLOCK_TOKENS = 256, 16
CHUNK_BYTES = CHUNK_TOKENS * LAYERS * 2 * HEADS * HEAD_DIM * ITEM  # 5,898,240


class Timer:
    """Seconds of ``fn()`` on ``device``: CUDA events around it, or the host clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def _gbps(nbytes: int, timer: Timer, fn: Callable[[], object], rounds: int) -> float:
    fn()  # warm-up
    return nbytes / statistics.median(timer(fn) for _ in range(rounds)) / 1e9


def measure(device: str = "cuda", rounds: int = 10, batch_chunks: int = 20) -> dict[str, Any]:
    """All figures (see the module docstring) as one dict; raises AssertionError on a wrong byte."""
    dev = torch.device(device)
    timer = Timer(dev)
    cuda = dev.type == "cuda"
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "rounds": rounds,
                           "chunk_bytes": CHUNK_BYTES, "batch_bytes": batch_chunks * CHUNK_BYTES}
    pool = ChunkPool(CHUNK_BYTES, batch_chunks + 1)
    out["pool_pinned"] = pool.pinned
    slots = [pool.alloc() for _ in range(batch_chunks)]
    host = [torch.from_numpy(pool.view(s)) for s in slots]
    for i, h in enumerate(host):
        h.copy_(torch.randint(0, 256, (CHUNK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)))
    dev_chunks = torch.empty(batch_chunks, CHUNK_BYTES, dtype=torch.uint8, device=dev)
    raw_host = torch.empty(batch_chunks * CHUNK_BYTES, dtype=torch.uint8, pin_memory=cuda)
    raw_dev = torch.empty_like(raw_host, device=dev)
    pageable = torch.from_numpy(np.ones(CHUNK_BYTES, dtype=np.uint8))

    def pair(name: str, nbytes: int, ours: Callable[[], object], raw: Callable[[], object]) -> None:
        a, b = _gbps(nbytes, timer, ours, rounds), _gbps(nbytes, timer, raw, rounds)
        out[f"{name}_gbps"], out[f"raw_{name}_gbps"], out[f"{name}_ratio"] = round(a, 2), round(b, 2), round(a / b, 3)

    pair("chunk_h2d", CHUNK_BYTES, lambda: dev_chunks[0].copy_(host[0], non_blocking=True),
         lambda: raw_dev[:CHUNK_BYTES].copy_(raw_host[:CHUNK_BYTES], non_blocking=True))
    pair("chunk_d2h", CHUNK_BYTES, lambda: host[0].copy_(dev_chunks[1], non_blocking=True),
         lambda: raw_host[:CHUNK_BYTES].copy_(raw_dev[:CHUNK_BYTES], non_blocking=True))

    def batch_h2d() -> None:
        for i, h in enumerate(host):
            dev_chunks[i].copy_(h, non_blocking=True)

    def batch_d2h() -> None:
        for i, h in enumerate(host):
            h.copy_(dev_chunks[i], non_blocking=True)

    nb = batch_chunks * CHUNK_BYTES
    pair("batch_h2d", nb, batch_h2d, lambda: raw_dev.copy_(raw_host, non_blocking=True))
    if cuda:
        torch.cuda.synchronize()
    want = [h.clone() for h in host]
    batch_h2d()
    for h in host:
        h.zero_()
    batch_d2h()
    if cuda:
        torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(host, want)), "a pool slot came back from the device changed"
    pair("batch_d2h", nb, batch_d2h, lambda: raw_host.copy_(raw_dev, non_blocking=True))
    pinned = _gbps(CHUNK_BYTES, timer, lambda: raw_dev[:CHUNK_BYTES].copy_(raw_host[:CHUNK_BYTES], non_blocking=True), rounds)
    unpinned = _gbps(CHUNK_BYTES, timer, lambda: raw_dev[:CHUNK_BYTES].copy_(pageable, non_blocking=True), rounds)
    out["pageable_h2d_gbps"], out["pinned_vs_pageable_h2d"] = round(unpinned, 2), round(pinned / unpinned, 3)
    out.update(_paged(dev, timer, host, raw_host, raw_dev, rounds))
    return out


def _paged(dev: torch.device, timer: Timer, host: list[torch.Tensor], raw_host: torch.Tensor, raw_dev: torch.Tensor,
           rounds: int) -> dict[str, Any]:
    """``scatter`` / ``gather`` of ``len(host)`` chunks into a paged ``LBHNC`` cache, against raw copies."""
    n = len(host)
    bpc = CHUNK_TOKENS // BLOCK_TOKENS
    num_blocks = 4 * n * bpc
    c = 2 * HEAD_DIM * ITEM
    kv = torch.zeros(LAYERS, num_blocks, HEADS, BLOCK_TOKENS, c, dtype=torch.uint8, device=dev)
    layers = [kv[i] for i in range(LAYERS)]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(5))[: n * bpc]
    ids = [perm[i * bpc:(i + 1) * bpc].to(dev) for i in range(n)]
    slots = [h.view(LAYERS, bpc, -1) for h in host]

    def scatter_all() -> None:
        for s, i in zip(slots, ids):
            scatter(s, layers, kv, i)

    def gather_all() -> None:
        for s, i in zip(slots, ids):
            gather(layers, kv, i, s)

    nb = n * CHUNK_BYTES
    res: dict[str, Any] = {}
    for name, ours, raw in (("scatter", scatter_all, lambda: raw_dev.copy_(raw_host, non_blocking=True)),
                            ("gather", gather_all, lambda: raw_host.copy_(raw_dev, non_blocking=True))):
        a, b = _gbps(nb, timer, ours, rounds), _gbps(nb, timer, raw, rounds)
        res[f"{name}_gbps"], res[f"raw_{name}_gbps"], res[f"{name}_ratio"] = round(a, 2), round(b, 2), round(a / b, 3)
    want = [s.clone() for s in slots]
    scatter_all()
    for s in slots:
        s.zero_()
    gather_all()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(slots, want)), "a chunk scattered and gathered back changed"
    res["paged_blocks"] = num_blocks
    return res


def verdict(r: dict[str, Any]) -> tuple[bool, str]:
    """Pass on a CUDA device: the pool is pinned, pinned copies beat pageable ones, every kvtier
    figure is >= 0.8x its raw copy (``copies_at_least_0_8``)."""
    ratios = {k: v for k, v in r.items() if k.endswith("_ratio")}
    slow = sorted(k for k, v in ratios.items() if v < 0.8)
    ok = bool(r["pool_pinned"]) and r["pinned_vs_pageable_h2d"] > 1.2 and not slow
    why = f"pool_pinned={r['pool_pinned']} pinned/pageable={r['pinned_vs_pageable_h2d']} below 0.8x: {slow or 'none'}"
    return ok, why


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--batch-chunks", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # strided host copies are ~15x slower with torch's default threads here
    r = measure(args.device, args.rounds, args.batch_chunks)
    ok, why = verdict(r)
    r["pass"] = ok if args.device.startswith("cuda") else None
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    keys = ("chunk_h2d", "chunk_d2h", "batch_h2d", "batch_d2h", "scatter", "gather")
    figures = ", ".join(f"{k} {r[k + '_gbps']} GB/s ({r[k + '_ratio']}x raw)" for k in keys)
    judged = f"{why} -> {'PASS' if ok else 'FAIL'}" if args.device.startswith("cuda") else "CPU tensors: ran, not judged"
    print(f"copies on {r['device']}: {figures}; {judged}")
    return 0 if ok or not args.device.startswith("cuda") else 1


if __name__ == "__main__":
    sys.exit(main())
