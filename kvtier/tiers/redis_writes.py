"""How a Redis tier batch of chunk writes becomes commands: envelopes, then ``SET``s tail first.

Prefix closure under TTLs: a chunk must not expire before the chunks that extend
it. So a batch is sent tail first and, with a TTL, each ``SET`` is followed by a
``PEXPIRE`` of the written chunk's parent: a chain's head always gets the later
expiry.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from kvtier.index.keys import chain_parent
from kvtier.serde.base import Codec, ValueSpec
from kvtier.serde.envelope import EncodedValue, encode_value
from kvtier.tiers.base import ChunkWrite
from kvtier.tiers.redis_nodes import RedisNodes
from kvtier.tiers.redis_pipeline import Handler, ignore_reply, ok_into

log = logging.getLogger(__name__)

__all__ = ["encode_writes", "write_commands"]


def encode_writes(
    items: Sequence[ChunkWrite], codec: Codec, spec: ValueSpec, ekey: Callable[[bytes], bytes]
) -> list[EncodedValue | None]:
    """Each item's checksummed envelope (key field ``ekey(item.key)``) with ``codec``; None
    (logged) for a payload the codec rejects: a bad payload, not a store failure."""
    encoded: list[EncodedValue | None] = []
    for item in items:
        try:
            encoded.append(encode_value(ekey(item.key), item.payload, codec, spec))
        except ValueError as exc:  # CodecError is a ValueError: bad payload, not a store failure
            log.warning("kvtier redis: chunk %s not stored: %s", item.key.hex()[:16], exc)
            encoded.append(None)
    return encoded


def write_commands(
    nodes: RedisNodes,
    items: Sequence[ChunkWrite],
    encoded: Sequence[EncodedValue | None],
    rkey: Callable[[bytes], bytes],
    ttl_ms: int | None,
    out: list[bool],
) -> tuple[list[bytes], list[list[Any]], list[Handler]]:
    """``(rkeys, commands, handlers)`` for :func:`~kvtier.tiers.redis_pipeline.pipeline`:
    ``SET rkey envelope [PX ttl_ms]`` per encoded item, tail first, each followed (with
    ``ttl_ms``) by ``PEXPIRE`` of its parent. A ``SET`` reply sets ``out[i]``."""
    rkeys: list[bytes] = []
    commands: list[list[Any]] = []
    handlers: list[Handler] = []
    px = [b"PX", b"%d" % ttl_ms] if ttl_ms is not None else []
    ignore = ignore_reply(nodes)
    for i in reversed(range(len(items))):
        ev = encoded[i]
        if ev is None:
            continue
        rkeys.append(rkey(items[i].key))
        commands.append([b"SET", rkeys[-1], ev.parts, *px])
        handlers.append(ok_into(nodes, out, i))
        parent = chain_parent(items[i].parent)  # a lineage marker is no stored key: nothing to extend
        if ttl_ms is not None and parent is not None and len(parent) and len(parent) <= 255:
            rkeys.append(rkey(parent))
            commands.append([b"PEXPIRE", rkeys[-1], b"%d" % ttl_ms])
            handlers.append(ignore)
    return rkeys, commands, handlers
