"""kvtier's tier changes as vLLM KV events, published by vLLM's own publisher (``--kv-events-config``).

vLLM publishes what its engine cache holds (``BlockStored``/``BlockRemoved`` with
medium ``GPU``) from the scheduler: every step it calls ``connector.take_events()``
and publishes those events in the same ``KVEventBatch`` stream. This module makes
kvtier's tiers visible there, in vLLM's own classes and hash scheme:

- **worker side** (:class:`WorkerTierFeed`): the embedded storage manager's listener
  (:mod:`kvtier.storage.tier_events`) appends each change to a bounded deque; each
  step, ``get_kv_connector_kv_cache_events`` hands them over as a :class:`TierChanges`
  (kvtier keys plus tier, no hashes). vLLM carries it in
  ``KVConnectorOutput.kv_cache_events`` to the scheduler's
  ``update_connector_output`` (in the same process with one worker, in-process or
  multi-process engine core alike; with several workers vLLM's
  ``KVOutputAggregator`` merges them).
- **scheduler side** (:class:`BlockEventTranslator`): when the scheduler plans a
  save, or a lookup finds chunks, it remembers for each kvtier chunk key the
  request's engine block hashes (vLLM's ``request.block_hashes``, one per
  ``block_size`` tokens: a chunk covers ``chunk_size / block_size`` of them), the
  parent block hash, the chunk's token ids (a compact ``array('l')``), the LoRA
  name/id and vLLM's per-block extra keys, in an LRU map of at most ``max_chunks``
  chunks. The worker's changes are translated through it into ``BlockStored`` /
  ``BlockRemoved`` in vLLM 0.32's terms (consecutive chunks of a chain merge into one
  event). A key it does not know is counted in ``untranslated``, never given an invented hash.

Fields (what vLLM's own offload connectors set): ``medium`` is one of vLLM's three
(``CPU`` for kvtier's CPU tier, ``STORAGE`` for disk, remote and peer tiers), ``locality``
``LOCAL`` (CPU, disk) or ``REMOTE`` (Redis, shared fs, peers), ``ownership`` ``"kvtier"``
(:data:`kvtier.events.from_tiers.TIER_MEDIUMS`); ``group_idx``, ``kv_cache_spec_kind`` and
``kv_cache_spec_sliding_window`` those of the engine's KV cache group, one event per group
(a kvtier chunk holds every layer, so each group's blocks are in the tier; a model with one
group: ``group_idx=0``, ``"full_attention"``).

A cleared tier (``"c"``) becomes ``BlockRemoved`` of every remembered chunk in that
tier (``AllBlocksCleared`` has no medium: a router would also drop the engine's GPU
blocks). Changes made while no step runs reach the publisher with the next step.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents

from kvtier.events.from_tiers import TIER_MEDIUMS
from kvtier.events.schema import OWNERSHIP

log = logging.getLogger("kvtier.vllm")

#: kvtier tier kind -> KV event ``(medium, locality)`` (vLLM 0.32's media; see the module doc).
MEDIUM = TIER_MEDIUMS

#: One KV cache group as its events describe it: ``(kv_cache_spec_kind, sliding_window)``.
GroupSpec = tuple[str, "int | None"]
#: The groups of a model with one full-attention group (vLLM's events: group 0, "full_attention").
FULL_ATTENTION: tuple[GroupSpec, ...] = (("full_attention", None),)

#: One change as it crosses from worker to scheduler: (op, tier, keys).
ChangeTuple = tuple[str, str, tuple[bytes, ...]]


def kv_events_enabled(vllm_config: Any) -> bool:
    """True if vLLM publishes KV events (``kv_events_config.enable_kv_cache_events``)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


class TierChanges(KVConnectorKVEvents):
    """kvtier tier changes of a step, worker -> scheduler (``KVConnectorOutput.kv_cache_events``).

    Holds ``(op, tier, keys)`` tuples, not vLLM events: only the scheduler side knows
    the engine block hashes of a chunk.
    """

    def __init__(self, changes: Iterable[ChangeTuple] = (), num_workers: int = 1):
        self._changes: list[ChangeTuple] = list(changes)
        self._workers = num_workers

    def add_events(self, events: list[Any]) -> None:
        self._changes.extend(events)

    def aggregate(self) -> "TierChanges":
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._changes)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._changes = []

    def __repr__(self) -> str:
        return f"<TierChanges {len(self._changes)} changes, {self._workers} workers>"


class WorkerTierFeed:
    """The worker side: a storage manager's tier changes, queued until the next step (thread-safe).

    Args:
        manager: the embedded :class:`~kvtier.storage.manager.StorageManager`.
        max_changes: changes waiting at once; beyond, new ones are dropped and counted
            in ``dropped``.
    """

    def __init__(self, manager: Any, max_changes: int = 65536):
        self.manager = manager
        self.max_changes = max_changes
        self.dropped = 0
        self._q: deque[ChangeTuple] = deque()
        manager.subscribe(self._on_change)

    def _on_change(self, change: Any) -> None:
        if len(self._q) >= self.max_changes:
            self.dropped += 1
            return
        self._q.append((change.op, change.tier, tuple(change.keys)))

    def take(self) -> TierChanges | None:
        """The changes since the last call (None if none)."""
        out: list[ChangeTuple] = []
        while self._q:
            out.append(self._q.popleft())
        return TierChanges(out) if out else None

    def close(self) -> None:
        self.manager.unsubscribe(self._on_change)


@dataclass(slots=True)
class _Chunk:
    hashes: tuple[Any, ...]  # engine block hashes (ExternalBlockHash: bytes, or int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    parent: Any  # hash of the engine block before the chunk, None for a prompt's first chunk
    tokens: array[int]
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[Any] | None
    tiers: set[str] = field(default_factory=set)


class BlockEventTranslator:
    """The scheduler side: kvtier chunk key -> the engine's block hashes and tokens (bounded LRU).

    Args:
        chunk_size: tokens per kvtier chunk.
        block_size: vLLM's block size in tokens (``chunk_size`` is a multiple of it).
        max_chunks: chunks remembered (LRU); >= 1.
        groups: the engine's KV cache groups, ``(kv_cache_spec_kind, sliding_window)`` each, in
            ``group_idx`` order (:func:`group_specs`); one event per group per change.

    Raises:
        ValueError: ``chunk_size`` not a positive multiple of ``block_size``, ``max_chunks`` < 1,
            or no group.
    """

    def __init__(self, chunk_size: int, block_size: int, max_chunks: int = 16384,
                 groups: Sequence[GroupSpec] = FULL_ATTENTION):
        if block_size < 1 or chunk_size < block_size or chunk_size % block_size:
            raise ValueError(f"chunk_size {chunk_size} must be a positive multiple of block_size {block_size}")
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
        if not groups:
            raise ValueError("at least one KV cache group is needed")
        self.groups = tuple(groups)
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.blocks_per_chunk = chunk_size // block_size
        self.max_chunks = max_chunks
        self.untranslated = 0  # keys of changes the map did not know
        self.translated = 0
        self._map: OrderedDict[bytes, _Chunk] = OrderedDict()
        self._pending: list[KVCacheEvent] = []
        # the events new chunks may still merge into: per (stored?, medium, locality, group)
        self._tail: dict[tuple[bool, str, str, int], Any] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._map)

    # -- learning the hashes ---------------------------------------------------------------
    def remember(self, request: Any, keys: Sequence[bytes], chunks: Iterable[int]) -> None:
        """Remember chunks ``chunks`` (indices into ``keys``) of ``request``'s prompt.

        Chunks whose engine blocks have no hash yet (prefix caching off, or tokens not
        hashed) are skipped. Never raises: a failure only costs translations.
        """
        try:
            from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

            hashes = getattr(request, "block_hashes", None) or ()
            tokens = request.prompt_token_ids or ()
            lora = getattr(request, "lora_request", None)
            bpc, bs, cs = self.blocks_per_chunk, self.block_size, self.chunk_size
            for ci in chunks:
                if ci >= len(keys) or (ci + 1) * bpc > len(hashes) or (ci + 1) * cs > len(tokens):
                    continue
                key = keys[ci]
                with self._lock:
                    known = self._map.get(key)
                    if known is not None:
                        self._map.move_to_end(key)
                        continue
                first = ci * bpc
                entry = _Chunk(
                    tuple(maybe_convert_block_hash(h) for h in hashes[first : first + bpc]),
                    maybe_convert_block_hash(hashes[first - 1]) if first else None,
                    array("l", tokens[ci * cs : (ci + 1) * cs]),
                    lora.adapter_id if lora else None,
                    lora.name if lora else None,
                    _extra_keys(request, ci * cs, bs, bpc),
                )
                with self._lock:
                    self._map[key] = entry
                    while len(self._map) > self.max_chunks:
                        self._map.popitem(last=False)
        except Exception:  # kvtier must never take the engine down
            log.exception("kvtier: remembering block hashes for KV events failed")

    # -- translating -----------------------------------------------------------------------
    def update(self, changes: Iterable[ChangeTuple]) -> None:
        """Translate tier changes (from :class:`TierChanges`) into pending vLLM events."""
        with self._lock:
            for op, tier, keys in changes:
                where = MEDIUM.get(tier)
                if where is None:
                    self.untranslated += len(keys)
                    continue
                if op == "c":
                    gone = [c for c in self._map.values() if tier in c.tiers]
                    for g in gone:
                        g.tiers.discard(tier)
                    if gone:
                        self._removed([h for c in gone for h in c.hashes], where)
                    continue
                for key in keys:
                    c = self._map.get(key)
                    if c is None:
                        self.untranslated += 1
                        continue
                    self.translated += 1
                    if op == "s":
                        c.tiers.add(tier)
                        self._map.move_to_end(key)
                        self._stored(c, where)
                    elif op == "r":
                        c.tiers.discard(tier)
                        self._removed(list(c.hashes), where)

    def _append(self, stored: bool, event: Any, tail_key: tuple[bool, str, str, int]) -> None:
        if any(k[0] != stored for k in self._tail):
            self._tail.clear()  # a store after a removal (or back) must not merge across it
        self._tail[tail_key] = event
        self._pending.append(event)

    def _stored(self, c: _Chunk, where: tuple[str, str]) -> None:
        medium, locality = where
        if any(not k[0] for k in self._tail):
            self._tail.clear()
        for g, (kind, window) in enumerate(self.groups):
            last = self._tail.get((True, medium, locality, g))
            if (
                last is not None and last.lora_name == c.lora_name
                and c.parent is not None and last.block_hashes and last.block_hashes[-1] == c.parent
                and (last.extra_keys is None) == (c.extra_keys is None)
            ):
                last.block_hashes.extend(c.hashes)
                last.token_ids.extend(c.tokens)
                if last.extra_keys is not None and c.extra_keys is not None:
                    last.extra_keys.extend(c.extra_keys)
                continue
            self._append(True, BlockStored(
                block_hashes=list(c.hashes),
                parent_block_hash=c.parent,
                token_ids=c.tokens.tolist(),
                block_size=self.block_size,
                lora_id=c.lora_id,
                medium=medium,
                lora_name=c.lora_name,
                extra_keys=list(c.extra_keys) if c.extra_keys is not None else None,
                group_idx=g,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window,
                locality=locality,
                ownership=OWNERSHIP,
            ), (True, medium, locality, g))

    def _removed(self, hashes: list[Any], where: tuple[str, str]) -> None:
        medium, locality = where
        if any(k[0] for k in self._tail):
            self._tail.clear()
        for g in range(len(self.groups)):
            last = self._tail.get((False, medium, locality, g))
            if last is not None:
                last.block_hashes.extend(hashes)
                continue
            self._append(False, BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=g,
                                             locality=locality, ownership=OWNERSHIP),
                         (False, medium, locality, g))

    def take(self) -> list[KVCacheEvent]:
        """The events translated since the last call, in order."""
        with self._lock:
            out, self._pending = self._pending, []
            self._tail.clear()
        return out


def _extra_keys(request: Any, start: int, block_size: int, blocks: int) -> list[Any] | None:
    """vLLM's per-block extra keys of ``blocks`` blocks from token ``start`` (None when all are None)."""
    try:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys
    except ImportError:  # pragma: no cover (another vLLM)
        return None
    if not (getattr(request, "lora_request", None) or getattr(request, "mm_features", None)
            or getattr(request, "cache_salt", None) or getattr(request, "prompt_embeds", None) is not None):
        return None
    out: list[Any] = []
    mm_idx = 0
    for b in range(blocks):
        s = start + b * block_size
        keys, mm_idx = generate_block_hash_extra_keys(request, s, s + block_size, mm_idx)
        out.append(keys)
    return to_event_extra_keys(out)


def group_specs(kv_cache_config: Any) -> tuple[GroupSpec, ...]:
    """``(kv_cache_spec_kind, sliding_window)`` of each KV cache group of vLLM's ``KVCacheConfig``
    (:data:`FULL_ATTENTION` when there is none, e.g. a test double)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    if not groups:
        return FULL_ATTENTION
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

    return tuple((get_kv_cache_spec_kind(g.kv_cache_spec).value, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
                 for g in groups)
