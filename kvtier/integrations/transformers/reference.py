"""The reference a kvtier hit is compared with: a cold run whose prefill is split where the hit split it.

A hit computes positions ``[0, P)`` in an earlier run and ``[P, T)`` now; in bf16 the
two-part prefill may round differently from one pass over ``[0, T)`` (different matmul
and attention shapes), exactly as a prefix-cache hit of the engine itself would. The fair
check of "kvtier returned the right KV" is therefore token equality with a cold run split
at the same ``P`` (:func:`cold_generate_split`); equality with the unsplit cold run is
reported besides, never required (the same rule as :mod:`kvtier.demo`).

The same holds for the prefix itself: the stored chunks of ``[0, P)`` were computed by the
storing run's forward pass, usually over its whole prompt ``[0, T0)`` with ``T0 > P``, and in
bf16 a pass over ``[0, T0)`` need not round ``[0, P)`` as a pass over ``[0, P)`` does (CPU matmul
kernels block by shape; which prompts flip a greedy token differs with the CPU and the
transformers version: CI, stop 32, transformers 5.19). ``prefix_pass_len=T0`` makes the reference
compute ``[0, P)`` as the storing run did (one pass over ``[0, T0)``, cropped to ``P``), so the only
thing the comparison still tests is what kvtier did: whether the loaded bytes are the stored ones.
"""

from __future__ import annotations

from typing import Any

import torch


def cold_generate_split(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, split: int,
                        prefix_pass_len: int | None = None, **kwargs: Any) -> Any:
    """``model.generate`` with positions ``[0, split)`` prefilled by a separate forward pass first.

    Args:
        model: a transformers causal LM.
        input_ids: ``long [B, T]`` (left padded with ``attention_mask`` if batched).
        attention_mask: ``[B, T]`` or None.
        split: padded position where the prefill is cut, ``0 <= split < T`` (0: plain generate).
        prefix_pass_len: tokens of the forward pass that computes ``[0, split)``, ``split <= n <= T``:
            the prompt length of the run that stored the prefix (see the module doc). The pass
            covers ``[0, n)`` and its KV is cropped to ``split``. Default: ``split``.
        kwargs: passed to ``model.generate``.

    Raises:
        ValueError: ``split`` or ``prefix_pass_len`` out of range.
    """
    from transformers import DynamicCache

    T = input_ids.shape[1]
    if not 0 <= split < T:
        raise ValueError(f"split {split} outside [0, {T})")
    n = split if prefix_pass_len is None else prefix_pass_len
    if not split <= n <= T:
        raise ValueError(f"prefix_pass_len {n} outside [split={split}, T={T}]")
    cache = DynamicCache(config=model.config)
    mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    if split:
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            model(input_ids=input_ids[:, :n], attention_mask=mask[:, :n], position_ids=pos[:, :n],
                  past_key_values=cache, use_cache=True)
        if n > split:
            cache.crop(split)
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    return model.generate(input_ids, past_key_values=cache, **kwargs)
