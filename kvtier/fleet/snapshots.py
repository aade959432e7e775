"""The ``Snapshot`` messages of one namespace: every tier's (key, parent) entries, in parts.

A tier with more than :data:`~kvtier.protocol.fleet.MAX_KEYS_PER_PART` entries goes in
several parts; an empty tier is one empty part (the controller then drops what it held).
The last part of each tier carries the namespace's pinned keys.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

from kvtier.protocol import fleet as F


def snapshot_parts(
    instance_id: str,
    epoch: str,
    resync_id: int,
    digest: bytes,
    tiers: Mapping[str, Sequence[tuple[bytes, bytes | None]]],
    tier_kinds: Sequence[str],
    pinned: bytes,
    seq: int,
) -> Iterator[F.Snapshot]:
    """The parts of one namespace's snapshot, in send order.

    Args:
        instance_id / epoch: the sending agent's.
        resync_id: this snapshot's id (the same in every part).
        digest: the namespace digest.
        tiers: tier label -> (32-byte key, parent key or None) entries (``InstanceOps.snapshot()``).
        tier_kinds: the instance's tier labels; those absent from ``tiers`` are sent empty.
        pinned: the namespace's pinned keys, joined (n * 32 bytes), on each tier's last part.
        seq: the last ``Changes`` seq the snapshot covers.
    """
    names = list(tiers) + [kind for kind in tier_kinds if kind not in tiers]  # empty tiers too
    pinned = pinned[: F.MAX_KEYS_PER_PART * 32]  # informational; a part carries at most this many
    step = F.MAX_KEYS_PER_PART
    for tier in names:
        entries = list(tiers.get(tier, ()))
        starts = list(range(0, len(entries), step)) or [0]
        for i, start in enumerate(starts):
            part = entries[start : start + step]
            last = i == len(starts) - 1
            yield F.Snapshot(
                instance_id, epoch, resync_id, digest, tier,
                b"".join(k for k, _ in part), F.join_parents([p for _, p in part]),
                last, seq, pinned if last else b"",
            )
