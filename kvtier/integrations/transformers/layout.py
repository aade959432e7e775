"""Key namespace and chunk payload layout of a Hugging Face ``transformers`` model.

Supported: ``transformers`` 5.x (developed and tested with 5.19.0) and its
``DynamicCache``, whose ``layers[i].keys`` / ``.values`` are
``[batch, num_kv_heads, seq_len, head_dim]`` tensors in the model's dtype (keys
after RoPE, so a cached prefix must start at position 0, which every kvtier
prefix does). Other major versions are refused by :func:`check_transformers`.

A chunk's payload is the K and V of ``chunk_size`` tokens of every layer, laid out
``[num_layers, 2 (K, V), num_kv_heads, chunk_size, head_dim]`` in the model's
dtype (layout name ``"L2HTD"``), i.e. ``chunk_size * bytes_per_token`` bytes. The
:class:`LayoutSignature` says ``engine="hf-transformers"``, so keys never collide
with vLLM's (whose engine is ``"vllm"``), even for the same model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.index.keys import KeyNamespace, LayoutSignature
from kvtier.integrations.vllm_layout import model_identity

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: Engine name in the layout signature.
ENGINE = "hf-transformers"
#: Payload layout name (see the module docstring).
KV_LAYOUT = "L2HTD"
#: Major versions of transformers this integration supports.
SUPPORTED_MAJOR = (5,)


class UnsupportedModel(ValueError):
    """The model or the installed transformers cannot be served by this integration."""


def check_transformers() -> str:
    """The installed transformers version, if supported.

    Raises:
        UnsupportedModel: transformers is missing, of another major version, or lacks
            ``DynamicCache.layers``.
    """
    try:
        import transformers
        from transformers import DynamicCache
    except ImportError as exc:  # pragma: no cover - transformers is a dependency
        raise UnsupportedModel(f"kvtier's transformers integration needs transformers 5.x: {exc}") from exc
    version = transformers.__version__
    major = int(version.split(".")[0])
    if major not in SUPPORTED_MAJOR or not hasattr(DynamicCache(), "layers"):
        raise UnsupportedModel(
            f"transformers {version} is not supported by kvtier.integrations.transformers "
            f"(supported: {', '.join(f'{m}.x' for m in SUPPORTED_MAJOR)} with DynamicCache layers)"
        )
    return version


def _text_config(model: Any) -> Any:
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def kv_shape(model: Any) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a decoder model's KV cache.

    Raises:
        UnsupportedModel: the config lacks them, or the model has sliding-window,
            linear-attention or other non-full-attention layers.
    """
    cfg = _text_config(model)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise UnsupportedModel(
            f"only models whose every layer is full attention are supported; got layer types {sorted(set(layer_types))}"
        )
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        raise UnsupportedModel(f"sliding-window attention (window {cfg.sliding_window}) is not supported")
    try:
        layers = int(cfg.num_hidden_layers)
        heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    except AttributeError as exc:
        raise UnsupportedModel(f"cannot read the KV shape from the model config: {exc}") from exc
    return layers, heads, head_dim


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def hf_namespace(model: Any, chunk_size: int, model_id: str | None = None) -> KeyNamespace:
    """The key namespace of ``model`` (a ``PreTrainedModel``) with ``chunk_size``-token chunks.

    ``model_id`` defaults to :func:`kvtier.integrations.vllm_layout.model_identity` of
    ``model.config._name_or_path`` (a weights fingerprint for a local folder), so the same
    weights give the same model identity under every engine; the layout differs.

    Raises:
        UnsupportedModel: see :func:`check_transformers` and :func:`kv_shape`.
    """
    version = check_transformers()
    layers, heads, head_dim = kv_shape(model)
    attn = getattr(model.config, "_attn_implementation", None) or "eager"
    layout = LayoutSignature(
        engine=ENGINE,
        attn_backend=f"transformers-{version.split('.')[0]}/{attn}",
        kv_layout=KV_LAYOUT,
        block_size=chunk_size,
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=dtype_name(model.dtype),
    )
    if model_id is None:
        model_id = model_identity(str(getattr(model.config, "_name_or_path", "") or type(model).__name__))
    return KeyNamespace(model=model_id, layout=layout, chunk_size=chunk_size)
