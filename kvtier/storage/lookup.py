"""The lookup walk: the longest run of a prompt's chunk keys that some tier holds.

One walk over the tiers, fastest first: the CPU tier and the local lower tiers
(disk) are asked about every key (dictionary look-ups, no I/O); then each
remaining lower tier (remote, peer) is asked, in ONE batched ``contains_many``
(one round trip), about the keys the faster tiers miss from the first gap on.
Each hit is labelled with the fastest tier kind that holds it. A failing tier
answers misses (never raises). The storage manager walks its tiers behind their
:class:`~kvtier.storage.reporting_tier.ReportingTier`, which reports the keys a
non-local store *answered* absent (see :mod:`kvtier.storage.stale_remote`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.tiers.base import LowerTier
from kvtier.tiers.cpu import CpuTier

log = logging.getLogger(__name__)


def contains_many_safe(tier: LowerTier, keys: Sequence[bytes]) -> list[bool]:
    """``tier.contains_many(keys)``, all False if the tier raises (a failing tier is a miss)."""
    if not keys:
        return []
    try:
        found = tier.contains_many(keys)
    except Exception:  # defensive: tiers should not raise, but a bug must not reach the engine
        log.exception("kvtier: %s contains_many failed", tier.name)
        return [False] * len(keys)
    if len(found) != len(keys):  # pragma: no cover - a broken plug-in
        log.error("kvtier: %s answered %d of %d keys", tier.name, len(found), len(keys))
        return [False] * len(keys)
    return [bool(x) for x in found]


def held_prefix(
    keys: Sequence[bytes],
    lower: Sequence[LowerTier],
    cpu: CpuTier | None = None,
    local_only: bool = False,
) -> list[str]:
    """Tier labels of the longest prefix of ``keys`` held by some tier.

    Args:
        keys: chunk keys in prompt order.
        lower: lower tiers, fastest first.
        cpu: the CPU tier (None: lower tiers only).
        local_only: ask only the CPU and local (disk) tiers: no network round trip.

    Returns:
        One label per leading hit (a :data:`~kvtier.storage.types.TIER_KINDS`
        entry); ``len(result)`` chunks of ``keys`` are held.
    """
    n = len(keys)
    labels: list[str | None] = [None] * n
    if cpu is not None:
        for i, key in enumerate(keys):
            if cpu.contains(key):
                labels[i] = "cpu"
    for tier in lower:
        if local_only and not tier.local:
            continue
        start = _first_gap(labels)
        if start == n:
            break
        ask = [i for i in range(start, n) if labels[i] is None]
        found = contains_many_safe(tier, [keys[i] for i in ask])
        for i, ok in zip(ask, found):
            if ok:
                labels[i] = tier.kind
    out: list[str] = []
    for label in labels:
        if label is None:
            break
        out.append(label)
    return out


def _first_gap(labels: Sequence[str | None]) -> int:
    for i, label in enumerate(labels):
        if label is None:
            return i
    return len(labels)
