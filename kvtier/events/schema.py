"""KV cache events in vLLM's own wire schema, without importing vLLM.

These msgspec structs mirror ``vllm.distributed.kv_events`` (vllm 0.32) field for field
and option for option, so ``msgspec.msgpack.encode`` of a batch built here is
byte-identical to the same batch built with vLLM's classes, and vLLM's own decoder
(``msgspec.msgpack.Decoder(type=vllm...KVEventBatch)``) reads it:

* the batch (:class:`KVEventBatch`) is ``array_like``: ``[ts, events, data_parallel_rank]``;
* each event is a tagged struct with ``omit_defaults``: a msgpack map whose ``"type"`` key
  is the class name (``"BlockStored"``, ``"BlockRemoved"``, ``"AllBlocksCleared"``),
  followed by the fields in declaration order (fields equal to their default left out);
* block hashes are :data:`ExternalBlockHash`: ``bytes`` (kvtier's 32-byte chunk keys,
  vLLM's sha256 hashes) or ``int`` (vLLM's builtin hash, a 64-bit unsigned value).

Mediums: vLLM publishes ``GPU``, ``CPU`` and ``STORAGE``; kvtier publishes ``CPU`` (its CPU
DRAM tier), ``DISK`` (local disk / filesystem tiers) and ``REMOTE`` (Redis, ``kvtier
server``, peers). :func:`kvtier.events.codec.decode_batch` reads vLLM's ``STORAGE`` as an
alias of ``DISK`` (see :func:`normalize_medium`).

Older vLLM releases encoded events as tagged *arrays* (``["BlockStored", hashes, ...]``)
and some publishers encode the batch as a map; the decoder accepts those too (the
structs here only describe the current encoding, which is what kvtier writes).
"""

from __future__ import annotations

from typing import Any

import msgspec

#: A block hash on the wire: bytes (sha256-style digests, kvtier chunk keys) or an int.
ExternalBlockHash = bytes | int

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_REMOTE = "REMOTE"
#: vLLM's own name for its storage offload tier; decoded as an alias of :data:`MEDIUM_DISK`.
MEDIUM_STORAGE = "STORAGE"
#: Mediums kvtier publishes or understands after normalisation.
MEDIUMS: tuple[str, ...] = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_REMOTE)
_MEDIUM_ALIASES: dict[str, str] = {MEDIUM_STORAGE: MEDIUM_DISK}


def normalize_medium(medium: str | None) -> str | None:
    """Map a medium name as received to kvtier's names: ``STORAGE`` -> ``DISK``; others as is.

    Args:
        medium: the ``medium`` field of an event (``None``: unspecified).

    Returns:
        The normalised medium (``None`` stays ``None``; unknown names pass through).
    """
    if medium is None:
        return None
    return _MEDIUM_ALIASES.get(medium, medium)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A batch of events: ``ts`` (seconds since the epoch, float), ``events``, and the data
    parallel rank of the publisher (``None``: unspecified). Encoded as a 3-element array."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the KV cache events (tagged by class name under ``"type"``)."""


class BlockStored(KVCacheEvent):
    """Blocks became available in ``medium``.

    Attributes:
        block_hashes: one hash per block, in chain order (each block's parent is the previous).
        parent_block_hash: hash of the block before the first one (``None``: the chain's root).
        token_ids: the tokens of all blocks concatenated (``block_size * len(block_hashes)``
            when known; kvtier sends ``[]`` when it does not know them).
        block_size: tokens per block (kvtier: tokens per chunk).
        lora_id: deprecated by vLLM, kept for the wire (``None``).
        medium: where the blocks are (:data:`MEDIUMS`).
        lora_name: LoRA adapter name the hashes include (``None``: none).
        extra_keys: per block, the extra hash inputs (LoRA name, multimodal ids, salt...).
        group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window: vLLM's KV cache group
            metadata (``None`` from kvtier).
        locality: ``LOCAL``/``REMOTE`` relative to the publisher (``None``: unspecified).
        ownership: secondary offloading tier identifier.
        session_id: request context that emitted the event.

    The fields without a default are required on the wire by vLLM's decoder, so they are
    required here too (``lora_id``, ``medium``, ``lora_name`` may be ``None``).
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks stopped being available in ``medium`` (``None``: unspecified)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block this publisher announced is gone (the event carries no medium)."""


#: Any KV cache event.
KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    """A batch of KV cache events (:data:`KVEvent`), vLLM's ``KVEventBatch`` on the wire."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


#: Event classes by wire tag.
EVENT_TYPES: dict[str, type[KVCacheEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
