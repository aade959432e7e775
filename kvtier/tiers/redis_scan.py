"""Listing and removing a Redis tier namespace's keys: ``SCAN MATCH`` on every primary.

Each ``SCAN`` page (``COUNT 1000``) and each page's ``UNLINK`` is its own round
trip with its own ``timeout_s`` deadline; a node that fails mid-way ends its
walk (what it gave so far stands), the other primaries go on.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Iterator, Sequence

from kvtier.tiers.redis_nodes import Addr, Batch, RedisNodes, glob_escape
from kvtier.tiers.redis_pipeline import count_into
from kvtier.tiers.resp import Wire

__all__ = ["scan_pages", "unlink_on"]


def _append_reply(out: list[Any], wire: Wire) -> None:
    out.append(wire.read_reply())


def scan_pages(nodes: RedisNodes, prefix: bytes, timeout_s: float) -> Iterator[tuple[Addr, list[bytes]]]:
    """``(node, Redis keys)`` for each ``SCAN`` page of the keys starting with ``prefix``, on
    every primary (the primaries are found within one ``timeout_s``). Pages may be empty;
    a key may repeat (``SCAN``'s own guarantee)."""
    pattern = glob_escape(prefix) + b"*"
    for addr in nodes.primaries(time.monotonic() + timeout_s):
        cursor = b"0"
        while True:
            reply: list[Any] = []
            b = Batch(addr)
            b.commands.append([b"SCAN", cursor, b"MATCH", pattern, b"COUNT", b"1000"])
            b.handlers.append(partial(_append_reply, reply))
            nodes.run([b], time.monotonic() + timeout_s)
            if b.failed or not reply or not isinstance(reply[0], list):
                break
            cursor, found = reply[0][0], reply[0][1]
            yield addr, found
            if cursor == b"0":
                break


def unlink_on(nodes: RedisNodes, addr: Addr, rkeys: Sequence[bytes], timeout_s: float) -> int:
    """``UNLINK`` each of ``rkeys`` on node ``addr`` in one round trip; returns how many went."""
    counts = [0] * len(rkeys)
    d = Batch(addr)
    for i, rk in enumerate(rkeys):
        d.commands.append([b"UNLINK", rk])
        d.handlers.append(count_into(nodes, counts, i))
    nodes.run([d], time.monotonic() + timeout_s)
    return sum(counts)
