"""kvtier's key namespace for an SGLang HiCache host pool, and SGLang page hashes as kvtier keys.

SGLang pages are ``page_size`` tokens; a page's flat data (``host_pool.get_data_page(i,
flat=True)``) holds K and V of every layer (MHA) or the latent of every layer (MLA), in
the host pool's layout (``layer_first`` / ``page_first`` / ``page_first_direct``). One
kvtier chunk holds one page, byte for byte: ``chunk_size = page_size`` and the
:class:`LayoutSignature` (engine ``"sglang"``) records the pool layout, the attention
kind and the real head shape, so chunks of different engines or layouts never mix.

SGLang names a page by a hex hash chained over its prefix (its ``get_hash_str``); the
kvtier key of page hash ``h`` is ``blake3(root || "sglang-page/v1" || h)`` where ``root``
is :meth:`KeyNamespace.root` (model, layout, rank, chunk size), so the same hash under
another model, layout or rank is another key.
"""

from __future__ import annotations

from typing import Any

import blake3

from kvtier.index.keys import KeyNamespace, LayoutSignature

ENGINE = "sglang"
_PAGE_DOMAIN = b"sglang-page/v1\x00"
#: Smallest SGLang page kvtier stores (KVTierConfig.chunk_size's lower bound).
MIN_PAGE_SIZE = 16


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def namespace_for_pool(host_pool: Any, storage_config: Any, model_id: str | None = None) -> KeyNamespace:
    """The key namespace of ``host_pool`` (an SGLang ``HostKVCache``) under ``storage_config``.

    Rank: MHA pages differ per TP rank (each holds its heads), so ``world_size =
    tp * pp * cp`` and ``rank`` is this worker's position; MLA pages are the same on every
    TP rank (shared across TP, as SGLang's file backend does), so TP is left out.

    Raises:
        ValueError: page size below :data:`MIN_PAGE_SIZE`, or a page whose size does not
            split into K and V of whole elements.
    """
    page_size = int(host_pool.page_size)
    if page_size < MIN_PAGE_SIZE:
        raise ValueError(f"kvtier stores SGLang pages of >= {MIN_PAGE_SIZE} tokens; got --page-size {page_size} "
                         "(use e.g. --page-size 64)")
    page = host_pool.get_dummy_flat_data_page()
    itemsize = page.element_size()
    numel = page.numel()
    layers = int(getattr(host_pool, "layer_num", 1) or 1)
    per_token_layer, rem = divmod(numel, page_size * layers)
    if rem or per_token_layer % 2:
        layers, per_token_layer = 1, numel // page_size
        if numel % page_size or per_token_layer % 2:
            raise ValueError(f"SGLang page of {numel} elements does not split into {page_size} tokens of K and V")
    mla = bool(getattr(storage_config, "is_mla_model", False))
    heads, head_dim = getattr(host_pool, "head_num", None), getattr(host_pool, "head_dim", None)
    shape = f"H{heads}xD{head_dim}" if heads and head_dim else f"E{per_token_layer}"
    layout = LayoutSignature(
        engine=ENGINE,
        attn_backend="hicache/" + ("mla" if mla else "mha"),
        kv_layout=f"{getattr(host_pool, 'layout', 'unknown')}/{shape}",
        block_size=page_size,
        num_layers=layers,
        num_kv_heads=1,
        head_dim=per_token_layer // 2,
        dtype=_dtype_name(page.dtype),
    )
    tp = 1 if mla else int(getattr(storage_config, "tp_size", 1) or 1)
    tp_rank = 0 if mla else int(getattr(storage_config, "tp_rank", 0) or 0)
    pp, pp_rank = int(getattr(storage_config, "pp_size", 1) or 1), int(getattr(storage_config, "pp_rank", 0) or 0)
    cp = int(getattr(storage_config, "attn_cp_size", 1) or 1)
    cp_rank = int(getattr(storage_config, "attn_cp_rank", 0) or 0)
    model = model_id or str(getattr(storage_config, "model_name", None) or "unknown-model")
    ns = KeyNamespace(model=model, layout=layout, chunk_size=page_size, world_size=tp * pp * cp,
                      rank=(pp_rank * cp + cp_rank) * tp + tp_rank)
    if ns.chunk_bytes != numel * itemsize:  # pragma: no cover - guarded by the arithmetic above
        raise ValueError(f"namespace chunk of {ns.chunk_bytes} B != SGLang page of {numel * itemsize} B")
    return ns


class PageKeys:
    """SGLang page hashes -> kvtier chunk keys of one namespace (see the module docstring)."""

    def __init__(self, namespace: KeyNamespace):
        self._root = namespace.root(None)

    def key(self, page_hash: str) -> bytes:
        """The 32-byte kvtier key of SGLang page hash ``page_hash``.

        Raises:
            TypeError: ``page_hash`` is not a non-empty str.
        """
        if not isinstance(page_hash, str) or not page_hash:
            raise TypeError(f"SGLang page keys are non-empty strings, got {page_hash!r}")
        return blake3.blake3(self._root).update(_PAGE_DOMAIN).update(page_hash.encode()).digest()

    def keys(self, page_hashes: list[str]) -> list[bytes]:
        return [self.key(h) for h in page_hashes]
