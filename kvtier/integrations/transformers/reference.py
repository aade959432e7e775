"""The reference a kvtier hit is compared with: a cold run whose prefill is split where the hit split it.

A hit computes positions ``[0, P)`` in an earlier run and ``[P, T)`` now; in bf16 the
two-part prefill may round differently from one pass over ``[0, T)`` (different matmul
and attention shapes), exactly as a prefix-cache hit of the engine itself would. The fair
check of "kvtier returned the right KV" is therefore token equality with a cold run split
at the same ``P`` (:func:`cold_generate_split`); equality with the unsplit cold run is
reported besides, never required (the same rule as :mod:`kvtier.demo`).
"""

from __future__ import annotations

from typing import Any

import torch


def cold_generate_split(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, split: int,
                        **kwargs: Any) -> Any:
    """``model.generate`` with positions ``[0, split)`` prefilled by a separate forward pass first.

    Args:
        model: a transformers causal LM.
        input_ids: ``long [B, T]`` (left padded with ``attention_mask`` if batched).
        attention_mask: ``[B, T]`` or None.
        split: padded position where the prefill is cut, ``0 <= split < T`` (0: plain generate).
        kwargs: passed to ``model.generate``.

    Raises:
        ValueError: ``split`` out of range.
    """
    from transformers import DynamicCache

    T = input_ids.shape[1]
    if not 0 <= split < T:
        raise ValueError(f"split {split} outside [0, {T})")
    cache = DynamicCache(config=model.config)
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    if split:
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            model(input_ids=input_ids[:, :split], attention_mask=mask[:, :split], position_ids=pos[:, :split],
                  past_key_values=cache, use_cache=True)
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    return model.generate(input_ids, past_key_values=cache, **kwargs)
