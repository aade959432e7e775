"""Holding chunks for the instance operations: tier probes, reads and staged chunks.

The helpers of :mod:`kvtier.storage.instance_ops` that touch tiers: whether
tiers hold keys, reading lower tiers into scratch buffers, and holding a chunk
from wherever the instance has it (a CPU read reference or a scratch buffer)
while an operation writes it elsewhere. A failing tier is a miss, never an
exception. ``tier`` arguments are ``"cpu"`` or a :class:`~kvtier.tiers.base.LowerTier`.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Callable, Sequence

import numpy as np

from kvtier.storage.lookup import contains_many_safe
from kvtier.storage.manager import StorageManager
from kvtier.storage.ops_args import Tier
from kvtier.tiers.base import ChunkWrite, LowerTier
from kvtier.tiers.cpu import WriteSkip

log = logging.getLogger(__name__)

__all__ = [
    "FLUSH_TIMEOUT_S", "Staged", "flush", "held", "label", "read_lower", "stage_any", "stage_via_cpu",
    "tier_state", "write_staged",
]

#: Seconds an operation waits for write-behind before writing or removing.
FLUSH_TIMEOUT_S = 30.0


class Staged:
    """A chunk held for an operation: ``buffer`` (uint8 ``[chunk_bytes]``) valid until ``close``."""

    __slots__ = ("key", "parent", "buffer", "_release", "added_to_cpu")

    def __init__(
        self, key: bytes, parent: bytes | None, buffer: np.ndarray,
        release: Callable[[], None] | None, added_to_cpu: bool = False,
    ):
        self.key = key
        self.parent = parent
        self.buffer = buffer
        self._release = release
        self.added_to_cpu = added_to_cpu

    def close(self) -> None:
        """Release the CPU read reference, if any (idempotent)."""
        if self._release is not None:
            self._release()
            self._release = None


def held(m: StorageManager, tier: Tier, keys: Sequence[bytes]) -> list[bool]:
    """Whether ``tier`` holds each of ``keys`` (all False for a failing tier)."""
    if tier == "cpu":
        return [m.cpu.contains(k) for k in keys]
    return contains_many_safe(tier, list(keys)) if keys else []


def label(tier: Tier) -> str:
    """The tier label of ``tier`` (``"cpu"`` or the lower tier's kind)."""
    return "cpu" if tier == "cpu" else tier.kind


def tier_state(tier: LowerTier) -> tuple[int | None, int | None]:
    """(chunks, used bytes) the tier accounts (None where it does not, or its stats fail)."""
    try:
        st = tier.stats()
    except Exception:
        return None, None
    return st.get("chunks"), st.get("used_bytes")


def flush(m: StorageManager) -> None:
    """Wait up to :data:`FLUSH_TIMEOUT_S` for ``m``'s write-behind (a warning if it does not drain)."""
    if not m.flush(FLUSH_TIMEOUT_S):
        log.warning("kvtier ops: write-behind did not drain within %.0f s", FLUSH_TIMEOUT_S)


def read_lower(tier: LowerTier, keys: Sequence[bytes], bufs: Sequence[np.ndarray]) -> list[bool]:
    """Read ``keys`` of ``tier`` into ``bufs`` (one uint8 ``[chunk_bytes]`` each); True per hit."""
    if not keys:
        return []
    try:
        return [bool(x) for x in tier.get_many_into(list(zip(keys, bufs)))]
    except Exception:  # defensive: a failing tier is a miss
        log.exception("kvtier ops: reading %s failed", tier.name)
        return [False] * len(keys)


def stage_any(m: StorageManager, items: Sequence[tuple[bytes, bytes | None]], exclude: object = None) -> list[Staged]:
    """Hold each ``(key, parent)`` chunk from the fastest tier (not ``exclude``) that returns it:
    a CPU read reference or a scratch buffer read from a lower tier. Misses are left out."""
    cpu = m.cpu
    out: list[Staged] = []
    todo: list[tuple[bytes, bytes | None]] = []
    for key, parent in items:
        buf = cpu.acquire(key) if exclude != "cpu" else None
        if buf is not None:
            out.append(Staged(key, parent, buf, partial(cpu.release, key)))
        else:
            todo.append((key, parent))
    for tier in m.lower:
        if not todo or tier is exclude:
            continue
        bufs = [np.empty(m.chunk_bytes, dtype=np.uint8) for _ in todo]
        got = read_lower(tier, [k for k, _ in todo], bufs)
        rest = []
        for (key, parent), buf, ok in zip(todo, bufs, got):
            if ok:
                out.append(Staged(key, parent, buf, None))
            else:
                rest.append((key, parent))
        todo = rest
    return out


def stage_via_cpu(m: StorageManager, src: LowerTier, items: Sequence[tuple[bytes, bytes | None]]) -> list[Staged]:
    """Read chunks of ``src`` into CPU slots (the promotion path: reserve, read, commit);
    a chunk the CPU holds already is taken from there; one no slot can be freed for
    is read into a scratch buffer. Misses are left out."""
    cpu = m.cpu
    out: list[Staged] = []
    reads: list[tuple[bytes, bytes | None, np.ndarray, bool]] = []
    for key, parent in items:
        got = cpu.try_reserve(key, parent)
        if isinstance(got, np.ndarray):
            reads.append((key, parent, got, True))
            continue
        buf = cpu.acquire(key) if got is WriteSkip.PRESENT else None
        if buf is not None:
            out.append(Staged(key, parent, buf, partial(cpu.release, key)))
        else:
            reads.append((key, parent, np.empty(m.chunk_bytes, dtype=np.uint8), False))
    got_ok = read_lower(src, [r[0] for r in reads], [r[2] for r in reads])
    for (key, parent, buf, reserved), ok in zip(reads, got_ok):
        if not reserved:
            if ok:
                out.append(Staged(key, parent, buf, None))
            continue
        if not ok:
            cpu.abort(key)
            continue
        parent = cpu.commit(key, parent)  # the parent kept (none that closes a cycle)
        view = cpu.acquire(key)
        if view is not None:
            out.append(Staged(key, parent, view, partial(cpu.release, key), added_to_cpu=True))
    return out


def write_staged(m: StorageManager, dst: Tier, staged: Sequence[Staged]) -> None:
    """Write ``staged`` into lower tier ``dst`` synchronously (nothing for ``"cpu"``), then
    close every staged chunk (also when the write raises)."""
    try:
        if dst != "cpu":
            m.reporting(dst).put_many([ChunkWrite(st.key, st.parent, st.buffer) for st in staged])
    finally:
        for st in staged:
            st.close()
