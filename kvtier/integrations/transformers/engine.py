"""``KVTierHF``: kvtier prefix reuse for ``model.generate()`` of Hugging Face transformers.

Per prompt row (left padding allowed, read from ``attention_mask``):

1. the real tokens are looked up (kvtier's prefix-chained chunk keys, never the whole
   prompt: at least one token is computed);
2. the hit chunks are read (any tier: CPU, disk, remote, or a ``kvtier server``) into
   one ``DynamicCache`` covering padded positions ``[0, P)``, where
   ``P = min over rows of (pad + usable hit)``: every row's cached part must end at the
   same position, so a row may use fewer cached tokens than it hit (a partial chunk
   is fine; padding positions hold zeros and are masked);
3. ``model.generate`` prefills positions ``[P, T)`` and goes on;
4. every full chunk of each prompt not yet stored is copied out of the cache and
   stored (write-behind reaches the lower tiers).

Numerics: a hit splits the prefill at ``P``; in bf16 a split prefill may round
differently from one pass over the prompt, so the reference for "identical answers"
is a cold run split at the same position (as vLLM's own prefix cache, and as
:mod:`kvtier.demo` compares). See tests/test_hf_e2e.py.

A failing tier is a miss; a failed store is logged and skipped; ``generate`` never
fails because of kvtier.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.config import KVTierConfig
from kvtier.index.keys import ChunkHasher, KeyNamespace, chain_parents
from kvtier.integrations.transformers.layout import UnsupportedModel, hf_namespace
from kvtier.integrations.transformers.payload import chunk_view, load_chunk, save_chunk
from kvtier.storage.backend import KVStore
from kvtier.storage.types import WriteSkip

log = logging.getLogger("kvtier.hf")


def open_store(config: KVTierConfig, namespace: KeyNamespace) -> KVStore:
    """The store ``config`` names: a ``kvtier server`` client (``config.server``) or an
    embedded :class:`~kvtier.storage.manager.StorageManager`."""
    if config.server:
        from kvtier.service.client import ServiceClient

        return ServiceClient(config.server, namespace, timeout_s=config.server_timeout_s,
                             token=config.server_token, wait_connected_s=min(5.0, 10 * config.server_timeout_s))
    from kvtier.transfer.assembly import open_manager

    return open_manager(config, namespace)


@dataclass
class PrefixLoad:
    """What :meth:`KVTierHF.load_prefix` found.

    Attributes:
        cache: ``DynamicCache`` holding padded positions ``[0, cached_len)`` of every row.
        cached_len: ``P``, positions in ``cache`` (padding included), < the prompt length.
        hit_tokens: per row, real tokens taken from kvtier (``max(0, P - pad)``).
        pads: per row, left padding tokens.
    """

    cache: Any
    cached_len: int
    hit_tokens: list[int]
    pads: list[int]


class KVTierHF:
    """kvtier for one transformers causal LM (full-attention decoder, 5.x ``DynamicCache``).

    Args:
        model: a ``PreTrainedModel`` (any device; chunks travel through CPU memory).
        store: a :class:`~kvtier.config.KVTierConfig` (an embedded manager, or a
            ``kvtier server`` client when ``server`` is set; closed by :meth:`close`), or
            an open :class:`~kvtier.storage.backend.KVStore` of this model's namespace
            (see :func:`~kvtier.integrations.transformers.layout.hf_namespace`; the caller closes it).
        model_id: model identity for the key namespace (default: weights fingerprint).
        cache_salt: tenant salt folded into every key (None: none).

    Raises:
        UnsupportedModel: transformers version or model architecture not supported.
        TypeError: ``store`` is neither a config nor a store with a ``namespace``.
        ValueError: a given store's namespace differs from this model's.
    """

    def __init__(self, model: Any, store: KVTierConfig | KVStore, *, model_id: str | None = None,
                 cache_salt: str | None = None):
        self.model = model
        self.cache_salt = cache_salt
        if isinstance(store, KVTierConfig):
            self.namespace = hf_namespace(model, store.chunk_size, model_id)
            self.store: KVStore = open_store(store, self.namespace)
            self._owns_store = True
        else:
            ns = getattr(store, "namespace", None)
            if not isinstance(ns, KeyNamespace):
                raise TypeError("store must be a KVTierConfig or a KVStore with a .namespace")
            self.namespace = hf_namespace(model, ns.chunk_size, model_id or ns.model)
            if ns != self.namespace:
                raise ValueError(f"the store's namespace {ns} is not this model's {self.namespace}")
            self.store = store
            self._owns_store = False
        self.chunk_size = self.namespace.chunk_size
        self.hasher = ChunkHasher(self.namespace)
        self.dtype = model.dtype
        #: Per row, tokens the last :meth:`generate` took from kvtier.
        self.last_hit_tokens: list[int] = []

    # -- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _pads(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
        """Left padding per row. Raises ValueError for right padding or holes in the mask."""
        if attention_mask is None:
            return [0] * input_ids.shape[0]
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
        pads = []
        for row in attention_mask.to("cpu", torch.long):
            pad = int((row == 0).sum())
            if pad == row.numel() or bool((row[:pad] != 0).any()) or bool((row[pad:] != 1).any()):
                raise ValueError("kvtier needs left padding: each attention_mask row must be 0...0 1...1 "
                                 "with at least one 1 (right padding or holes are not supported)")
            pads.append(pad)
        return pads

    def _new_cache(self, data: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Any:
        from transformers import DynamicCache

        return DynamicCache(data, config=self.model.config) if data else DynamicCache(config=self.model.config)

    # -- load ---------------------------------------------------------------------------------
    def load_prefix(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> PrefixLoad:
        """Read the stored prefixes of ``input_ids`` (``long [B, T]``) into a new ``DynamicCache``.

        Raises:
            ValueError: ``input_ids`` not 2-D, or a mask that is not left padding.
        """
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [batch, tokens] with tokens > 0, got {tuple(input_ids.shape)}")
        B = input_ids.shape[0]
        pads = self._pads(input_ids, attention_mask)
        ids = input_ids.to("cpu").numpy()
        C = self.chunk_size
        per_row: list[list[Any]] = []
        try:
            for b in range(B):
                tokens = ids[b, pads[b]:]
                try:
                    max_chunks = max(0, (len(tokens) - 1) // C)  # never the whole prompt
                    want = self.hasher.keys(tokens, self.cache_salt, max_chunks=max_chunks)
                    keys = self.store.lookup_keys(want).keys if want else []
                    handles = self.store.open_read_many([(k, keys[i - 1] if i else None) for i, k in enumerate(keys)])
                except (TypeError, ValueError):
                    raise
                except Exception:  # defensive: a failing store is a miss
                    log.exception("kvtier: lookup/read failed; treating row %d as a miss", b)
                    handles = []
                usable = next((i for i, h in enumerate(handles) if h is None), len(handles))
                for h in handles[usable:]:
                    if h is not None:
                        h.close()
                per_row.append(list(handles[:usable]))
            P = min(pads[b] + len(per_row[b]) * C for b in range(B))
            hit = [max(0, P - pads[b]) for b in range(B)]
            if P == 0 or not any(hit):
                return PrefixLoad(self._new_cache(), 0, [0] * B, pads)
            device = self.model.device
            L, H, D = self.namespace.layout.num_layers, self.namespace.layout.num_kv_heads, self.namespace.layout.head_dim
            # Staged in page-locked memory for a CUDA model, so the moves below run as DMA,
            # asynchronously on the current stream (torch's host allocator keeps the pages
            # until those copies complete).
            pin = device.type == "cuda"
            keys_t = [torch.zeros(B, H, P, D, dtype=self.dtype, pin_memory=pin) for _ in range(L)]
            vals_t = [torch.zeros(B, H, P, D, dtype=self.dtype, pin_memory=pin) for _ in range(L)]
            for b in range(B):
                for j, h in enumerate(per_row[b]):
                    n = min(C, hit[b] - j * C)
                    if n <= 0:
                        break
                    load_chunk(chunk_view(h.buffer, self.namespace, self.dtype), keys_t, vals_t, b, pads[b] + j * C, n)
        finally:
            for row in per_row:
                for held in row:
                    held.close()
        cache = self._new_cache([(k.to(device, non_blocking=True), v.to(device, non_blocking=True))
                                 for k, v in zip(keys_t, vals_t)])
        return PrefixLoad(cache, P, hit, pads)

    # -- store --------------------------------------------------------------------------------
    def store_prompt_chunks(self, cache: Any, input_ids: torch.Tensor, pads: Sequence[int], upto: int | None = None) -> int:
        """Store every full chunk of each row's prompt that ``cache`` covers and no local tier holds.

        A row whose every chunk a lookup finds (in any tier) is skipped before anything is
        copied: a full hit moves no KV off the device.

        Args:
            cache: a ``DynamicCache`` whose positions ``[0, T)`` are the prompt (padded);
                its batch may be ``B * n`` (``num_return_sequences``/beams, repeat-interleaved).
            input_ids: ``long [B, T]``.
            pads: left padding per row.
            upto: store only chunks ending at or before this position (default: the cache length).

        Returns:
            Chunks stored (committed). Failures are logged, never raised.
        """
        first = cache.layers[0] if getattr(cache, "layers", None) else None
        if first is None or getattr(first, "keys", None) is None or first.keys.dim() != 4:
            return 0
        B, T = input_ids.shape
        limit = min(first.keys.shape[2], T, upto if upto is not None else T)
        ids = input_ids.to("cpu").numpy()
        rows: list[tuple[int, list[bytes]]] = []
        for b in range(B):
            n = max(0, (limit - pads[b]) // self.chunk_size)
            if n == 0:
                continue
            try:
                keys = self.hasher.keys(ids[b, pads[b]:], self.cache_salt, max_chunks=n)
                if len(self.store.lookup_keys(keys).keys) < len(keys):  # else: every chunk is stored already
                    rows.append((b, keys))
            except Exception:  # defensive: a failing store is a skipped store
                log.exception("kvtier: lookup before storing row %d failed", b)
        if not rows:
            return 0  # a full hit copies nothing off the device
        try:
            layers = [(layer.keys.to("cpu"), layer.values.to("cpu")) for layer in cache.layers]
        except Exception:  # defensive: an unexpected cache shape is a skipped store
            log.exception("kvtier: cannot read the cache; nothing stored")
            return 0
        stride = max(1, layers[0][0].shape[0] // B)
        stored = 0
        for b, keys in rows:
            try:
                stored += self._store_row(layers, b * stride, pads[b], keys)
            except Exception:  # defensive: a failed store never fails generation
                log.exception("kvtier: storing row %d failed", b)
        return stored

    def _store_row(self, layers: list[tuple[torch.Tensor, torch.Tensor]], row: int, pad: int, keys: list[bytes]) -> int:
        bufs = self.store.open_write_many(keys, chain_parents(keys))
        stored, stop = 0, False
        for i, (key, buf) in enumerate(zip(keys, bufs)):
            parent = keys[i - 1] if i else None
            if not isinstance(buf, np.ndarray):
                stop = stop or buf not in (WriteSkip.PRESENT, WriteSkip.IN_FLIGHT)
                continue
            if stop:
                self.store.abort(key)
                continue
            try:
                save_chunk(layers, row, pad + i * self.chunk_size, chunk_view(buf, self.namespace, self.dtype))
            except Exception:
                log.exception("kvtier: copying chunk %s failed", key.hex()[:16])
                self.store.abort(key)
                stop = True
                continue
            self.store.commit(key, parent)
            stored += 1
        return stored

    # -- engine entry points ------------------------------------------------------------------
    def prefill_cache(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[Any, list[int]]:
        """A ``DynamicCache`` of every prompt position but the last, and the tokens per row taken from kvtier.

        Loads the stored prefix, computes positions ``[P, T - 1)`` with the model, and stores
        the new full chunks among them. Pass the cache to ``model.generate(input_ids,
        attention_mask=..., past_key_values=cache)``: it computes the last token and goes on.
        """
        got = self.load_prefix(input_ids, attention_mask)
        T = input_ids.shape[1]
        if got.cached_len < T - 1:
            self._forward(input_ids, attention_mask, got.cache, got.cached_len, T - 1)
        self.store_prompt_chunks(got.cache, input_ids, got.pads, upto=T - 1)
        return got.cache, got.hit_tokens

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache: Any, start: int, end: int) -> None:
        """Run the model over positions ``[start, end)`` into ``cache`` (positions from the mask, as generate does)."""
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            self.model(input_ids=input_ids[:, start:end], attention_mask=mask[:, :end], position_ids=pos[:, start:end],
                       past_key_values=cache, use_cache=True)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """``model.generate(input_ids, attention_mask=..., **kwargs)`` starting from the stored prefix.

        Returns what ``model.generate`` returns. Afterwards the prompt's new full chunks are stored.

        Raises:
            ValueError: ``past_key_values`` given (kvtier builds it), or a mask that is not left padding.
        """
        if kwargs.get("past_key_values") is not None:
            raise ValueError("KVTierHF.generate builds past_key_values itself; do not pass one")
        got = self.load_prefix(input_ids, attention_mask)
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        out = self.model.generate(input_ids, past_key_values=got.cache, **kwargs)
        self.store_prompt_chunks(got.cache, input_ids, got.pads, upto=input_ids.shape[1])
        self.last_hit_tokens = got.hit_tokens
        return out

    def close(self) -> None:
        """Flush and close the store if this object opened it (idempotent)."""
        if self._owns_store and self.store is not None:
            self.store.close()
            self._owns_store = False

    def __enter__(self) -> KVTierHF:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["KVTierHF", "PrefixLoad", "UnsupportedModel", "open_store"]
