"""``kvtier bench tiers``, CPU tier: put/get of a prompt's chunks against plain numpy gathers and scatters (see :mod:`kvtier.bench.tiers`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.bench.common import (
    aligned_empty,
    CacheEvictor,
    PagedKV,
    Stopwatch,
    chunk_view,
    gbps,
    interleaved,
    load_chunk_blocks,
    median,
    save_chunk_blocks,
    smollm2_namespace,
)
from kvtier.config import KVTierConfig
from kvtier.storage.manager import StorageManager



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
        buf = mgr.open_write(key, parent)
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
                buf = mgr.open_write(key, parent)
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
