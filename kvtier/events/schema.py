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

Mediums and tiers: vLLM 0.32 defines three media, ``GPU``, ``CPU`` and ``STORAGE``, and tells
tiers of one medium apart with ``locality`` (``LOCAL`` / ``REMOTE`` relative to the publisher)
and ``ownership`` (the offloading layer that published the event). kvtier publishes only those
(:data:`kvtier.events.from_tiers.TIER_MEDIUMS`), with ``ownership`` ``"kvtier"``:

====================  ==========  ==========
kvtier tier           medium      locality
====================  ==========  ==========
cpu (DRAM)            CPU         LOCAL
disk (local disk)     STORAGE     LOCAL
remote (Redis, fs://) STORAGE     REMOTE
peer (another host)   STORAGE     REMOTE
====================  ==========  ==========

so a consumer that knows only the three media weighs kvtier's tiers as vLLM's own offload tiers.
kvtier's readers (router, controller) name what a (medium, locality) pair means with
:func:`normalize_medium`: ``CPU``, ``DISK`` (local storage) or ``REMOTE`` (anything not on the
publisher's host); ``DISK`` and ``REMOTE`` as media, from kvtier releases before 0.32's names,
are still read.

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
#: vLLM's medium of storage offload tiers (local disk or remote stores, told apart by locality).
MEDIUM_STORAGE = "STORAGE"
#: The media vLLM 0.32 defines: the only ones kvtier publishes.
VLLM_MEDIUMS: tuple[str, ...] = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)
#: kvtier's names of what a medium and locality mean (:func:`normalize_medium`); kvtier
#: releases before vLLM 0.32's names published these two as media.
MEDIUM_DISK = "DISK"
MEDIUM_REMOTE = "REMOTE"
#: Mediums kvtier's readers index, after normalisation.
MEDIUMS: tuple[str, ...] = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_REMOTE)
LOCALITY_LOCAL = "LOCAL"
LOCALITY_REMOTE = "REMOTE"
#: ``ownership`` of every event kvtier publishes (vLLM: "secondary offloading tier identifier").
OWNERSHIP = "kvtier"


def normalize_medium(medium: str | None, locality: str | None = None) -> str | None:
    """What a (medium, locality) pair as received means, in kvtier's names.

    ``STORAGE`` is ``DISK`` (local storage), or ``REMOTE`` with ``locality="REMOTE"``; ``CPU``
    with ``locality="REMOTE"`` (another host's memory) is ``REMOTE`` too; ``GPU``, ``CPU`` and
    the pre-0.32 ``DISK`` / ``REMOTE`` media pass through, and so do unknown names.

    Args:
        medium: the ``medium`` field of an event (``None``: unspecified, the engine's).
        locality: its ``locality`` field (``None``: unspecified, read as local).

    Returns:
        The normalised medium (``None`` stays ``None``).
    """
    if medium is None:
        return None
    if locality == LOCALITY_REMOTE and medium in (MEDIUM_STORAGE, MEDIUM_CPU):
        return MEDIUM_REMOTE
    return MEDIUM_DISK if medium == MEDIUM_STORAGE else medium


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
        medium: where the blocks are (:data:`VLLM_MEDIUMS`; see the module doc).
        lora_name: LoRA adapter name the hashes include (``None``: none).
        extra_keys: per block, the extra hash inputs (LoRA name, multimodal ids, salt...).
        group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window: vLLM's KV cache group
            metadata (the connector sets them as vLLM does for the group; ``None`` from
            ``kvtier server``, which knows no engine's groups).
        locality: ``LOCAL``/``REMOTE`` relative to the publisher (``None``: unspecified).
        ownership: secondary offloading tier identifier (:data:`OWNERSHIP` from kvtier).
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
EVENT_TYPES: dict[str, type[KVEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
