"""One Redis tier call's pipelined commands: batching by node, and the reply handlers.

A call builds one command per key (``rkeys[i]`` -> ``commands[i]``) and one reply
handler per command; :func:`pipeline` groups them by owning node
(:meth:`~kvtier.tiers.redis_nodes.RedisNodes.group`) and runs every node's
pipeline in one round trip. Handlers read exactly one reply from the
:class:`~kvtier.tiers.resp.Wire` and write their result into the caller's list
at index ``i``; an error reply (OOM, MOVED, WRONGTYPE) is noted on the nodes and
leaves the caller's default (a miss). A handler whose node fails never runs.
"""

from __future__ import annotations

import builtins
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from kvtier.serde.base import Codec
from kvtier.serde.envelope import ValueMiss, read_value_into
from kvtier.tiers.redis_nodes import Addr, Batch, RedisNodes
from kvtier.tiers.resp import RespError, Wire

log = logging.getLogger(__name__)

__all__ = [
    "GetTally", "Handler", "batches", "count_into", "exists_known_into", "ignore_reply", "ok_into", "on_reply",
    "pipeline", "value_into",
]

Handler = Callable[[Wire], None]


def batches(groups: dict[Addr, list[int]], commands: list[list[Any]], handlers: Sequence[Handler]) -> list[Batch]:
    """One :class:`Batch` per node of ``groups`` (node -> command indices), commands in index order."""
    out = []
    for addr, idx in groups.items():
        b = Batch(addr)
        for i in idx:
            b.commands.append(commands[i])
            b.handlers.append(handlers[i])
        out.append(b)
    return out


def pipeline(
    nodes: RedisNodes, rkeys: Sequence[bytes], commands: list[list[Any]], handlers: Sequence[Handler], deadline: float
) -> bool:
    """Run ``commands[i]`` (on ``rkeys[i]``'s node) with ``handlers[i]``, one pipelined round
    trip per node, all by ``deadline`` (``time.monotonic()`` seconds).

    Returns False (nothing sent) if the cluster topology is unknown; nothing is sent
    either for no keys.
    """
    groups = nodes.group(rkeys, deadline) if rkeys else {}
    if groups is None:
        return False
    nodes.run(batches(groups, commands, handlers), deadline)
    return True


def on_reply(nodes: RedisNodes, use: Callable[[Any], None]) -> Handler:
    """A handler that reads one reply and passes it to ``use``, unless it is an error reply
    (noted on ``nodes``; e.g. OOM under noeviction: the write is dropped)."""

    def handle(wire: Wire) -> None:
        reply = wire.read_reply()
        if isinstance(reply, RespError):
            nodes.note_error(reply)
        else:
            use(reply)

    return handle


def _drop(reply: Any) -> None:
    pass


def ignore_reply(nodes: RedisNodes) -> Handler:
    """A handler that reads and drops a reply (noting an error reply)."""
    return on_reply(nodes, _drop)


def exists_known_into(nodes: RedisNodes, out: list[bool], answered: list[bool], i: int) -> Handler:
    """``EXISTS`` reply -> ``out[i] = reply == 1`` and ``answered[i] = True`` (an error reply
    or no reply leaves ``answered[i]`` False)."""

    def use(reply: Any) -> None:
        out[i] = reply == 1
        answered[i] = True

    return on_reply(nodes, use)


def ok_into(nodes: RedisNodes, out: list[bool], i: int) -> Handler:
    """``SET`` reply -> ``out[i] = reply == "OK"`` (an OOM error under noeviction: a dropped write)."""

    def use(reply: Any) -> None:
        out[i] = reply == b"OK"

    return on_reply(nodes, use)


def count_into(nodes: RedisNodes, counts: list[int], i: int) -> Handler:
    """Integer reply (``UNLINK``, ``STRLEN``) -> ``counts[i]``."""

    def use(reply: Any) -> None:
        if isinstance(reply, int):
            counts[i] = reply

    return on_reply(nodes, use)


@dataclass
class GetTally:
    """What one batched ``GET`` found: hits, absent and corrupt values, payload bytes read
    (values, envelope included), and the Redis keys of the corrupt values."""

    hits: int = 0
    absent: int = 0
    corrupt: int = 0
    bytes: int = 0
    corrupt_rkeys: list[builtins.bytes] = field(default_factory=list)  # (the field above shadows bytes)


def value_into(
    nodes: RedisNodes,
    out: list[bool],
    i: int,
    key: bytes,
    rkey: bytes,
    ekey: bytes,
    dst: memoryview,
    decoders: Mapping[str, Codec],
    scratch: Callable[[int], memoryview],
    tally: GetTally,
) -> Handler:
    """``GET`` reply -> the envelope checked against ``ekey`` and decoded into ``dst``
    (``out[i] = True``); a corrupt or foreign value is a miss, logged and tallied
    (``rkey`` joins ``tally.corrupt_rkeys`` for deletion)."""

    def handle(wire: Wire) -> None:
        n = wire.read_bulk_len()
        if isinstance(n, RespError):
            nodes.note_error(n)
            return
        if n < 0:
            tally.absent += 1
            return
        try:
            read_value_into(wire.read_exact_into, n, ekey, dst, decoders, scratch)
        except ValueMiss as miss:
            wire.skip(n - miss.consumed)
            wire.expect_crlf()
            tally.corrupt += 1
            tally.corrupt_rkeys.append(rkey)
            log.warning("kvtier redis: chunk %s is a miss: %s", key.hex()[:16], miss.reason)
            return
        wire.expect_crlf()
        out[i] = True
        tally.hits += 1
        tally.bytes += n

    return handle
