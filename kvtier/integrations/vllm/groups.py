"""The engine's KV cache groups as kvtier restores them (vLLM's hybrid KV cache manager, ``SupportsHMA``).

vLLM keeps one block table per KV cache group (``KVCacheConfig.kv_cache_groups``): a model
with one kind of attention has one group; a hybrid model (e.g. sliding-window layers beside
full-attention ones) has several, each with its own block ids for the same token positions.
A sliding-window group frees the blocks that fall out of its window (vLLM replaces them by
the null block, ``SlidingWindowManager.get_num_skipped_tokens``: tokens before
``computed - window + 1``).

kvtier stores a chunk as every layer's KV of its tokens (each layer's blocks taken from its
group's table), so a chunk restores every group exactly, or it is not stored:

- **save**: a chunk is stored only when each group still holds all its blocks (none freed
  out of a window: :meth:`KVGroups.first_held_block`); the chain stops there;
- **load**: each group's blocks of the hit are filled from the chunk; blocks vLLM left null
  (out of a sliding window: the engine does not read them) are skipped. Any group whose
  state a chunk of token KV cannot restore (Mamba / linear attention state, or another
  block size) is refused at start (:func:`kv_groups`), never served partially.

Groups kvtier restores: ``full_attention`` and ``sliding_window``, all with the engine's block size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

#: Group kinds (vLLM's ``KVCacheSpecKind`` values) whose state is the KV of each token.
RESTORABLE_KINDS = ("full_attention", "sliding_window")


@dataclass(frozen=True)
class KVGroups:
    """The engine's KV cache groups, as kvtier sees them.

    Attributes:
        kinds: per group, vLLM's ``kv_cache_spec_kind`` (``"full_attention"``, ``"sliding_window"``).
        windows: per group, the sliding window in tokens (None: full attention).
        layer_group: layer name -> its group index (empty: one group holding every layer).
        block_size: tokens per block (every group's).
    """

    kinds: tuple[str, ...] = ("full_attention",)
    windows: tuple[int | None, ...] = (None,)
    layer_group: dict[str, int] | None = None
    block_size: int = 0

    @property
    def multi(self) -> bool:
        """More than one group: block ids differ per group (vLLM's hybrid KV cache manager)."""
        return len(self.kinds) > 1

    def first_held_block(self, computed_before_step: int) -> int:
        """The first block index from which every group still holds its blocks in a step that
        starts with ``computed_before_step`` tokens computed: blocks before it may have been
        freed out of a sliding window (vLLM frees up to ``computed - window + 1`` tokens, so
        this bound is safe); 0 when no group frees blocks."""
        first = 0
        for w in self.windows:
            if w is not None:
                first = max(first, max(0, computed_before_step - w + 1) // self.block_size)
        return first

    def saveable_chunks(self, ids_by_group: Sequence[Sequence[int]], first: int, full: int, blocks_per_chunk: int,
                        computed_before_step: int, null_block: int) -> int:
        """The end of the run of chunks ``[first, full)`` that every group holds whole now (a chunk
        is stored whole or not at all, and the chain stops at the first that is not).

        Args:
            ids_by_group: each group's block ids of the request, in group order.
            first, full: chunk indices to consider (``full`` excluded).
            blocks_per_chunk: engine blocks per chunk.
            computed_before_step: tokens computed before this step (see :meth:`first_held_block`).
            null_block: vLLM's null block id (a slot freed out of a window).
        """
        held_from = self.first_held_block(computed_before_step)
        for ci in range(first, full):
            lo, hi = ci * blocks_per_chunk, (ci + 1) * blocks_per_chunk
            if lo < held_from or len(ids_by_group) != len(self.kinds) or any(
                    len(ids) < hi or null_block in ids[lo:hi] for ids in ids_by_group):
                return ci
        return full

    def groups_of(self, layer_names: Sequence[str]) -> list[int]:
        """The group of each layer, in order (all 0 with one group).

        Raises:
            ValueError: a layer no group lists (the engine's KV and its config disagree).
        """
        if not self.multi or self.layer_group is None:
            return [0] * len(layer_names)
        missing = [n for n in layer_names if n not in self.layer_group]
        if missing:
            raise ValueError(f"KV cache layers in no KV cache group: {missing[:4]}")
        return [self.layer_group[n] for n in layer_names]


def kv_groups(kv_cache_config: Any, block_size: int) -> KVGroups:
    """kvtier's view of vLLM's ``KVCacheConfig`` (one full-attention group when it is None).

    Raises:
        ValueError: a group kvtier cannot restore exactly: Mamba / linear-attention state, or
            another kind outside :data:`RESTORABLE_KINDS`, or a block size other than
            ``block_size``. The message names the group and says what to do.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:
        return KVGroups(block_size=block_size)
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

    kinds: list[str] = []
    windows: list[int | None] = []
    layer_group: dict[str, int] = {}
    for g, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = get_kv_cache_spec_kind(spec).value
        if kind not in RESTORABLE_KINDS:
            what = "recurrent (Mamba / linear attention) state" if kind == "mamba" else f"{kind!r} KV"
            raise ValueError(
                f"kvtier cannot restore KV cache group {g} ({what}, layers {list(group.layer_names)[:3]}...): it "
                f"stores per-token attention KV and restores only {', '.join(RESTORABLE_KINDS)} groups; serving "
                "a hit without that group's state would give wrong answers. Run this model without the kvtier "
                "connector")
        gbs = int(getattr(spec, "block_size", block_size))
        if gbs != block_size:
            raise ValueError(f"kvtier: KV cache group {g} has block size {gbs}, the engine {block_size}; kvtier "
                             "needs one block size for every group")
        kinds.append(kind)
        windows.append(get_kv_cache_spec_sliding_window(spec) if kind == "sliding_window" else None)
        for name in group.layer_names:
            layer_group[name] = g
    return KVGroups(tuple(kinds), tuple(windows), layer_group if len(groups) > 1 else None, block_size)
