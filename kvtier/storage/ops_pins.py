"""Operator pins: the bodies of ``pin``, ``unpin`` and ``pinned_keys``.

A pin is a lease owned by ``"pin:" + pin_id`` (:data:`~kvtier.storage.leases.PIN_PREFIX`):
its chunks are never evicted from the CPU or disk tier. The union of all pins
may cover at most half of the CPU tier's slots. Arguments are already checked
(:mod:`kvtier.storage.ops_args`); ``grant_pin`` and ``end_pin`` run under the
operations lock (:class:`kvtier.storage.instance_ops.InstanceOps`).
"""

from __future__ import annotations

from kvtier.storage.leases import PIN_PREFIX
from kvtier.storage.lookup import contains_many_safe
from kvtier.storage.manager import StorageManager
from kvtier.storage.ops_args import OpError

__all__ = ["end_pin", "grant_pin", "pinned"]


def pinned(m: StorageManager) -> list[bytes]:
    """Keys of every live pin (each once, in pin order)."""
    leases = m.leases
    seen: dict[bytes, None] = {}
    for owner in leases.owners(PIN_PREFIX):
        for k in leases.keys_of(owner):
            seen[k] = None
    return list(seen)


def grant_pin(m: StorageManager, keys: list[bytes], pin_id: str, ttl_s: float | None) -> dict[str, int]:
    """Pin ``keys`` under ``pin_id`` (replacing that pin) for ``ttl_s`` seconds (None: until unpinned).

    Returns ``{"pinned": how many of keys some tier holds now}``.

    Raises:
        OpError: all pins together would cover more than half of the CPU tier's chunk slots.
    """
    owner = PIN_PREFIX + pin_id
    others: set[bytes] = set()
    for o in m.leases.owners(PIN_PREFIX):
        if o != owner:
            others.update(m.leases.keys_of(o))
    total = len(others | set(keys))
    limit = m.cpu.pool.num_slots // 2
    if total > limit:
        raise OpError(
            f"keys: pins would cover {total} chunks, more than half of the CPU tier's "
            f"{m.cpu.pool.num_slots} chunk slots (limit {limit})"
        )
    m.leases.grant(owner, keys, ttl_s)
    held = [m.cpu.contains(k) for k in keys]
    for tier in m.lower:
        ask = [i for i, h in enumerate(held) if not h]
        if not ask:
            break
        for i, ok in zip(ask, contains_many_safe(tier, [keys[i] for i in ask])):
            held[i] = ok
    return {"pinned": sum(held)}


def end_pin(m: StorageManager, pin_id: str) -> dict[str, int]:
    """End pin ``pin_id``; returns ``{"unpinned": keys it covered}`` (0 for an unknown pin)."""
    owner = PIN_PREFIX + pin_id
    n = len(m.leases.keys_of(owner))
    m.leases.release(owner)
    return {"unpinned": n}
