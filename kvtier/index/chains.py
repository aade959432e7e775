"""The parent graph of stored chunks, and the rule that keeps it a forest.

Each stored chunk records a parent: the previous chunk of its prompt (None for a
prompt's first chunk). Real keys are chain hashes, so a parent is always stored
from an older prompt prefix and the links form a forest. A malformed or hostile
caller can name any key as a parent, though, and a link that closes a cycle (A's
parent B, B's parent A) leaves chunks that never become leaves: leaf-first
eviction never offers them and a leaf-first clear never reaches them.

The rule every holder of links keeps (the CPU tier's eviction policy, the disk
index): **a link ``key -> parent`` is made only if ``key`` is not ``parent`` nor
one of its recorded ancestors** (:func:`closes_cycle`, checked at the moment the
link is made, against the links recorded then). A request that would close a
cycle by its own links is refused before it reaches a tier (:func:`request_cycle`).
Every walk over links is bounded (:func:`descendants` visits each key once), so a
broken graph can never hang the lock it runs under. Pure functions; O(length of
the walk) each.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

__all__ = ["closes_cycle", "descendants", "first_cycle", "request_cycle"]


def closes_cycle(key: bytes, parent: bytes | None, parent_of: Callable[[bytes], bytes | None], limit: int) -> bool:
    """True if recording ``parent`` as ``key``'s parent would close a cycle.

    Args:
        key: a chunk that has no recorded parent yet (being stored).
        parent: the parent it names (None: a prompt's first chunk, never a cycle).
        parent_of: the recorded parent of a key (None: a first chunk, or not recorded).
        limit: the number of keys with a recorded parent; a walk up from ``parent``
            longer than that already runs round a cycle, and counts as one.

    Time: one ``parent_of`` call per ancestor of ``parent``, at most ``limit + 1``.
    """
    p = parent
    for _ in range(limit + 1):
        if p is None:
            return False
        if p == key:
            return True
        p = parent_of(p)
    return p is not None


def request_cycle(keys: Sequence[bytes], parents: Sequence[bytes | None]) -> int | None:
    """The position of a key that lies on a cycle made by the links of one request alone
    (``keys[i]``'s parent ``parents[i]``; a key given twice links by its first position),
    or None. Links to keys outside the request are not followed. O(len(keys)): about 1 us
    for 64 keys of one chain in order (each parent the key before), the common request."""
    if not keys or (parents[1:] == keys[:-1] and (parents[0] is None or parents[0] not in keys)):
        return None  # one chain in order: every link goes back to an earlier key
    links: dict[bytes, bytes | None] = {}
    for k, p in zip(keys, parents):
        links.setdefault(k, p)
    on = first_cycle(links)
    return None if on is None else list(keys).index(on)


def first_cycle(links: Mapping[bytes, bytes | None]) -> bytes | None:
    """A key on a cycle of ``links`` (key -> parent; a parent that is not a key ends a
    chain), or None when the links form a forest. O(len(links))."""
    done: set[bytes] = set()
    for start in links:
        path: set[bytes] = set()
        k: bytes | None = start
        while k is not None and k in links and k not in done:
            if k in path:
                return k
            path.add(k)
            k = links[k]
        done |= path
    return None


def descendants(roots: Iterable[bytes], children_of: Callable[[bytes], Iterable[bytes]]) -> list[bytes]:
    """``roots`` and every key below them (``children_of``: a key's recorded children), each
    once, in depth-first order (below one root, every key after its parent); a cycle is
    walked once round. O(keys visited)."""
    order: list[bytes] = []
    seen: set[bytes] = set()
    stack = list(roots)
    while stack:
        k = stack.pop()
        if k in seen:
            continue
        seen.add(k)
        order.append(k)
        stack.extend(c for c in children_of(k) if c not in seen)
    return order
