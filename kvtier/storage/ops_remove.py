"""Removing chunks: the bodies of ``clear`` and ``delete``.

Arguments are already checked (:mod:`kvtier.storage.ops_args`) and the caller
holds the operations lock (:class:`kvtier.storage.instance_ops.InstanceOps`).
Write-behind is flushed first, so a queued write cannot undo a removal. Counts
``bytes`` with the tier's own accounting where it has one, else
``chunks * chunk_bytes``.
"""

from __future__ import annotations

from typing import Callable

from kvtier.storage.manager import StorageManager
from kvtier.storage.ops_args import Tier
from kvtier.storage.ops_staging import flush, tier_state
from kvtier.tiers.base import LowerTier

__all__ = ["clear_tiers", "delete_keys"]


def clear_tiers(m: StorageManager, targets: list[Tier]) -> dict[str, int]:
    """Remove the namespace's chunks from each of ``targets``; returns ``{"chunks", "bytes"}`` removed."""
    return _remove(m, targets, m.cpu.clear, lambda t: m.reporting(t).clear(), chunks_from_stats=False)


def delete_keys(m: StorageManager, keys: list[bytes], targets: list[Tier]) -> dict[str, int]:
    """Remove ``keys`` (and, in prefix-closed tiers, their resident descendants) from each of
    ``targets``; returns ``{"chunks", "bytes"}`` removed."""
    return _remove(m, targets, lambda: len(m.cpu.delete_tree(keys)), lambda t: m.reporting(t).delete_many(keys),
                   chunks_from_stats=True)


def _remove(
    m: StorageManager, targets: list[Tier], on_cpu: Callable[[], int], on_lower: Callable[[LowerTier], int],
    chunks_from_stats: bool,
) -> dict[str, int]:
    """Flush write-behind, run ``on_cpu``/``on_lower`` (each returns chunks removed) per target
    and total what went: lower-tier bytes (and chunks, with ``chunks_from_stats``) from the
    tier's accounting where it has one."""
    flush(m)
    chunks = nbytes = 0
    for t in targets:
        if t == "cpu":
            n = on_cpu()
            chunks += n
            nbytes += n * m.chunk_bytes
            continue
        c0, used0 = tier_state(t)
        n = on_lower(t)
        c1, used1 = tier_state(t)
        chunks += c0 - c1 if chunks_from_stats and c0 is not None and c1 is not None else n
        nbytes += used0 - used1 if used0 is not None and used1 is not None else n * m.chunk_bytes
    return {"chunks": chunks, "bytes": nbytes}
