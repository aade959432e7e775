"""KV cache events in vLLM's own schema: what kvtier's tiers hold, for routers and the controller.

* :mod:`.schema` - msgspec structs wire-identical to ``vllm.distributed.kv_events``
  (``KVEventBatch`` of ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``), no vLLM import;
* :mod:`.codec` - :func:`encode_batch` / :func:`decode_batch` (array and map encodings);
* :mod:`.from_tiers` - kvtier tier changes (store / remove / clear) -> events;
* :mod:`.publisher` / :mod:`.subscriber` - ZeroMQ ``[topic, seq, payload]`` streams with
  vLLM's replay protocol (these two import ``zmq``; importing this package does not).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.events.codec import (
    EventDecodeError,
    EventEncodeError,
    decode_batch,
    encode_batch,
    make_batch,
)
from kvtier.events.from_tiers import TIER_MEDIUMS, medium_of_tier, tier_change_events
from kvtier.events.schema import (
    LOCALITY_LOCAL,
    LOCALITY_REMOTE,
    OWNERSHIP,
    VLLM_MEDIUMS,
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    MEDIUM_REMOTE,
    MEDIUM_STORAGE,
    MEDIUMS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    normalize_medium,
)

if TYPE_CHECKING:
    from kvtier.events.publisher import EventPublisher
    from kvtier.events.subscriber import EventSubscriber

__all__ = [
    "LOCALITY_LOCAL",
    "LOCALITY_REMOTE",
    "OWNERSHIP",
    "VLLM_MEDIUMS",
    "MEDIUMS",
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_GPU",
    "MEDIUM_REMOTE",
    "MEDIUM_STORAGE",
    "TIER_MEDIUMS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventDecodeError",
    "EventEncodeError",
    "EventPublisher",
    "EventSubscriber",
    "KVEvent",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "make_batch",
    "medium_of_tier",
    "normalize_medium",
    "tier_change_events",
]


def __getattr__(name: str) -> Any:
    """Import the ZeroMQ classes on first use only."""
    if name == "EventPublisher":
        from kvtier.events.publisher import EventPublisher
        return EventPublisher
    if name == "EventSubscriber":
        from kvtier.events.subscriber import EventSubscriber
        return EventSubscriber
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
