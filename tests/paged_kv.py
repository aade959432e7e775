"""Paged KV caches in every vLLM 0.32 layout, built without vLLM (for the GPU-path tests).

vLLM 0.32 allocates one flat buffer per KV cache group and views it as one 4D
``[B, H, N, C]`` tensor per attention layer, with the physical order of the logical
axes ``[L, B, H, N, C]`` given by the engine's ``KVCacheLayout`` (RFC #42082;
``kvtier.integrations.vllm.gpu.layout.KV_LAYOUTS`` holds the same table). This
module builds the same views from that table, so the copy path's tests run on a
machine without vLLM (the device check); ``test_gpu_path`` checks, where vLLM is
installed, that these views equal vLLM's own ``create_kv_cache_views``.
"""

from __future__ import annotations

import torch

from kvtier.integrations.vllm.gpu.layout import KV_LAYOUTS

LAYOUTS = list(KV_LAYOUTS)


def layout_strides(layout: str, shape: tuple[int, int, int, int, int]) -> tuple[int, ...]:
    """Element strides of the logical ``[L, B, H, N, C]`` axes for ``layout`` (dense, no padding)."""
    strides = [0] * 5
    step = 1
    for dim in reversed(KV_LAYOUTS[layout]):
        strides[dim] = step
        step *= shape[dim]
    return tuple(strides)


def paged_kv(layout: str, L: int = 3, B: int = 9, H: int = 2, N: int = 4, D: int = 8,
             device: str = "cpu", seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Per-layer KV views ``dtype [B, H, N, 2*D]`` (K and V of one head and token side by side)
    over one buffer laid out as ``layout``, filled with distinct random bytes (``seed``)."""
    c = 2 * D
    shape = (L, B, H, N, c)
    st = layout_strides(layout, shape)
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(-128, 128, (L * B * H * N * c * itemsize,), dtype=torch.int8, generator=gen)
    flat = raw.to(device).view(dtype)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    return {name: torch.as_strided(flat, shape[1:], st[1:], i * st[0]) for i, name in enumerate(names)}
