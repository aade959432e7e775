"""Turn kvtier tier changes into KV events (vLLM's schema, kvtier's chunk keys).

The block hashes are kvtier's chunk keys (:mod:`kvtier.index.keys`, 32 bytes, each one
committing to its whole prefix), so every consumer (a router, the controller) uses the one
hash scheme; ``block_size`` is the chunk size in tokens. One kvtier change maps to events:

* ``"s"`` (stored) -> :class:`BlockStored`, one per run of chained chunks (a chunk whose
  parent is the previous chunk's key joins the run; ``parent_block_hash`` is the run's
  first parent);
* ``"r"`` (removed) -> one :class:`BlockRemoved`;
* ``"c"`` (tier cleared) -> one :class:`AllBlocksCleared`. That event carries no medium: a
  consumer forgets every block the publisher announced, in every medium (a safe miss, never a
  stale hit). A publisher that knows the cleared keys can send ``"r"`` for them instead to
  keep the other mediums.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.events.schema import (
    LOCALITY_LOCAL,
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    OWNERSHIP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from kvtier.index.keys import chain_parent

#: ``(medium, locality)`` of each kvtier tier kind (:data:`kvtier.storage.types.TIER_KINDS`) in
#: vLLM 0.32's terms (see :mod:`kvtier.events.schema`): every event also says ``ownership="kvtier"``.
TIER_MEDIUMS: dict[str, tuple[str, str]] = {
    "cpu": (MEDIUM_CPU, LOCALITY_LOCAL),
    "disk": (MEDIUM_STORAGE, LOCALITY_LOCAL),
    "remote": (MEDIUM_STORAGE, LOCALITY_REMOTE),
    "peer": (MEDIUM_STORAGE, LOCALITY_REMOTE),
}
#: A parent written as 32 zero bytes (the fleet protocol's "no parent") means none.
_NO_PARENT = b"\x00" * 32
_OPS = ("s", "r", "c")


def medium_of_tier(tier: str) -> tuple[str, str]:
    """The event ``(medium, locality)`` of a kvtier tier kind: cpu -> (CPU, LOCAL), disk ->
    (STORAGE, LOCAL), remote and peer -> (STORAGE, REMOTE).

    Raises:
        ValueError: an unknown tier kind (the message lists the known ones).
    """
    try:
        return TIER_MEDIUMS[tier]
    except KeyError:
        raise ValueError(f"tier {tier!r} is not one of {sorted(TIER_MEDIUMS)}") from None


def tier_change_events(op: str, tier: str, keys: Sequence[bytes],
                       parents: Sequence[bytes | None], chunk_size: int,
                       token_ids: Sequence[Sequence[int]] | None = None) -> list[KVEvent]:
    """Events for one change of one tier.

    Args:
        op: ``"s"`` stored, ``"r"`` removed, ``"c"`` cleared.
        tier: tier kind (``cpu``, ``disk``, ``remote``, ``peer``).
        keys: chunk keys (bytes), in chain order for ``"s"``.
        parents: for ``"s"``, each key's parent key (``None`` or 32 zero bytes: a chain root);
            same length as ``keys``. Ignored for ``"r"`` and ``"c"``.
        chunk_size: tokens per chunk (> 0): the events' ``block_size``.
        token_ids: for ``"s"``, each chunk's tokens (``chunk_size`` each), or ``None`` when
            not known (events then carry ``token_ids=[]``).

    Returns:
        The events, in order (empty for ``"s"``/``"r"`` without keys).

    Raises:
        ValueError: unknown op or tier, non-positive chunk size, non-bytes keys, or
            ``parents``/``token_ids`` whose lengths do not match ``keys``/``chunk_size``.
    """
    if op not in _OPS:
        raise ValueError(f"op {op!r} is not one of {_OPS}")
    medium, locality = medium_of_tier(tier)
    if op == "c":
        return [AllBlocksCleared()]
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or not key:
            raise ValueError(f"keys[{i}] must be non-empty bytes, got {type(key).__name__}")
    if not keys:
        return []
    if op == "r":
        return [BlockRemoved(block_hashes=list(keys), medium=medium, locality=locality, ownership=OWNERSHIP)]
    if len(parents) != len(keys):
        raise ValueError(f"parents has {len(parents)} entries for {len(keys)} keys")
    if token_ids is not None:
        if len(token_ids) != len(keys):
            raise ValueError(f"token_ids has {len(token_ids)} chunks for {len(keys)} keys")
        for i, toks in enumerate(token_ids):
            if len(toks) != chunk_size:
                raise ValueError(f"token_ids[{i}] has {len(toks)} tokens, chunk_size is "
                                 f"{chunk_size}")
    events: list[KVEvent] = []
    run_start = 0
    for i in range(1, len(keys) + 1):
        if i < len(keys) and _parent(parents[i], i) == keys[i - 1]:
            continue
        tokens: list[int] = []
        if token_ids is not None:
            for toks in token_ids[run_start:i]:
                tokens.extend(int(t) for t in toks)
        events.append(BlockStored(
            block_hashes=list(keys[run_start:i]),
            parent_block_hash=_parent(parents[run_start], run_start),
            token_ids=tokens, block_size=chunk_size, lora_id=None, medium=medium,
            lora_name=None, locality=locality, ownership=OWNERSHIP))
        run_start = i
    return events


def _parent(parent: bytes | None, i: int) -> bytes | None:
    if parent is None or parent == _NO_PARENT:
        return None
    if not isinstance(parent, bytes):
        raise ValueError(f"parents[{i}] must be bytes or None, got {type(parent).__name__}")
    return chain_parent(parent)  # a lineage marker (a chain's first chunk) is no block: no parent
