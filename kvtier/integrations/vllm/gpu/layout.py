"""Reading vLLM's KV cache layout at registration, for any device (CUDA or CPU tensors).

vLLM 0.32 (RFC #42082, ``vllm.v1.kv_cache_layout``) no longer has per-backend
``get_kv_cache_shape``/``get_kv_cache_stride_order``: every attention layer's
cache is a 4D logical view ``[B, H, N, C]`` (blocks, head slots, tokens per
block, content: K and V of one (head, token), in bytes ``C * itemsize``), and one
layout per engine, a :class:`~vllm.v1.kv_cache_layout.KVCacheLayout` member
(``LBHNC``, ``LBNHC``, ``LHBNC``, ``BLHNC``, ``BLNHC``, ``BHLNC``), fixes the
physical order of ``[L, B, H, N, C]``. The engine core resolves it once, before
the connectors are built (``cache_config.kv_cache_layout``). FlashAttention and
Triton use layer-compact layouts (``LB..``), FlashInfer may use block-outermost
ones (``BL..``, the "cross-layer" variants, where one block of every layer is
adjacent in memory).

kvtier reads that name from vLLM and checks every registered tensor against it
(4D, C innermost with stride 1, strides in the declared physical order, no
overlap, one dtype and shape for all layers); a name vLLM does not define or a
tensor that does not match raises :class:`UnsupportedKVLayout` at registration.
The backend name and the layout name both go into the key namespace
(:func:`gpu_backend_and_layout`), so two layouts never share chunks.

A chunk slot holds, for each layer and block, the block's bytes in *logical*
``[H, N, C]`` order (what ``index_select`` on dim 0 of a layer view returns): for
``LBHNC`` on CPU that is exactly the bytes the numpy path (``block_copy``) copies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("kvtier.vllm")


class UnsupportedKVLayout(ValueError):
    """The engine's KV cache is not in a layout kvtier can copy correctly."""


#: vLLM 0.32's ``KVCacheLayout`` members (``vllm/v1/kv_cache_layout.py``, RFC #42082): name ->
#: physical order of the logical axes ``[L, B, H, N, C]`` (outermost first). kvtier keeps its own
#: copy so its GPU copy path (registration, gather/scatter, layer-wise streams) runs without vLLM
#: (the transformers engine, the GPU check on a machine without vLLM); a test that runs where
#: vLLM is installed keeps this table equal to vLLM's enum.
KV_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def layout_stride_order(name: str) -> tuple[int, ...]:
    """Physical order of the logical axes ``[L, B, H, N, C]`` for a vLLM layout name.

    Raises:
        UnsupportedKVLayout: ``name`` is not one of vLLM 0.32's ``KVCacheLayout`` members.
    """
    try:
        return KV_LAYOUTS[name]
    except KeyError:
        raise UnsupportedKVLayout(f"unknown KV cache layout {name!r}; vLLM defines {list(KV_LAYOUTS)}") from None


@dataclass(frozen=True)
class KVLayout:
    """The shape of one engine's paged KV, as registered.

    Attributes:
        backend: attention backend name (``AttentionBackend.get_name()``, e.g. ``"FLASH_ATTN"``).
        layout: ``KVCacheLayout`` member name, e.g. ``"LBHNC"``.
        num_layers, num_blocks: L and B.
        heads, tokens, content_bytes: H, N (tokens per block) and C in bytes.
        dtype: element dtype name, e.g. ``"bfloat16"``.
    """

    backend: str
    layout: str
    num_layers: int
    num_blocks: int
    heads: int
    tokens: int
    content_bytes: int
    dtype: str

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer's block (``H * N * C``)."""
        return self.heads * self.tokens * self.content_bytes

    @property
    def tag(self) -> str:
        """``backend/layout``: what the key namespace records."""
        return f"{self.backend}/{self.layout}"


@dataclass
class RegisteredKV:
    """The engine's KV as byte views (no copy), on the engine's device.

    Attributes:
        layout: the checked layout.
        names: layer names, in registration (layer) order.
        layers: per layer ``uint8 [B, H, N, C_bytes]`` views, strided as the layout says.
        stacked: ``uint8 [L, B, H, N, C_bytes]`` over all layers when they are one
            allocation at a constant layer stride (cross-layer copies in one op), else None.
    """

    layout: KVLayout
    names: list[str]
    layers: list["torch.Tensor"]
    stacked: "torch.Tensor | None"

    @property
    def device(self) -> "torch.device":
        return self.layers[0].device

    def layer_index(self, name: str) -> int:
        """Index of layer ``name``. Raises KeyError for a layer not registered."""
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(f"layer {name!r} was not registered with kvtier") from None


def _check_strides(name: str, shape: tuple[int, ...], strides: tuple[int, ...], order: tuple[int, ...]) -> None:
    """Strides (bytes) of a ``[B, H, N, C]`` view follow ``order`` (outer first) and do not overlap."""
    if strides[3] != 1:
        raise UnsupportedKVLayout(f"layer {name}: content axis is not contiguous (stride {strides[3]})")
    dims = [d for d in order if shape[d] > 1]
    for outer, inner in zip(dims, dims[1:]):
        if strides[outer] < strides[inner] * shape[inner]:
            raise UnsupportedKVLayout(
                f"layer {name}: strides {strides} of shape {shape} do not follow the declared physical "
                f"order {order} (axis {outer} must be outside axis {inner} without overlap)"
            )


def _byte_view(t: "torch.Tensor") -> "torch.Tensor":
    import torch

    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def register_kv(kv_caches: dict[str, "torch.Tensor"], layout_name: str, backend: str) -> RegisteredKV:
    """Check vLLM's per-layer KV tensors against ``layout_name`` and view them as bytes.

    Args:
        kv_caches: layer name -> ``[B, H, N, C]`` tensor (any dtype, any device), in layer order.
        layout_name: vLLM's resolved layout (``cache_config.kv_cache_layout``).
        backend: the attention backend name of these layers.

    Raises:
        UnsupportedKVLayout: unknown layout name; no layers; a tensor that is not 4D,
            differs in shape/dtype/device from the first, or whose strides do not
            match the layout.
    """
    order5 = layout_stride_order(layout_name)
    if not kv_caches:
        raise UnsupportedKVLayout("no KV cache layers to register")
    order4 = tuple(d - 1 for d in order5 if d != 0)  # the layer view's physical axis order
    names = list(kv_caches)
    first = kv_caches[names[0]]
    views = []
    for name in names:
        t = kv_caches[name]
        if t.dim() != 4:
            raise UnsupportedKVLayout(f"layer {name}: KV tensor has shape {tuple(t.shape)}, expected 4D [B, H, N, C]")
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise UnsupportedKVLayout(f"layer {name}: shape/dtype/device differ from layer {names[0]}")
        if t.stride(3) != 1:
            raise UnsupportedKVLayout(f"layer {name}: content axis is not contiguous (stride {t.stride(3)})")
        v = _byte_view(t)
        _check_strides(name, tuple(v.shape), tuple(v.stride()), order4)
        views.append(v)
    b, h, n, c = views[0].shape
    layout = KVLayout(backend, layout_name, len(views), b, h, n, c, str(first.dtype).removeprefix("torch."))
    return RegisteredKV(layout, names, views, _stacked(views))


def _stacked(views: list["torch.Tensor"]) -> "torch.Tensor | None":
    """All layers as one ``[L, B, H, N, C]`` strided view, if they are one allocation at a constant stride."""
    import torch

    first = views[0]
    ptr = first.untyped_storage().data_ptr()
    if any(v.untyped_storage().data_ptr() != ptr or v.stride() != first.stride() for v in views):
        return None
    offsets = [v.storage_offset() for v in views]
    step = offsets[1] - offsets[0] if len(views) > 1 else 1
    if step <= 0 or any(b - a != step for a, b in zip(offsets, offsets[1:])):
        return None
    shape, strides = (len(views), *first.shape), (step, *first.stride())
    dims = sorted((d for d in range(5) if shape[d] > 1), key=lambda d: strides[d], reverse=True)
    if any(strides[o] < strides[i] * shape[i] for o, i in zip(dims, dims[1:])):
        return None  # layers overlap: keep per-layer copies
    return torch.as_strided(first, shape, strides, offsets[0])


def check_namespace(kv: RegisteredKV, attn_backend: str, kv_layout: str, block_bytes: int) -> None:
    """Raise :class:`UnsupportedKVLayout` unless the registered KV is what the key namespace says.

    Args:
        attn_backend: the namespace's ``attn_backend`` (``device/BACKEND``, see :func:`gpu_backend_and_layout`).
        kv_layout: the namespace's ``kv_layout``.
        block_bytes: the namespace's bytes per (layer, block).
    """
    lay = kv.layout
    if kv_layout != lay.layout:
        raise UnsupportedKVLayout(f"keys were made for layout {kv_layout!r}, the engine's KV is {lay.layout!r}")
    if attn_backend.rsplit("/", 1)[-1] != lay.backend:
        raise UnsupportedKVLayout(f"keys were made for backend {attn_backend!r}, the layers run {lay.backend!r}")
    if lay.page_bytes != block_bytes:
        raise UnsupportedKVLayout(f"a block holds {lay.page_bytes} B, the namespace expects {block_bytes} B")


def layers_backend(vllm_config: Any, names: list[str]) -> str:
    """The attention backend name the layers ``names`` run (from vLLM's static forward context).

    Raises:
        UnsupportedKVLayout: a layer is unknown to vLLM, or the layers run different backends.
    """
    ctx = vllm_config.compilation_config.static_forward_context
    found: set[str] = set()
    for name in names:
        layer = ctx.get(name)
        backend = getattr(layer, "attn_backend", None) if layer is not None else None
        if backend is None:
            raise UnsupportedKVLayout(f"layer {name!r} has no attention backend in vLLM's forward context")
        found.add(backend.get_name())
    if len(found) != 1:
        raise UnsupportedKVLayout(f"layers run several attention backends {sorted(found)}; kvtier needs one")
    return found.pop()


def gpu_backend_and_layout(vllm_config: Any) -> tuple[str, str]:
    """``(device/BACKEND, LAYOUT)`` of a non-CPU vLLM engine, for the key namespace.

    The layout is ``cache_config.kv_cache_layout`` (resolved by the engine core before
    the connectors exist); ``"unresolved"`` if it is not set, which registration then
    rejects. The backend is vLLM's own choice (``vllm.v1.attention.selector.get_attn_backend``
    under this config), or the configured ``attention_config.backend`` if that fails.
    """
    from vllm.platforms import current_platform

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    layout = getattr(cc, "kv_cache_layout", None) or "unresolved"
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    try:
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.selector import get_attn_backend

        cache_dtype = None if cc.cache_dtype in (None, "auto") else cc.cache_dtype
        with set_current_vllm_config(vllm_config):
            backend = get_attn_backend(mc.get_head_size(), mc.dtype, cache_dtype).get_name()
    except Exception as exc:  # pragma: no cover - needs a GPU platform
        log.warning("kvtier: cannot ask vLLM for its attention backend (%s); keys use %r", exc, backend)
    name = getattr(backend, "name", backend) or "auto"
    return f"{current_platform.device_name}/{name}", layout
