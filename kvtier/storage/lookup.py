"""The lookup walk: the longest run of a prompt's chunk keys that some tier holds.

One walk over the tiers, fastest first: the CPU tier and the local lower tiers
(disk) are asked about every key (dictionary look-ups, no I/O); then each
remaining lower tier (remote, peer) is asked, in ONE batched ``contains_many``
(one round trip), about the keys the faster tiers miss from the first gap on.
Each hit is labelled with the fastest tier kind that holds it. A failing tier
answers misses (never raises). With ``on_absent``, the keys a non-local tier
*answered* absent are passed on (see :mod:`kvtier.storage.stale_remote`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

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


def contains_many_known_safe(tier: LowerTier, keys: Sequence[bytes]) -> tuple[list[bool], list[bool]]:
    """``tier.contains_many_known(keys)``: (found, answered); nothing found or answered if it raises."""
    if not keys:
        return [], []
    try:
        found, answered = tier.contains_many_known(keys)
    except Exception:  # defensive: a failing tier is a miss, and says nothing about absence
        log.exception("kvtier: %s contains_many failed", tier.name)
        return [False] * len(keys), [False] * len(keys)
    if len(found) != len(keys) or len(answered) != len(keys):  # pragma: no cover - a broken plug-in
        log.error("kvtier: %s answered %d of %d keys", tier.name, len(found), len(keys))
        return [False] * len(keys), [False] * len(keys)
    return [bool(x) for x in found], [bool(x) for x in answered]


#: Called with a non-local tier and the keys it answered absent.
OnAbsent = Callable[[LowerTier, list[bytes]], None]


def held_prefix(
    keys: Sequence[bytes],
    lower: Sequence[LowerTier],
    cpu: CpuTier | None = None,
    local_only: bool = False,
    on_absent: OnAbsent | None = None,
) -> list[str]:
    """Tier labels of the longest prefix of ``keys`` held by some tier.

    Args:
        keys: chunk keys in prompt order.
        lower: lower tiers, fastest first.
        cpu: the CPU tier (None: lower tiers only).
        local_only: ask only the CPU and local (disk) tiers: no network round trip.
        on_absent: called (on this thread) with each non-local tier and the keys it
            answered absent (not those a failure left unanswered); it must not raise.

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
        local = tier.local
        if local_only and not local:
            continue
        start = _first_gap(labels)
        if start == n:
            break
        ask = [i for i in range(start, n) if labels[i] is None]
        if on_absent is None or local:
            found = contains_many_safe(tier, [keys[i] for i in ask])
        else:
            found, answered = contains_many_known_safe(tier, [keys[i] for i in ask])
            absent = [keys[i] for i, f, a in zip(ask, found, answered) if a and not f]
            if absent:
                on_absent(tier, absent)
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
