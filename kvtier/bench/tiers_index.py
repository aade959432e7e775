"""``kvtier bench tiers``: lookup latency, index memory per chunk and hashing speed (see :mod:`kvtier.bench.tiers`)."""

from __future__ import annotations

import gc
import sys
import tracemalloc
from typing import Any, Callable

import blake3
import numpy as np

from kvtier.bench.common import (
    Stopwatch,
    interleaved,
    median,
    smollm2_namespace,
)
from kvtier.config import KVTierConfig
from kvtier.index.keys import ChunkHasher, KeyNamespace, LayoutSignature
from kvtier.storage.manager import StorageManager


_LOOKUP_CHAIN = 31  # chunks per looked-up prompt (an 8,000-token prompt)


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
            if mgr.open_write(key, parent if i % chain else None) is None:
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
