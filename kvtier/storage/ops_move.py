"""Moving chunks between tiers: the bodies of ``move_local``, ``export`` and ``import``.

Arguments are already checked (:mod:`kvtier.storage.ops_args`) and the caller
holds the operations lock (:class:`kvtier.storage.instance_ops.InstanceOps`).
``keys`` are 32-byte keys, ``parents`` each key's parent or None; tiers are
``"cpu"`` or a :class:`~kvtier.tiers.base.LowerTier` of the manager. Writes
are synchronous and confirmed by asking the destination tier.
"""

from __future__ import annotations

from typing import Sequence

from kvtier.storage.manager import StorageManager
from kvtier.storage.ops_args import Tier
from kvtier.storage.ops_staging import flush, held, stage_any, stage_via_cpu, write_staged
from kvtier.tiers.base import LowerTier

__all__ = ["export_to", "fill_lower", "import_into", "move_between"]


def move_between(
    m: StorageManager, keys: list[bytes], parents: list[bytes | None], src: Tier, dst: Tier, copy: bool
) -> dict[str, int]:
    """Move (or ``copy``) the chunks of ``src`` among ``keys`` to ``dst`` (``src != dst``),
    through a CPU slot; see :meth:`kvtier.storage.instance_ops.InstanceOps.move_local`.

    Returns ``{"moved": chunks now in dst, "bytes": moved * chunk_bytes}``.
    """
    flush(m)
    items = [(k, p) for k, p, ok in zip(keys, parents, held(m, src, keys)) if ok]
    staged = stage_any(m, items) if src == "cpu" else stage_via_cpu(m, src, items)
    added = [st.key for st in staged if st.added_to_cpu]
    write_staged(m, dst, staged)
    moved = [st.key for st, ok in zip(staged, held(m, dst, [st.key for st in staged])) if ok]
    if dst != "cpu" and added:
        m.cpu.delete_tree(added)  # the CPU copy was only the way through
    if not copy and moved:
        flush(m)
        if src == "cpu":
            m.cpu.delete_tree(moved)
        else:
            m.reporting(src).delete_many(moved)
    return {"moved": len(moved), "bytes": len(moved) * m.chunk_bytes}


def fill_lower(m: StorageManager, keys: list[bytes], parents: list[bytes | None], dst: LowerTier) -> int:
    """Write the ``keys`` lower tier ``dst`` lacks from wherever else ``m`` holds them;
    returns how many of ``keys`` ``dst`` holds afterwards."""
    flush(m)
    have = held(m, dst, keys)
    staged = stage_any(m, [(k, p) for k, p, h in zip(keys, parents, have) if not h], exclude=dst)
    write_staged(m, dst, staged)
    return sum(held(m, dst, keys))


def export_to(m: StorageManager, keys: list[bytes], parents: list[bytes | None], dst: LowerTier) -> dict[str, int]:
    """Make sure ``keys`` are in lower tier ``dst``; returns ``{"exported": keys dst holds afterwards}``."""
    return {"exported": fill_lower(m, keys, parents, dst)}


def import_into(m: StorageManager, keys: Sequence[bytes], parents: Sequence[bytes | None], dst: Tier) -> dict[str, int]:
    """Bring ``keys`` into ``dst`` (``"cpu"``: the manager's promotion path; a disk tier:
    a synchronous write); returns ``{"imported": keys dst holds afterwards}``."""
    if dst == "cpu":
        for h in m.open_read_many(list(zip(keys, parents))):
            if h is not None:
                h.close()
        return {"imported": sum(held(m, dst, keys))}
    return {"imported": fill_lower(m, list(keys), list(parents), dst)}
