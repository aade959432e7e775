"""Deriving kvtier's key namespace from a vLLM config, and viewing vLLM's paged KV.

vLLM's CPU backend (0.32, layout ``LBHNC``) gives each attention layer a bf16
tensor ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, all layers
views of one storage. Inside a block K is stored transposed and V token-major,
and other ISAs (AMX) may pack differently, so kvtier never interprets a block:
it copies whole blocks as bytes, and the attention backend/ISA, layout name and
shapes are part of the :class:`LayoutSignature`, hence of every key.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3
import numpy as np

from kvtier.index.keys import KeyNamespace, LayoutSignature

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)

_SAMPLE_BYTES = 1 << 20


def model_identity(model: str, revision: str | None = None, quantization: str | None = None) -> str:
    """A stable identity for the model's weights, for the key namespace.

    For a local directory: its name plus a blake3 fingerprint of ``config.json``
    and, for each weight file (``*.safetensors``/``*.bin``/``*.gguf``, sorted), its
    name, size, first and last MiB. For a hub id: the id and revision. The path
    itself is not part of it, so the same weights hit across machines.
    """
    p = Path(model)
    parts = [f"rev={revision or ''}", f"quant={quantization or ''}"]
    if not p.is_dir():
        return f"{model}@{revision or 'main'}" + ("" if not quantization else f"+{quantization}")
    h = blake3.blake3()
    for name in ("config.json", "generation_config.json"):
        f = p / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
    weights = sorted(
        f for f in p.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf", ".pt") and f.is_file()
    )
    for f in weights:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_SAMPLE_BYTES))
            if size > _SAMPLE_BYTES:
                fh.seek(max(size - _SAMPLE_BYTES, _SAMPLE_BYTES))
                h.update(fh.read(_SAMPLE_BYTES))
    h.update(";".join(parts).encode())
    return f"{p.name}#{h.hexdigest()[:32]}"


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _attention_backend(vllm_config: Any, dtype: Any, block_size: int, head_dim: int) -> tuple[str, str]:
    """(backend/ISA tag, KV layout name) of the platform vLLM will run."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        isa = "unknown"
        try:  # private in vLLM; the ISA decides block packing (AMX differs)
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(dtype, block_size, head_dim, vllm_config.cache_config.cache_dtype)
        except Exception as exc:  # pragma: no cover - depends on vLLM internals
            log.warning("kvtier: cannot determine the CPU attention ISA (%s); keys use 'unknown'", exc)
        return f"CPU_ATTN/{isa}", "LBHNC"
    from kvtier.integrations.vllm.gpu.layout import gpu_backend_and_layout

    return gpu_backend_and_layout(vllm_config)  # vLLM's backend choice and resolved layout


def namespace_from_vllm(vllm_config: Any, chunk_size: int, model_id: str | None = None) -> KeyNamespace:
    """The key namespace of a vLLM engine.

    Raises:
        ValueError: chunk_size is not a multiple of the engine block size.
    """
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    pc = vllm_config.parallel_config
    dtype = mc.dtype if cc.cache_dtype in (None, "auto") else cc.cache_dtype
    head_dim = mc.get_head_size()
    block_size = int(cc.block_size)
    backend, layout_name = _attention_backend(vllm_config, mc.dtype, block_size, head_dim)
    layout = LayoutSignature(
        engine="vllm",
        attn_backend=backend,
        kv_layout=layout_name,
        block_size=block_size,
        num_layers=mc.get_num_layers(pc),
        num_kv_heads=mc.get_num_kv_heads(pc),
        head_dim=head_dim,
        dtype=_dtype_name(dtype),
    )
    identity = model_id or model_identity(mc.model, getattr(mc, "revision", None), getattr(mc, "quantization", None))
    rank = 0
    if pc.world_size > 1:
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        except Exception:
            rank = int(os.environ.get("RANK", "0"))
    return KeyNamespace(identity, layout, chunk_size, world_size=pc.world_size, rank=rank)


def paged_views(kv_caches: dict[str, "torch.Tensor"], layout: LayoutSignature) -> list[np.ndarray]:
    """Byte views of each layer's paged KV, in layer order: ``uint8 [num_blocks, block_bytes]``.

    ``block_bytes = num_kv_heads * block_size * 2 * head_dim * itemsize``. No copy.

    Raises:
        ValueError: the tensors do not match ``layout`` (layer count, shape,
            dtype) or are not contiguous per block.
    """
    import torch

    tensors = list(kv_caches.values())
    if len(tensors) != layout.num_layers:
        raise ValueError(f"engine has {len(tensors)} KV layers, layout says {layout.num_layers}")
    expect = (layout.num_kv_heads, layout.block_size, 2 * layout.head_dim)
    views = []
    for name, t in kv_caches.items():
        if tuple(t.shape[1:]) != expect:
            raise ValueError(f"layer {name}: KV shape {tuple(t.shape)} does not match [*, {expect}]")
        if _dtype_name(t.dtype) != layout.dtype:
            raise ValueError(f"layer {name}: KV dtype {t.dtype} != {layout.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"layer {name}: KV tensor is not contiguous")
        raw = t.view(torch.uint8) if t.element_size() > 1 else t
        views.append(raw.numpy().reshape(t.shape[0], -1))
    return views


def stacked_view(kv_caches: dict[str, "torch.Tensor"], layout: LayoutSignature) -> np.ndarray | None:
    """All layers' paged KV as one ``uint8 [num_layers, num_blocks, block_bytes]`` view, or None.

    Possible when every layer is a view of one storage at evenly spaced offsets
    (vLLM's CPU backend: layer-major ``LBHNC``). Then one copy call moves a block of
    every layer, instead of one call per (layer, block). No copy of the KV is made.
    """
    import torch

    tensors = [t.view(torch.uint8) if t.element_size() > 1 else t for t in kv_caches.values()]
    if len(tensors) != layout.num_layers or not tensors:
        return None
    first = tensors[0]
    if any(t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for t in tensors):
        return None
    nbytes_layer = first.numel()
    offsets = [t.storage_offset() for t in tensors]
    step = offsets[1] - offsets[0] if len(offsets) > 1 else nbytes_layer
    if step < nbytes_layer or any(b - a != step for a, b in zip(offsets, offsets[1:])):
        return None
    num_blocks = first.shape[0]
    block_bytes = nbytes_layer // num_blocks
    stacked = torch.as_strided(
        first, (len(tensors), num_blocks, block_bytes), (step, block_bytes, 1), storage_offset=offsets[0]
    )
    return stacked.numpy()

