"""Encode and decode KV event batches (msgpack), tolerant of every encoding vLLM has used.

:func:`encode_batch` writes the current vLLM encoding (:mod:`kvtier.events.schema`): the
batch as an array ``[ts, events, data_parallel_rank]``, each event a map tagged by
``"type"``. :func:`decode_batch` reads

* that encoding (the fast path: one typed msgspec decode);
* events as tagged arrays (``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name, ...]``: vLLM releases whose events were
  ``array_like``), with trailing fields missing (older releases had fewer) or extra;
* the batch as a map ``{"ts": ..., "events": [...], "data_parallel_rank": ...}``;

ignoring unknown extra fields, and raises :class:`EventDecodeError` (a ``ValueError``) for
anything else: never another exception type.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from kvtier.events.schema import (
    EVENT_TYPES,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEvent,
    KVEventBatch,
    normalize_medium,
)

_ENCODER = msgspec.msgpack.Encoder()
_TYPED_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
_ANY_DECODER = msgspec.msgpack.Decoder()

#: Required-but-nullable fields older encodings may leave out: read as ``None``.
_NULLABLE: dict[type[KVCacheEvent], tuple[str, ...]] = {
    BlockStored: ("parent_block_hash", "lora_id", "medium", "lora_name"),
    BlockRemoved: ("medium",),
}


class EventDecodeError(ValueError):
    """A payload is not a KV event batch in any known encoding (the message says why)."""


class EventEncodeError(ValueError):
    """A batch cannot be encoded (e.g. an int block hash outside 64 bits, a wrong type)."""


def make_batch(events: Sequence[KVEvent], ts: float | None = None,
               data_parallel_rank: int | None = None) -> KVEventBatch:
    """Wrap events in a :class:`KVEventBatch` stamped ``ts`` (seconds since the epoch; now if
    ``None``)."""
    return KVEventBatch(ts=time.time() if ts is None else float(ts), events=list(events),
                        data_parallel_rank=data_parallel_rank)


def encode_batch(batch: KVEventBatch) -> bytes:
    """Encode a batch as msgpack, exactly as vLLM's ``ZmqEventPublisher`` does.

    Raises:
        EventEncodeError: ``batch`` is not a :class:`KVEventBatch` or holds unencodable values.
    """
    if not isinstance(batch, KVEventBatch):
        raise EventEncodeError(f"expected a KVEventBatch, got {type(batch).__name__}")
    try:
        return _ENCODER.encode(batch)
    except (TypeError, ValueError, OverflowError) as exc:
        raise EventEncodeError(f"cannot encode KV event batch: {exc}") from exc


def decode_batch(payload: bytes | bytearray | memoryview, *,
                 normalize: bool = True) -> KVEventBatch:
    """Decode one msgpack payload into a :class:`KVEventBatch`.

    Args:
        payload: the third frame of a ``[topic, seq, payload]`` message.
        normalize: name each event's medium by what it means with its locality
            (:func:`normalize_medium`: ``STORAGE`` -> ``DISK``, or ``REMOTE`` when remote).

    Raises:
        EventDecodeError: the payload is not a batch in any accepted encoding.
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise EventDecodeError(f"payload must be bytes, got {type(payload).__name__}")
    try:
        batch = _TYPED_DECODER.decode(payload)
    except msgspec.DecodeError:
        batch = _decode_loose(payload)
    except Exception as exc:
        raise EventDecodeError(f"undecodable KV event payload: {exc!r}") from exc
    if normalize:
        for ev in batch.events:
            if isinstance(ev, (BlockStored, BlockRemoved)) and ev.medium is not None:  # (AllBlocksCleared has none)
                ev.medium = normalize_medium(ev.medium, getattr(ev, "locality", None))
    return batch


def _decode_loose(payload: bytes | bytearray | memoryview) -> KVEventBatch:
    try:
        obj = _ANY_DECODER.decode(payload)
    except Exception as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from exc
    try:
        return batch_from_obj(obj)
    except EventDecodeError:
        raise
    except Exception as exc:
        raise EventDecodeError(f"malformed KV event batch: {exc!r}") from exc


def batch_from_obj(obj: Any) -> KVEventBatch:
    """Build a batch from a generic msgpack object (array or map batch; array or map events).

    Raises:
        EventDecodeError: the object is not a batch.
    """
    if isinstance(obj, (list, tuple)):
        if len(obj) < 2:
            raise EventDecodeError(f"batch array needs [ts, events, ...], got {len(obj)} items")
        ts, events = obj[0], obj[1]
        dp_rank = obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict):
        if "ts" not in obj or "events" not in obj:
            raise EventDecodeError("batch map needs 'ts' and 'events'")
        ts, events, dp_rank = obj["ts"], obj["events"], obj.get("data_parallel_rank")
    else:
        raise EventDecodeError(f"batch must be an array or a map, got {type(obj).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise EventDecodeError(f"batch ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, (list, tuple)):
        raise EventDecodeError(f"batch events must be an array, got {type(events).__name__}")
    if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int)):
        raise EventDecodeError(f"data_parallel_rank must be an int, got {type(dp_rank).__name__}")
    return KVEventBatch(ts=float(ts), events=[event_from_obj(e, i) for i, e in enumerate(events)],
                        data_parallel_rank=dp_rank)


def event_from_obj(obj: Any, index: int = 0) -> KVEvent:
    """Build one event from a tagged map (``{"type": tag, ...}``) or tagged array
    (``[tag, field1, field2, ...]``, fields in declaration order).

    Raises:
        EventDecodeError: unknown tag, missing or mistyped fields (the message names them).
    """
    if isinstance(obj, dict):
        tag = obj.get("type")
        fields = {k: v for k, v in obj.items() if isinstance(k, str) and k != "type"}
        cls = _event_class(tag, index)
    elif isinstance(obj, (list, tuple)) and obj:
        tag = obj[0]
        cls = _event_class(tag, index)
        names = cls.__struct_fields__
        fields = dict(zip(names, obj[1:]))  # extra trailing items ignored
    else:
        raise EventDecodeError(f"event {index} must be a tagged map or array, got {obj!r:.80}")
    for name in _NULLABLE.get(cls, ()):
        fields.setdefault(name, None)
    _check_hashes(fields, index, tag)
    try:
        return msgspec.convert(fields, type=cls)
    except msgspec.ValidationError as exc:
        raise EventDecodeError(f"event {index} ({tag}): {exc}") from exc


def _check_hashes(fields: dict[str, Any], index: int, tag: Any) -> None:
    # msgspec.convert would read a str as base64 bytes; on the wire a hash is bin or int only.
    hashes = fields.get("block_hashes")
    values = list(hashes) if isinstance(hashes, (list, tuple)) else []
    if fields.get("parent_block_hash") is not None:
        values.append(fields["parent_block_hash"])
    for h in values:
        if isinstance(h, bool) or not isinstance(h, (bytes, int)):
            raise EventDecodeError(f"event {index} ({tag}): block_hashes / parent_block_hash "
                                   f"must be bytes or int, got {type(h).__name__}")


def _event_class(tag: Any, index: int) -> type[KVEvent]:
    cls = EVENT_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise EventDecodeError(f"event {index}: unknown event type {tag!r:.80} "
                               f"(expected one of {sorted(EVENT_TYPES)})")
    return cls
